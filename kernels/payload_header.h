// Wire format v1 (docs/format.md): the 64-byte payload header, its checks, and reading and
// writing it, one definition for host and device.
#pragma once

#include <string.h>

#include "math/half.h"
#include "math/q2_math.h"
#include "math/q4_math.h"

namespace gradcomp {

constexpr uint64_t kPayloadHeaderBytes = 64;

namespace format {

constexpr uint32_t kPayloadMagic = 0x504D4347u;  // "GCMP" in little-endian byte order
constexpr uint16_t kFormatVersion = 2;           // 2: the header carries a checksum of the sections
constexpr uint64_t kSectionAlign = 16;

// Codec codes; gradcomp::Codec has the same values (static_assert in types.h).
enum : uint8_t { kCodecQ4 = 1, kCodecTopK = 2, kCodecQ2 = 3 };

struct PayloadHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t codec;
  uint8_t dtype;        // dtype of the encoded input
  uint8_t value_dtype;  // top-k value storage; f32 for q4 scales, bf16 for q2 scales
  uint8_t flags;        // bit 0: stochastic rounding (q4, q2)
  uint16_t reserved0;
  uint32_t param;  // q4, q2: block size; top-k: capacity (entries the sections hold)
  uint64_t numel;
  uint64_t count;  // q4, q2: number of blocks; top-k: entries present (<= capacity)
  uint64_t section0_bytes;
  uint64_t section1_bytes;
  uint64_t body_checksum;  // body_checksum() of everything after the header
  uint32_t reserved2;
  uint32_t checksum;  // FNV-1a of the 60 bytes before it
};
static_assert(sizeof(PayloadHeader) == kPayloadHeaderBytes, "the header is 64 bytes on the wire");

GRADCOMP_HD uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

GRADCOMP_HD uint32_t header_checksum(const PayloadHeader& h) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(&h);
  uint32_t x = 2166136261u;
  for (int i = 0; i < 60; ++i) {
    x ^= p[i];
    x *= 16777619u;
  }
  return x;
}

// The header of a block codec's payload (q4: float32 steps, codes two per byte; q2: bfloat16
// steps, codes four per byte). One body for both, so a decoder that expects either divides once.
GRADCOMP_HD PayloadHeader make_block_header(uint8_t codec, uint64_t numel, uint32_t block,
                                            uint8_t dtype, bool stochastic) {
  const bool q2 = codec == kCodecQ2;
  PayloadHeader h;
  h.magic = kPayloadMagic;
  h.version = kFormatVersion;
  h.codec = codec;
  h.dtype = dtype;
  h.value_dtype = q2 ? math::kDtypeBF16 : math::kDtypeF32;
  h.flags = stochastic ? 1 : 0;
  h.reserved0 = 0;
  h.param = block;
  h.numel = numel;
  h.count = math::q4_num_blocks(numel, block);  // q2_num_blocks: the same rule
  h.section0_bytes = h.count * (q2 ? 2 : 4);
  h.section1_bytes = q2 ? math::q2_code_bytes(numel) : (numel + 1) / 2;
  h.body_checksum = 0;
  h.reserved2 = 0;
  h.checksum = header_checksum(h);
  return h;
}

GRADCOMP_HD PayloadHeader make_q4_header(uint64_t numel, uint32_t block, uint8_t dtype,
                                         bool stochastic) {
  return make_block_header(kCodecQ4, numel, block, dtype, stochastic);
}

GRADCOMP_HD PayloadHeader make_q2_header(uint64_t numel, uint32_t block, uint8_t dtype,
                                         bool stochastic) {
  return make_block_header(kCodecQ2, numel, block, dtype, stochastic);
}

GRADCOMP_HD PayloadHeader make_topk_header(uint64_t numel, uint32_t capacity, uint64_t count,
                                           uint8_t dtype, uint8_t value_dtype) {
  PayloadHeader h;
  h.magic = kPayloadMagic;
  h.version = kFormatVersion;
  h.codec = kCodecTopK;
  h.dtype = dtype;
  h.value_dtype = value_dtype;
  h.flags = 0;
  h.reserved0 = 0;
  h.param = capacity;
  h.numel = numel;
  h.count = count;
  h.section0_bytes = (uint64_t)capacity * 4;
  h.section1_bytes = (uint64_t)capacity * math::dtype_bytes(value_dtype);
  h.body_checksum = 0;
  h.reserved2 = 0;
  h.checksum = header_checksum(h);
  return h;
}

// Where section 1 (q4 and q2 codes, top-k values) starts; section 0 (scales, indices) follows the
// header.
GRADCOMP_HD uint64_t section1_offset(const PayloadHeader& h) {
  return kPayloadHeaderBytes + align_up(h.section0_bytes, kSectionAlign);
}

GRADCOMP_HD uint64_t payload_bytes_of(const PayloadHeader& h) {
  return section1_offset(h) + align_up(h.section1_bytes, kSectionAlign);
}

// The checksum of a payload's sections: the sum over the little-endian 32-bit words w_i of bytes
// [64, total) of w_i * (2i + 1), mod 2^64. Every flipped bit changes it (2^b times an odd number
// is never 0 mod 2^64), as does swapping two different words; and its terms add in any order, so
// the GPU sums them in parallel.
GRADCOMP_HD uint64_t body_checksum_term(uint32_t word, uint64_t i) {
  return (uint64_t)word * (2 * i + 1);
}

