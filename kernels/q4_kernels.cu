// q4 CUDA kernels: fused encode (with error feedback) and decode-sum over W payloads.
#include "launchers.h"
#include "payload_kernels.h"
#include "segment_io.cuh"

namespace gradcomp {
namespace kernels {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ uint64_t q4_codes_offset(uint64_t numel, uint32_t block) {
  return format::section1_offset(format::make_q4_header(numel, block, 0, false));
}

__global__ void q4_header_kernel(uint8_t* payload, uint64_t numel, uint32_t block, uint8_t dtype,
                                 bool stochastic) {
  format::write_header(payload, format::make_q4_header(numel, block, dtype, stochastic));
}

// One thread owns 8 consecutive elements (one Philox call); the block_size / 8 lanes of a quant
// block find its absmax with warp shuffles, so no shared memory or barriers are needed.
__global__ void __launch_bounds__(kThreads) q4_encode_kernel(const Q4EncodeParams p) {
  const int lanes = static_cast<int>(p.block_size) / kGroup;
  const int lane = threadIdx.x & 31;
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float* scales = reinterpret_cast<float*>(p.payload + kPayloadHeaderBytes);
  uint8_t* codes = p.payload + q4_codes_offset(p.numel, p.block_size);
  const Segment residual_in{const_cast<void*>(p.residual_in), 0, p.numel};
  const Segment residual_out{p.residual_out, 0, p.numel};

  for (int64_t warp_base = static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31);
       warp_base < groups; warp_base += stride) {
    const int64_t g = warp_base + lane;
    const int64_t first = g * kGroup;
    const int n = g < groups ? group_count(p.numel, first) : 0;
    float acc[kGroup];
    float rin[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) acc[j] = rin[j] = 0.0f;
    if (n > 0) {
      load_group(p.segments, p.num_segments, p.dtype, p.begin + first, n, acc);
      if (p.residual_in != nullptr) load_group(&residual_in, 1, p.residual_dtype, first, n, rin);
    }
    uint32_t absmax = 0;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      acc[j] = math::add_rn(acc[j], rin[j]);
      if (j < n) absmax = max(absmax, math::abs_bits(acc[j]));
    }
    for (int offset = lanes >> 1; offset > 0; offset >>= 1) {
      absmax = max(absmax, __shfl_xor_sync(0xFFFFFFFFu, absmax, offset));
    }
    if (n == 0) continue;
    const float step = math::q4_step_from_absmax_bits(absmax);
    if (lane % lanes == 0) scales[first / p.block_size] = step;
    math::Philox4 r = {{0, 0, 0, 0}};
    if (p.stochastic && step > 0.0f) {
      r = math::random_group(p.rng, static_cast<uint64_t>(p.begin + first) / kGroup);
    }
    uint32_t packed = 0;
    float dropped[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      const int q = j < n ? math::q4_quantize(acc[j], step, math::random16(r, j), p.stochastic) : 0;
      packed |= static_cast<uint32_t>(q + 8) << (4 * j);
      dropped[j] = math::sub_rn(acc[j], math::q4_dequantize(static_cast<uint32_t>(q + 8), step));
    }
    if (n == kGroup) {
      reinterpret_cast<uint32_t*>(codes)[g] = packed;
    } else {
      for (int b = 0; b < (n + 1) / 2; ++b)
        codes[first / 2 + b] = static_cast<uint8_t>(packed >> (8 * b));
    }
    if (p.residual_out != nullptr) {
      // A non-finite block keeps its old residual, as on the CPU.
      const bool finite = math::is_finite_bits(absmax);
      store_group(&residual_out, 1, p.residual_dtype, first, n, finite ? dropped : rin);
    }
  }
}

__global__ void __launch_bounds__(kThreads) q4_decode_kernel(const Q4DecodeParams p) {
  if (*p.status != 0) return;
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  const uint64_t codes_at = q4_codes_offset(p.numel, p.block_size);
  bool bad = false;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = g * kGroup;
    const int n = group_count(p.numel, first);
    const int64_t block = first / p.block_size;
    float sum[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) sum[j] = 0.0f;
    for (int w = 0; w < p.num_payloads; ++w) {
      const uint8_t* payload = p.payloads[w];
      const float step = reinterpret_cast<const float*>(payload + kPayloadHeaderBytes)[block];
      const uint32_t packed = reinterpret_cast<const uint32_t*>(payload + codes_at)[g];
#pragma unroll
      for (int j = 0; j < kGroup; ++j) {
        sum[j] = math::add_rn(sum[j], math::q4_dequantize((packed >> (4 * j)) & 0xFu, step));
      }
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      sum[j] = math::div_rn(sum[j], p.divisor);
      if (j < n && !math::is_finite_bits(math::float_bits(sum[j]))) bad = true;
    }
    store_group(p.segments, p.num_segments, p.dtype, p.begin + first, n, sum);
  }
  if (p.nonfinite != nullptr && bad) atomicOr(p.nonfinite, 1u);
}

}  // namespace

LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  q4_header_kernel<<<1, 1, 0, stream>>>(p.payload, p.numel, p.block_size, p.dtype, p.stochastic);
  if ((s.error = cudaGetLastError()) != cudaSuccess) return s;
  if (p.numel > 0) {
    const int64_t groups = (p.numel + kGroup - 1) / kGroup;
    q4_encode_kernel<<<grid_for(groups, kThreads, max_ctas), kThreads, 0, stream>>>(p);
    if ((s.error = cudaGetLastError()) != cudaSuccess) return s;
  }
  s.error = detail::launch_seal(
      p.payload, format::expected_payload_bytes(format::kCodecQ4, p.numel, p.block_size, 0),
      stream);
  return s;
}

LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  s.error = detail::launch_payload_checks(p.payloads, p.num_payloads, nullptr, p.numel,
                                          format::kCodecQ4, p.block_size, math::kDtypeF32,
                                          p.payload_bytes, p.body_sums, p.status, stream);
  if (s.error != cudaSuccess || p.numel == 0) return s;
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  q4_decode_kernel<<<grid_for(groups, kThreads, 0), kThreads, 0, stream>>>(p);
  s.error = cudaGetLastError();
  return s;
}

}  // namespace kernels
}  // namespace gradcomp
