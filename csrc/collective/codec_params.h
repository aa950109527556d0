// Params structs filled from a bucket's place and the codec options, for the collectives.
#pragma once

#include "gradcomp/collectives.h"

namespace gradcomp {
namespace detail {

// Encode params of elements [begin, begin + numel) of a flattened bucket, residuals unset.
inline Q4EncodeParams q4_encode_params(const Segment* segments, int num_segments, uint8_t dtype,
                                       int64_t begin, int64_t numel,
                                       const CompressionConfig& config, math::RngKey rng,
                                       uint8_t* payload) {
  const Q4Options& q4 = config.q4;
  Q4EncodeParams e;
  e.codec = block_wire_codec(config);
  e.segments = segments;
  e.num_segments = num_segments;
  e.dtype = dtype;
  e.begin = begin;
  e.numel = numel;
  e.block_size = static_cast<uint32_t>(q4.block_size);
  e.stochastic = q4.rounding == Rounding::kStochastic;
  e.rng = rng;
  e.payload = payload;
  return e;
}

// Decode params writing elements [begin, begin + numel) of a flattened bucket.
inline Q4DecodeParams q4_decode_params(const uint8_t* const* payloads, int num_payloads,
                                       uint64_t payload_bytes, int64_t numel,
                                       const CompressionConfig& config, const Segment* segments,
                                       int num_segments, uint8_t dtype, int64_t begin,
                                       float divisor) {
  Q4DecodeParams d;
  d.codec = block_wire_codec(config);
  d.payloads = payloads;
  d.num_payloads = num_payloads;
  d.payload_bytes = payload_bytes;
  d.numel = numel;
  d.block_size = static_cast<uint32_t>(config.q4.block_size);
  d.segments = segments;
  d.num_segments = num_segments;
  d.dtype = dtype;
  d.begin = begin;
  d.divisor = divisor;
  return d;
}

// Check params of num_payloads q4 (q2) payloads, payload w holding numel[w] elements, in rank order
// (the errors name the rank).
inline PayloadCheckParams q4_check_params(const uint8_t* const* payloads, int num_payloads,
                                          uint64_t payload_bytes, const int64_t* numel,
                                          const CompressionConfig& config) {
  PayloadCheckParams check;
  check.payloads = payloads;
  check.num_payloads = num_payloads;
  check.payload_bytes = payload_bytes;
  check.numel = numel;
  check.codec = block_wire_codec(config);
  check.param = static_cast<uint32_t>(config.q4.block_size);
  // q2 scales travel as bfloat16 (the header's value dtype), q4's as float32.
  check.value_dtype = check.codec == format::kCodecQ2 ? math::kDtypeBF16 : math::kDtypeF32;
  return check;
}

}  // namespace detail
}  // namespace gradcomp
