// The v2 block-codec launchers' shared host side: params to kernel args, and dtype, residual and
// rounding dispatched on the host onto a codec's kernel instances (its Kernels policy).
#pragma once

#include "v2/block_v2.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace block {

// A Kernels policy names a codec's Codes and launches its __global__ instances:
//   template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
//   static void encode(const EncodeArgs&, int grid, cudaStream_t);
//   template <uint8_t kOut, bool kPow2, bool kAligned>
//   static void decode(const DecodeArgs&, int grid, cudaStream_t);

template <class K, uint8_t kIn, uint8_t kRes, bool kSR>
cudaError_t launch_encode(const EncodeArgs& a, bool aligned, int grid, cudaStream_t stream) {
  if (aligned)
    K::template encode<kIn, kRes, kSR, true>(a, grid, stream);
  else
    K::template encode<kIn, kRes, kSR, false>(a, grid, stream);
  return cudaGetLastError();
}

template <class K, uint8_t kIn, uint8_t kRes>
cudaError_t launch_encode(const EncodeArgs& a, bool sr, bool aligned, int grid,
                          cudaStream_t stream) {
  return sr ? launch_encode<K, kIn, kRes, true>(a, aligned, grid, stream)
            : launch_encode<K, kIn, kRes, false>(a, aligned, grid, stream);
}

template <class K, uint8_t kIn>
cudaError_t launch_encode(const EncodeArgs& a, uint8_t residual, bool sr, bool aligned, int grid,
                          cudaStream_t stream) {
  switch (residual) {
    case math::kDtypeF32:
      return launch_encode<K, kIn, math::kDtypeF32>(a, sr, aligned, grid, stream);
    case math::kDtypeBF16:
      return launch_encode<K, kIn, math::kDtypeBF16>(a, sr, aligned, grid, stream);
    case math::kDtypeF16:
      return launch_encode<K, kIn, math::kDtypeF16>(a, sr, aligned, grid, stream);
    default:
      return launch_encode<K, kIn, kNoResidual>(a, sr, aligned, grid, stream);
  }
}

template <class K, uint8_t kOut, bool kPow2>
cudaError_t launch_decode(const DecodeArgs& a, bool aligned, int grid, cudaStream_t stream) {
  if (aligned)
    K::template decode<kOut, kPow2, true>(a, grid, stream);
  else
    K::template decode<kOut, kPow2, false>(a, grid, stream);
  return cudaGetLastError();
}

template <class K, uint8_t kOut>
cudaError_t launch_decode(const DecodeArgs& a, bool pow2, bool aligned, int grid,
                          cudaStream_t stream) {
  return pow2 ? launch_decode<K, kOut, true>(a, aligned, grid, stream)
              : launch_decode<K, kOut, false>(a, aligned, grid, stream);
}

// Blocks for `spans` warp spans (at least one: the encoder's last block seals the header).
inline int blocks_for_spans(uint64_t spans, int max_ctas) {
  uint64_t g = (spans + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (g < 1) g = 1;
  const uint64_t cap = max_ctas > 0 ? static_cast<uint64_t>(max_ctas) : (uint64_t{1} << 30);
  return static_cast<int>(g < cap ? g : cap);
}

// Whether every span of a single-segment range is 16-byte aligned: the first element's address
// and every residual buffer.
inline bool single_aligned(const Segment* host_first, int count, int64_t begin, uint32_t bytes) {
  if (count != 1) return false;
  return aligned16(static_cast<const char*>(host_first->data) +
                   (begin - host_first->offset) * bytes);
}

// The codec's params refused by name: params of the other block codec would write its bytes.
template <class K, class Params>
const char* block_params_problem(const Params& p) {
  if (const char* problem = params_problem(p)) return problem;
  if (p.codec != K::Codes::kCodec)
    return K::Codes::kCodec == format::kCodecQ2 ? "params are not for q2" : "params are not for q4";
  if (p.num_segments < 1 || p.segments == nullptr) return "no segments";
  return nullptr;
}

template <class K>
LaunchStatus run_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = block_params_problem<K>(p)) != nullptr) return s;
  EncodeArgs a;
  a.segments = p.segments;
  a.num_segments = p.num_segments;
  a.begin = p.begin;
  a.numel = p.numel;
  a.residual_in = p.residual_in;
  a.residual_out = p.residual_out;
  a.key0 = math::philox_key0(p.rng);
  a.key1 = math::philox_key1(p.rng);
  a.rng_step = p.rng.step;
  a.rng_bucket = p.rng.bucket;
  a.payload = p.payload;
  a.nan_head = p.nan_head;
  a.layout = block_layout(K::Codes::kCodec, static_cast<uint64_t>(p.numel), p.block_size);
  a.header = format::make_block_header(K::Codes::kCodec, static_cast<uint64_t>(p.numel),
                                       p.block_size, p.dtype, p.stochastic);
  // The segment table is in device memory here; its first entry's address and offset decide
  // the aligned path, read by the host from the copy the caller staged (segment_host).
  a.input = nullptr;
  a.residuals_aligned = (p.residual_in == nullptr || aligned16(p.residual_in)) &&
                        (p.residual_out == nullptr || aligned16(p.residual_out));
  bool aligned = false;
  if (p.segments_host != nullptr && a.residuals_aligned &&
      single_aligned(p.segments_host, p.num_segments, p.begin, math::dtype_bytes(p.dtype))) {
    aligned = true;
    a.input = static_cast<const char*>(p.segments_host->data) +
              (p.begin - p.segments_host->offset) * math::dtype_bytes(p.dtype);
  }
  // The words the blocks add into (body checksum, block count) and the header checksum start 0.
  cudaError_t err =
      cudaMemsetAsync(p.payload + offsetof(format::PayloadHeader, body_checksum), 0,
                      kPayloadHeaderBytes - offsetof(format::PayloadHeader, body_checksum), stream);
  if (err != cudaSuccess) return launched(err);
  const int grid = blocks_for_spans(num_spans(static_cast<uint64_t>(p.numel)), max_ctas);
  const uint8_t residual =
      p.residual_out != nullptr || p.residual_in != nullptr ? p.residual_dtype : kNoResidual;
  switch (p.dtype) {
    case math::kDtypeF32:
      err = launch_encode<K, math::kDtypeF32>(a, residual, p.stochastic, aligned, grid, stream);
      break;
    case math::kDtypeBF16:
      err = launch_encode<K, math::kDtypeBF16>(a, residual, p.stochastic, aligned, grid, stream);
      break;
    default:
      err = launch_encode<K, math::kDtypeF16>(a, residual, p.stochastic, aligned, grid, stream);
      break;
  }
  return launched(err);
}

