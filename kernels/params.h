// The params structs every codec takes (CPU codecs and CUDA launchers alike) and their rules.
#pragma once

#include <stdint.h>

#include "math/half.h"
#include "math/philox.h"
#include "math/q2_math.h"
#include "math/q4_math.h"
#include "math/topk_math.h"
#include "payload_header.h"

namespace gradcomp {

// One tensor of a bucket. A bucket is a list of segments read as if flattened in order;
// `offset` is the segment's first element in that flattened view. Segment tables passed to a
// CUDA launcher live in device memory; those passed to the CPU backend in host memory.
struct Segment {
  void* data = nullptr;
  int64_t offset = 0;
  int64_t numel = 0;
};

// Encodes elements [begin, begin + numel) of the flattened segments into one q4 payload, or one
// q2 payload (codec kCodecQ2: the same blocks, error feedback and random bits, 2-bit codes).
struct Q4EncodeParams {
  uint8_t codec = format::kCodecQ4;  // kCodecQ4 or kCodecQ2
  const Segment* segments = nullptr;
  int num_segments = 0;
  // CUDA v2: the host copy of the segment table, if the caller has one (it picks the kernel
  // for one 16-byte aligned segment; without it the general kernel runs, same bytes).
  const Segment* segments_host = nullptr;
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
  uint8_t* payload = nullptr;  // q4_payload_bytes (q2_payload_bytes) of numel, block_size
  // Optional word in the backend's memory (the reduce-scatter's poison flag, set by a non-finite
  // scan): when it is non-zero, element `begin` is read as NaN, so the payload says non-finite
  // without the host reading the flag. CUDA: v2 kernels only.
  const uint32_t* nan_head = nullptr;
};

// Decodes num_payloads q4 (or q2) payloads of `numel` elements each, sums them in fp32 in payload
// order, divides by `divisor` and writes elements [begin, begin + numel) of the flattened output.
struct Q4DecodeParams {
  uint8_t codec = format::kCodecQ4;  // kCodecQ4 or kCodecQ2
  const uint8_t* const* payloads = nullptr;
  int num_payloads = 0;
  uint64_t payload_bytes = 0;  // bytes available behind each payload pointer
  int64_t numel = 0;
  uint32_t block_size = 64;
  const Segment* segments = nullptr;
  int num_segments = 0;
  const Segment* segments_host = nullptr;  // as Q4EncodeParams::segments_host
  uint8_t dtype = math::kDtypeF32;
  int64_t begin = 0;
  float divisor = 1.0f;
  int32_t* status = nullptr;      // CUDA: device word receiving the first PayloadStatus seen
  uint32_t* nonfinite = nullptr;  // optional: set non-zero when a decoded block is non-finite
  uint64_t* body_sums = nullptr;  // CUDA: num_payloads + 1 zeroed device words (v2 counts
                                  // its finished check blocks in the last)
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
  void* workspace = nullptr;   // the backend's topk_workspace_bytes(numel)
  // As Q4EncodeParams::nan_head: when the word is non-zero, element `begin` is read as NaN (every
  // pass that reads the input), so the payload selects it without the host reading the flag.
  // CUDA: v2 kernels only.
  const uint32_t* nan_head = nullptr;
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
  void* workspace = nullptr;      // the backend's topk_workspace_bytes(numel)
  uint64_t* body_sums = nullptr;  // CUDA: num_payloads + 1 zeroed device words (v2 counts
                                  // its finished check blocks in the last)
};

// Checks num_payloads payloads of one codec before any is decoded, payload w holding numel[w]
// elements (the chunks of a two-phase bucket differ in size): header and body checksum.
struct PayloadCheckParams {
  const uint8_t* const* payloads = nullptr;
  int num_payloads = 0;
  uint64_t payload_bytes = 0;      // bytes available behind each payload pointer
  const int64_t* numel = nullptr;  // per payload
  uint8_t codec = format::kCodecQ4;
  uint32_t param = 64;  // q4 / q2 block size, top-k capacity
  uint8_t value_dtype = math::kDtypeF32;
  int32_t* status = nullptr;      // CUDA: the device word that decoders after it read
  uint64_t* body_sums = nullptr;  // CUDA: num_payloads + 1 zeroed device words (v2 counts
                                  // its finished check blocks in the last)
};

// DGC's step before a top-k encode (docs/algorithms.md): the bucket's gradient g, clipped when
// clip_threshold > 0 (g * min(1, clip_threshold / |g|), the norm summed in the fixed order of
// math::topk_clip_sum), then with momentum > 0 accumulated into the velocity
// u = momentum * u + g. `out` (fp32, numel elements) receives u, or the clipped g without
// momentum; it is what the encode then sparsifies. velocity_in may alias out.
struct TopKAccumulateParams {
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;
  float momentum = 0.0f;
  const float* velocity_in = nullptr;  // null: a velocity of zeros (the first step)
  float clip_threshold = 0.0f;         // 0: no clipping
  float* out = nullptr;
  float* scratch = nullptr;  // CUDA, when clipping: (topk_clip_chunks(numel) + 1) floats
};

// Momentum factor masking: clears `target` (fp32, numel elements) at every index of one top-k
// payload this rank encoded, so the velocity forgets what was sent.
struct TopKMaskParams {
  const uint8_t* payload = nullptr;
  uint32_t capacity = 1;
  int64_t numel = 0;
  float* target = nullptr;
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
  static constexpr int kMaxPairs = 3;  // residual, chunk residual, velocity
  ResidualPair pairs[kMaxPairs];
  int num_pairs = 0;
  const uint32_t* nonfinite = nullptr;
  uint32_t* nonfinite_buckets = nullptr;
};

// Sets *nonfinite (as a decoder of such a value would) when the flattened segments hold a NaN or
// an infinity: a bucket put together from other ranks' results (the hierarchical allreduce's
// gathered shards) is then non-finite on every rank that holds it.
struct NonfiniteScanParams {
  const Segment* segments = nullptr;
  int num_segments = 0;
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;  // of all segments together, from the first one's offset
  // Null: the backend's own non-finite flag (take_decode_status() reads it). Otherwise a word of
  // the caller's in the backend's memory, e.g. a Q4EncodeParams::nan_head.
  uint32_t* nonfinite = nullptr;
};

// ---- the rules, one place each ------------------------------------------------------------
// Each returns null when the params keep every rule its fields alone can show, or the rule they
// break. Segment tables, payload contents and workspaces are checked by the caller that can see
// them (the backends' shared checks; the decoders for payload bytes).

inline const char* q4_block_problem(uint32_t block) {
  return math::q4_block_size_valid(block) ? nullptr
                                          : "block size must be a power of two in [16, 256]";
}

// The block codecs: q4 and q2 share their params structs and block-size rule.
inline const char* block_codec_problem(uint8_t codec, uint32_t block) {
  if (codec != format::kCodecQ4 && codec != format::kCodecQ2) return "codec is not q4 or q2";
  const bool valid = codec == format::kCodecQ4 ? math::q4_block_size_valid(block)
                                               : math::q2_block_size_valid(block);
  return valid ? nullptr : "block size must be a power of two in [16, 256]";
}

// What every encode's fields must keep: the input and residual dtypes, the range, a payload.
inline const char* encode_problem(uint8_t dtype, const void* residual_in, const void* residual_out,
                                  uint8_t residual_dtype, int64_t begin, int64_t numel,
                                  const uint8_t* payload) {
  if (!math::dtype_valid(dtype)) return "input dtype code is not float32, float16 or bfloat16";
  if ((residual_in != nullptr || residual_out != nullptr) && !math::dtype_valid(residual_dtype))
    return "residual dtype code is not float32, float16 or bfloat16";
  if (numel < 0) return "element count is negative";
  if (begin < 0) return "range start is negative";
  if (payload == nullptr) return "payload is null";
  return nullptr;
}

// What every decode's fields must keep: payloads with room for a header, the output, the range.
inline const char* decode_problem(const uint8_t* const* payloads, int num_payloads,
                                  uint64_t payload_bytes, uint8_t dtype, int64_t begin,
                                  int64_t numel) {
  if (num_payloads < 1 || payloads == nullptr) return "no payloads";
  if (payload_bytes < kPayloadHeaderBytes) return "payloads are shorter than the 64-byte header";
  if (!math::dtype_valid(dtype)) return "output dtype code is not float32, float16 or bfloat16";
  if (numel < 0) return "element count is negative";
  if (begin < 0) return "range start is negative";
  return nullptr;
}

inline const char* topk_problem(uint8_t value_dtype, int64_t numel) {
  if (!math::dtype_valid(value_dtype))
    return "value dtype code is not float32, float16 or bfloat16";
  if (numel > math::kTopKMaxNumel)
    return "bucket is too large for top-k (limit 2^31 - 1 elements: indices are 32-bit)";
  return nullptr;
}

inline const char* params_problem(const Q4EncodeParams& p) {
  if (const char* e = encode_problem(p.dtype, p.residual_in, p.residual_out, p.residual_dtype,
                                     p.begin, p.numel, p.payload))
    return e;
  if (const char* block = block_codec_problem(p.codec, p.block_size)) return block;
  if (p.begin % p.block_size != 0) return "range start is not a multiple of the block size";
  return nullptr;
}

inline const char* params_problem(const Q4DecodeParams& p) {
  if (const char* d =
          decode_problem(p.payloads, p.num_payloads, p.payload_bytes, p.dtype, p.begin, p.numel))
    return d;
  return block_codec_problem(p.codec, p.block_size);
}

inline const char* params_problem(const TopKEncodeParams& p) {
  if (const char* e = encode_problem(p.dtype, p.residual_in, p.residual_out, p.residual_dtype,
                                     p.begin, p.numel, p.payload))
    return e;
  if (const char* t = topk_problem(p.value_dtype, p.numel)) return t;
  if (p.k < 0 || p.k > p.numel) return "k is outside [0, numel]";
  if (p.capacity > static_cast<uint64_t>(p.numel)) return "capacity exceeds the element count";
  if (p.exact && p.capacity != p.k) return "capacity must equal k in exact mode";
  return nullptr;
}

inline const char* params_problem(const TopKDecodeParams& p) {
  if (const char* d =
          decode_problem(p.payloads, p.num_payloads, p.payload_bytes, p.dtype, p.begin, p.numel))
    return d;
  return topk_problem(p.value_dtype, p.numel);
}

inline const char* params_problem(const TopKAccumulateParams& p) {
  if (!math::dtype_valid(p.dtype)) return "input dtype code is not float32, float16 or bfloat16";
  if (p.numel < 0) return "element count is negative";
  if (p.out == nullptr && p.numel > 0) return "output is null";
  if (!(p.momentum >= 0.0f && p.momentum < 1.0f)) return "momentum is outside [0, 1)";
  if (!(p.clip_threshold >= 0.0f) || !math::is_finite_bits(math::float_bits(p.clip_threshold)))
    return "clip threshold is negative or not finite";
  return nullptr;
}

inline const char* params_problem(const TopKMaskParams& p) {
  if (p.payload == nullptr) return "payload is null";
  if (p.numel < 0 || p.numel > math::kTopKMaxNumel) return "element count is outside [0, 2^31)";
  if (p.capacity > static_cast<uint64_t>(p.numel)) return "capacity exceeds the element count";
  if (p.target == nullptr && p.numel > 0) return "target is null";
  return nullptr;
}

inline const char* params_problem(const NonfiniteScanParams& p) {
  if (!math::dtype_valid(p.dtype)) return "dtype code is not float32, float16 or bfloat16";
  if (p.numel < 0) return "element count is negative";
  if (p.numel > 0 && p.nonfinite == nullptr) return "no status word";
  return nullptr;
}

inline const char* params_problem(const PayloadCheckParams& p) {
  if (p.num_payloads < 1 || p.payloads == nullptr || p.numel == nullptr) return "no payloads";
  if (p.payload_bytes < kPayloadHeaderBytes) return "payloads are shorter than the 64-byte header";
  if (p.codec != format::kCodecQ4 && p.codec != format::kCodecTopK && p.codec != format::kCodecQ2)
    return "unknown codec code";
  if (p.codec != format::kCodecTopK) return block_codec_problem(p.codec, p.param);
  return math::dtype_valid(p.value_dtype) ? nullptr
                                          : "value dtype code is not float32, float16 or bfloat16";
}

inline const char* params_problem(const EndBucketParams& p) {
  if (p.num_pairs < 0 || p.num_pairs > EndBucketParams::kMaxPairs)
    return "more residual pairs than EndBucketParams::kMaxPairs";
  for (int i = 0; i < p.num_pairs; ++i) {
    if (p.pairs[i].bytes > 0 &&
        (p.pairs[i].candidate == nullptr || p.pairs[i].committed == nullptr))
      return "a residual pair has no memory";
  }
  return nullptr;
}

}  // namespace gradcomp
