// Torch-free parameter structs shared by the CPU reference backend and the CUDA launchers.
#pragma once

#include <stdint.h>

#include "element_math.h"

namespace gradcomp {

// One tensor of a bucket. A bucket is a list of segments read as if flattened in order;
// `offset` is the segment's first element in that flattened view. Segment tables passed to a
// CUDA launcher live in device memory; those passed to the CPU backend in host memory.
struct Segment {
  void* data = nullptr;
  int64_t offset = 0;
  int64_t numel = 0;
};

// Encodes elements [begin, begin + numel) of the flattened segments into one q4 payload.
struct Q4EncodeParams {
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t begin = 0;  // a multiple of block_size, so blocks and random groups line up
  int64_t numel = 0;
  // Error feedback: reads input + residual_in, writes the new residual to residual_out (both
  // indexed from 0 for element `begin`; they may alias). Null residual_in reads as zeros; null
  // residual_out disables error feedback.
  const void* residual_in = nullptr;
  void* residual_out = nullptr;
  uint8_t residual_dtype = math::kDtypeF32;
  uint32_t block_size = 64;
  bool stochastic = true;
  math::RngKey rng = {0, 0, 0, 0, 0};
  uint8_t* payload = nullptr;  // q4_payload_bytes(numel, block_size) bytes
};

// Decodes num_payloads q4 payloads of `numel` elements each, sums them in fp32 in payload order,
// divides by `divisor` and writes elements [begin, begin + numel) of the flattened output.
struct Q4DecodeParams {
  const uint8_t* const* payloads = nullptr;
  int num_payloads = 0;
  uint64_t payload_bytes = 0;  // bytes available behind each payload pointer
  int64_t numel = 0;
  uint32_t block_size = 64;
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t begin = 0;
  float divisor = 1.0f;
  int32_t* status = nullptr;      // CUDA: device word receiving the first HeaderStatus seen
  uint32_t* nonfinite = nullptr;  // optional: set non-zero when a decoded block is non-finite
};

// Selects the top-k |input + residual| of elements [begin, begin + numel) into one payload.
struct TopKEncodeParams {
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t begin = 0;
  int64_t numel = 0;
  const void* residual_in = nullptr;
  void* residual_out = nullptr;
  uint8_t residual_dtype = math::kDtypeF32;
  int64_t k = 1;          // exact: entries selected; approximate: target count
  uint32_t capacity = 1;  // entries the payload holds (== k in exact mode)
  bool exact = true;
  uint8_t value_dtype = math::kDtypeF32;
  uint8_t* payload = nullptr;  // topk_payload_bytes(capacity, value_dtype) bytes
  void* workspace = nullptr;   // the backend's topk_workspace_bytes(numel); optional on the CPU
};

// Scatter-adds num_payloads top-k payloads into zeroed fp32 sums, divides by `divisor` and
// writes elements [begin, begin + numel) of the flattened output.
struct TopKDecodeParams {
  const uint8_t* const* payloads = nullptr;
  int num_payloads = 0;
  uint64_t payload_bytes = 0;
  int64_t numel = 0;
  uint32_t capacity = 1;
  uint8_t value_dtype = math::kDtypeF32;
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t begin = 0;
  float divisor = 1.0f;
  int32_t* status = nullptr;
  uint32_t* nonfinite = nullptr;
  void* workspace = nullptr;  // numel fp32 sums; optional on the CPU
};

// A residual buffer one bucket's reduction wrote (candidate) and the one it started from
// (committed).
struct ResidualPair {
  void* candidate = nullptr;
  const void* committed = nullptr;
  uint64_t bytes = 0;
};

// Ends a bucket's reduction in stream order: when *nonfinite is set, every pair's committed
// bytes are copied over its candidate and *nonfinite_buckets is incremented.
struct EndBucketParams {
  static constexpr int kMaxPairs = 2;
  ResidualPair pairs[kMaxPairs];
  int num_pairs = 0;
  const uint32_t* nonfinite = nullptr;
  uint32_t* nonfinite_buckets = nullptr;
};

}  // namespace gradcomp
