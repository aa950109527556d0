// The v2 q4 kernels' index map: which elements and payload bytes each warp and lane touch.
// Host and device share it, so host tests prove every payload and output byte is written once.
#pragma once

#include "payload_header.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

constexpr int kWarpLanes = 32;
constexpr int kLaneElements = math::kRandomGroup;          // one Philox call per lane
constexpr int kSpanElements = kWarpLanes * kLaneElements;  // one warp's 256 elements
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpLanes;

// Where a q4 payload's parts sit (docs/format.md), from its element count and block size.
struct Q4Layout {
  uint64_t numel = 0;
  uint32_t log2_block = 6;
  uint64_t num_blocks = 0;
  uint64_t scales_at = kPayloadHeaderBytes;
  uint64_t codes_at = 0;
  uint64_t codes_end = 0;  // codes_at + (numel + 1) / 2
  uint64_t total = 0;
};

GRADCOMP_HD uint32_t log2_of_power_of_two(uint32_t x) {
  uint32_t l = 0;
  while ((1u << l) < x) ++l;
  return l;
}

GRADCOMP_HD Q4Layout q4_layout(uint64_t numel, uint32_t block) {
  const format::PayloadHeader h = format::make_q4_header(numel, block, 0, false);
  Q4Layout l;
  l.numel = numel;
  l.log2_block = log2_of_power_of_two(block);
  l.num_blocks = h.count;
  l.codes_at = format::section1_offset(h);
  l.codes_end = l.codes_at + h.section1_bytes;
  l.total = format::payload_bytes_of(h);
  return l;
}

// Warp spans: span s holds elements [256 s, 256 s + 256) of the payload (fewer in the last).
GRADCOMP_HD uint64_t num_spans(uint64_t numel) {
  return (numel + kSpanElements - 1) / kSpanElements;
}
GRADCOMP_HD uint64_t full_spans(uint64_t numel) {
  return numel / kSpanElements;
}

// The first element of lane `lane` in span s, and how many of its 8 exist.
GRADCOMP_HD uint64_t lane_first(uint64_t span, int lane) {
  return span * kSpanElements + static_cast<uint64_t>(lane) * kLaneElements;
}
GRADCOMP_HD int lane_count(uint64_t numel, uint64_t first) {
  return first >= numel
             ? 0
             : (numel - first < kLaneElements ? static_cast<int>(numel - first) : kLaneElements);
}

// The lanes that share a quant block (block / 8 of them, aligned): the first writes its scale.
GRADCOMP_HD bool lane_writes_scale(const Q4Layout& l, uint64_t first, int count) {
  return count > 0 && (first & ((uint64_t{1} << l.log2_block) - 1)) == 0;
}
GRADCOMP_HD uint64_t scale_index(const Q4Layout& l, uint64_t first) {
  return first >> l.log2_block;
}

// A lane's code bytes: [codes_at + first / 2, + (count + 1) / 2); a full lane stores them as one
// 32-bit word, word index (from the start of the body) codes_word0 + first / 8.
GRADCOMP_HD uint64_t code_bytes_at(const Q4Layout& l, uint64_t first) {
  return l.codes_at + first / 2;
}
GRADCOMP_HD int code_byte_count(int count) {
  return (count + 1) / 2;
}
GRADCOMP_HD uint64_t body_word_index(uint64_t byte_offset) {
  return (byte_offset - kPayloadHeaderBytes) / 4;
}

// The padding the sealing writes as zeros: after the scales and after the codes.
GRADCOMP_HD uint64_t scale_padding_at(const Q4Layout& l) {
  return l.scales_at + 4 * l.num_blocks;
}

// The decoders' fp32 stores: a warp's full span goes out as two rounds of 16 bytes a lane, lane l
// writing elements [4 (l + 32 r), + 4) of the span in round r, so each store instruction
// writes 512 contiguous bytes.
GRADCOMP_HD uint64_t fp32_store_first(uint64_t span, int lane, int round) {
  return span * kSpanElements + 4 * static_cast<uint64_t>(lane + kWarpLanes * round);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