template <class K>
LaunchStatus run_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = block_params_problem<K>(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  cudaError_t err =
      launch_checks(p.payloads, p.num_payloads, nullptr, p.numel, K::Codes::kCodec, p.block_size,
                    K::Codes::kScaleDtype, p.payload_bytes, p.body_sums, p.status, stream);
  if (err != cudaSuccess || p.numel == 0) return launched(err);
  DecodeArgs a;
  a.payloads = p.payloads;
  a.num_payloads = p.num_payloads;
  a.numel = p.numel;
  a.begin = p.begin;
  a.segments = p.segments;
  a.num_segments = p.num_segments;
  a.divisor = p.divisor;
  a.inverse = 0.0f;
  const bool pow2 = math::pow2_reciprocal(p.divisor, &a.inverse);
  a.layout = block_layout(K::Codes::kCodec, static_cast<uint64_t>(p.numel), p.block_size);
  a.status = p.status;
  a.nonfinite = p.nonfinite;
  a.output = nullptr;
  bool aligned = false;
  if (p.segments_host != nullptr &&
      single_aligned(p.segments_host, p.num_segments, p.begin, math::dtype_bytes(p.dtype))) {
    aligned = true;
    a.output = static_cast<char*>(p.segments_host->data) +
               (p.begin - p.segments_host->offset) * math::dtype_bytes(p.dtype);
  }
  const int grid = blocks_for_spans(num_spans(static_cast<uint64_t>(p.numel)), 0);
  switch (p.dtype) {
    case math::kDtypeF32:
      err = launch_decode<K, math::kDtypeF32>(a, pow2, aligned, grid, stream);
      break;
    case math::kDtypeBF16:
      err = launch_decode<K, math::kDtypeBF16>(a, pow2, aligned, grid, stream);
      break;
    default:
      err = launch_decode<K, math::kDtypeF16>(a, pow2, aligned, grid, stream);
      break;
  }
  return launched(err);
}

}  // namespace block
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp

// A codec's __global__ encode and decode kernels over block_v2.cuh's bodies and the Kernels policy
// that launches them (kernels/v2/q4_v2_kernels.cu, q2_v2_kernels.cu). A macro, not a template over
// Codes: each kernel keeps its codec's own name (<prefix>_encode_v2_kernel, ..._decode_...), which
// the SASS budgets (kernels/sass_budgets.txt) and profiles name. Use inside namespace v2.
#define GRADCOMP_V2_BLOCK_KERNELS(prefix, CodesType, KernelsName)                                 \
  template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>                                   \
  __global__ void __launch_bounds__(kThreadsPerBlock, 2)                                          \
      prefix##_encode_v2_kernel(const block::EncodeArgs a) {                                      \
    block::encode_body<CodesType, kIn, kRes, kSR, kAligned>(a);                                   \
  }                                                                                               \
  template <uint8_t kOut, bool kPow2, bool kAligned>                                              \
  __global__ void __launch_bounds__(kThreadsPerBlock, 2)                                          \
      prefix##_decode_v2_kernel(const block::DecodeArgs a) {                                      \
    block::decode_body<CodesType, kOut, kPow2, kAligned>(a);                                      \
  }                                                                                               \
  struct KernelsName {                                                                            \
    using Codes = CodesType;                                                                      \
    template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>                                 \
    static void encode(const block::EncodeArgs& a, int grid, cudaStream_t stream) {               \
      prefix##_encode_v2_kernel<kIn, kRes, kSR, kAligned>                                         \
          <<<grid, kThreadsPerBlock, 0, stream>>>(a);                                             \
    }                                                                                             \
    template <uint8_t kOut, bool kPow2, bool kAligned>                                            \
    static void decode(const block::DecodeArgs& a, int grid, cudaStream_t stream) {               \
      prefix##_decode_v2_kernel<kOut, kPow2, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a); \
    }                                                                                             \
  }
