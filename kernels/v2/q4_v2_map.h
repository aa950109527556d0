// The v2 block-codec kernels' index map (q4, q2): which elements and payload bytes each warp and
// lane touch. Host and device share it, so host tests prove every payload byte is written once.
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

// Where a q4 or q2 payload's parts sit (docs/format.md), from its codec, element count and block
// size. q4: 4-byte scales, two codes a byte; q2: 2-byte scales, four codes a byte.
struct BlockLayout {
  uint64_t numel = 0;
  uint32_t log2_block = 6;
  uint32_t log2_codes_per_byte = 1;
  uint32_t scale_bytes = 4;
  uint64_t num_blocks = 0;
  uint64_t scales_at = kPayloadHeaderBytes;
  uint64_t codes_at = 0;
  uint64_t codes_end = 0;  // codes_at + the code bytes
  uint64_t total = 0;
};

GRADCOMP_HD uint32_t log2_of_power_of_two(uint32_t x) {
  uint32_t l = 0;
  while ((1u << l) < x) ++l;
  return l;
}

GRADCOMP_HD BlockLayout block_layout(uint8_t codec, uint64_t numel, uint32_t block) {
  const format::PayloadHeader h = format::make_block_header(codec, numel, block, 0, false);
  const bool q2 = codec == format::kCodecQ2;
  BlockLayout l;
  l.numel = numel;
  l.log2_block = log2_of_power_of_two(block);
  l.log2_codes_per_byte = q2 ? 2 : 1;
  l.scale_bytes = q2 ? 2 : 4;
  l.num_blocks = h.count;
  l.codes_at = format::section1_offset(h);
  l.codes_end = l.codes_at + h.section1_bytes;
  l.total = format::payload_bytes_of(h);
  return l;
}

GRADCOMP_HD BlockLayout q4_layout(uint64_t numel, uint32_t block) {
  return block_layout(format::kCodecQ4, numel, block);
}
GRADCOMP_HD BlockLayout q2_layout(uint64_t numel, uint32_t block) {
  return block_layout(format::kCodecQ2, numel, block);
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
GRADCOMP_HD bool lane_writes_scale(const BlockLayout& l, uint64_t first, int count) {
  return count > 0 && (first & ((uint64_t{1} << l.log2_block) - 1)) == 0;
}
GRADCOMP_HD uint64_t scale_index(const BlockLayout& l, uint64_t first) {
  return first >> l.log2_block;
}

// A lane's code bytes: q4 [codes_at + first / 2, + (count + 1) / 2), one aligned 32-bit word for
// a full lane; q2 [codes_at + first / 4, + (count + 3) / 4), one aligned 16-bit half-word.
GRADCOMP_HD uint64_t code_bytes_at(const BlockLayout& l, uint64_t first) {
  return l.codes_at + (first >> l.log2_codes_per_byte);
}
GRADCOMP_HD int code_byte_count(int count) {
  return (count + 1) / 2;
}
GRADCOMP_HD int code_byte_count(const BlockLayout& l, int count) {
  return (count + (1 << l.log2_codes_per_byte) - 1) >> l.log2_codes_per_byte;
}
GRADCOMP_HD uint64_t body_word_index(uint64_t byte_offset) {
  return (byte_offset - kPayloadHeaderBytes) / 4;
}
// The checksum term of `value` written at `byte_offset` of the payload, its bytes inside one body
// word (a q2 lane's codes or scale fill half a word): the term is linear in the word, so the
// halves of a word add their terms apart.
GRADCOMP_HD uint64_t body_term_at(uint32_t value, uint64_t byte_offset) {
  return format::body_checksum_term(value << (8 * (byte_offset & 3)), body_word_index(byte_offset));
}

// The padding the sealing writes as zeros: after the scales and after the codes.
GRADCOMP_HD uint64_t scale_padding_at(const BlockLayout& l) {
  return l.scales_at + l.scale_bytes * l.num_blocks;
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