// The whole sum, on one thread (the host's encoders and decoders). total is a multiple of 16.
GRADCOMP_HD uint64_t body_checksum(const uint8_t* payload, uint64_t total) {
  uint64_t sum = 0;
  const uint64_t words = (total - kPayloadHeaderBytes) / 4;
  for (uint64_t i = 0; i < words; ++i) {
    uint32_t w;
    memcpy(&w, payload + kPayloadHeaderBytes + 4 * i, 4);
    sum += body_checksum_term(w, i);
  }
  return sum;
}

// A header with its body checksum set and the header checksum redone.
GRADCOMP_HD PayloadHeader with_body_checksum(PayloadHeader h, uint64_t sum) {
  h.body_checksum = sum;
  h.checksum = header_checksum(h);
  return h;
}

// The header a decoder expects of a payload of `numel` elements (param: q4 / q2 block size or
// top-k capacity; count: top-k's entries present, ignored by the block codecs).
GRADCOMP_HD PayloadHeader expected_header(uint8_t codec, uint64_t numel, uint32_t param,
                                          uint64_t count, uint8_t dtype, bool stochastic,
                                          uint8_t value_dtype) {
  if (codec == kCodecQ4 || codec == kCodecQ2)
    return make_block_header(codec, numel, param, dtype, stochastic);
  return make_topk_header(numel, param, count, dtype, value_dtype);
}

// The layout a decoder expects of a payload of `numel` elements: what check_header compares with
// and how many bytes the body checksum covers.
GRADCOMP_HD uint64_t expected_payload_bytes(uint8_t codec, uint64_t numel, uint32_t param,
                                            uint8_t value_dtype) {
  return payload_bytes_of(expected_header(codec, numel, param, 0, 0, false, value_dtype));
}

// Why a decoder refuses a payload (0: it does not). The one list of these codes; the CUDA
// decoders report them through a device status word.
enum PayloadStatus : int {
  kPayloadOk = 0,
  kBadMagic,
  kBadVersion,
  kBadChecksum,
  kBadCodec,
  kBadDtype,
  kLayoutMismatch,
  kBadCount,
  kTruncated,
  kBadIndex,         // a top-k index out of range or out of order
  kBadBodyChecksum,  // the sections do not match the header's body checksum
};

// Checks a header against the expected codec, element count, block size or capacity and the
// payload's byte length. Sizes are recomputed here, never trusted from the header.
GRADCOMP_HD int check_header(const PayloadHeader& h, uint8_t codec, uint64_t numel, uint32_t param,
                             uint8_t value_dtype, uint64_t available_bytes) {
  if (h.magic != kPayloadMagic) return kBadMagic;
  if (h.version != kFormatVersion) return kBadVersion;
  if (h.checksum != header_checksum(h)) return kBadChecksum;
  if (h.codec != codec) return kBadCodec;
  if (!math::dtype_valid(h.dtype) || h.value_dtype != value_dtype) return kBadDtype;
  if (h.numel != numel || h.param != param) return kLayoutMismatch;
  const bool blocks = codec == kCodecQ4 || codec == kCodecQ2;
  PayloadHeader expect =
      expected_header(codec, numel, param, h.count, h.dtype, (h.flags & 1) != 0, value_dtype);
  if (h.section0_bytes != expect.section0_bytes || h.section1_bytes != expect.section1_bytes)
    return kLayoutMismatch;
  if (blocks ? h.count != expect.count : (h.count > param || h.count > numel)) return kBadCount;
  if (payload_bytes_of(expect) > available_bytes) return kTruncated;
  return kPayloadOk;
}

// Writes the header and zeroes the alignment padding after each section, so a payload's bytes
// are fully determined by its contents. One thread on the device.
GRADCOMP_HD void write_header(uint8_t* payload, const PayloadHeader& h) {
#if defined(__CUDA_ARCH__)
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&h);
  uint32_t* dst = reinterpret_cast<uint32_t*>(payload);
  for (int i = 0; i < static_cast<int>(sizeof h / 4); ++i) dst[i] = src[i];
#else
  memcpy(payload, &h, sizeof h);
#endif
  const uint64_t s1 = section1_offset(h);
  for (uint64_t i = kPayloadHeaderBytes + h.section0_bytes; i < s1; ++i) payload[i] = 0;
  const uint64_t total = payload_bytes_of(h);
  for (uint64_t i = s1 + h.section1_bytes; i < total; ++i) payload[i] = 0;
}

// The host encoders' last step, once the sections are written: the header with the body
// checksum, and the padding zeroed.
inline void seal_payload(uint8_t* payload, const PayloadHeader& h) {
  write_header(payload, h);
  const PayloadHeader sealed = with_body_checksum(h, body_checksum(payload, payload_bytes_of(h)));
  memcpy(payload, &sealed, sizeof sealed);
}

GRADCOMP_HD PayloadHeader read_header(const uint8_t* payload) {
  PayloadHeader h;
#if defined(__CUDA_ARCH__)
  const uint32_t* src = reinterpret_cast<const uint32_t*>(payload);
  uint32_t* dst = reinterpret_cast<uint32_t*>(&h);
  for (int i = 0; i < static_cast<int>(sizeof h / 4); ++i) dst[i] = src[i];
#else
  memcpy(&h, payload, sizeof h);
#endif
  return h;
}

}  // namespace format
}  // namespace gradcomp
