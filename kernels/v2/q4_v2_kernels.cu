// q4 v2 kernels: encode with error feedback and the body checksum in one pass, sealed by the last
// block; decode-and-mean of W payloads with 512-byte warp stores. Bytes equal the CPU's.
#include "v2/launchers_v2.h"
#include "v2/payload_v2.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

constexpr uint8_t kNoResidual = 0xFF;

// The hardware's reciprocal approximation (within 1 ulp for normal steps), which
// math::q4_refine_reciprocal turns into the step's reciprocal.
__device__ __forceinline__ float approx_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Everything an encode needs, by value (no table reads for the hot path but the segments').
struct Q4EncodeArgs {
  const Segment* segments;
  int num_segments;
  int64_t begin;
  int64_t numel;
  const void* input;  // single aligned segment: the first element to encode
  const void* residual_in;
  void* residual_out;
  bool residuals_aligned;                     // both residual buffers at 16-byte addresses
  uint32_t key0, key1, rng_step, rng_bucket;  // the Philox key and counter words (philox.h)
  uint8_t* payload;
  Q4Layout layout;
  format::PayloadHeader header;  // body checksum 0; sealed by the last block
};

// The encode of one lane's 8 elements: step from the block's absmax (shuffled among its lanes),
// codes, scale, new residual, and the lane's checksum terms added to *sum. kFull: all 8 exist.
template <uint8_t kRes, bool kSR, bool kFull>
__device__ __forceinline__ void encode_lane(const Q4EncodeArgs& a, uint64_t first, int n,
                                            int lanes_per_block, const float (&x)[kLaneElements],
                                            const float (&rin)[kLaneElements],
                                            float (&out)[kLaneElements], uint64_t* sum) {
  float acc[kLaneElements];
  uint32_t absmax = 0;
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    acc[j] = math::add_rn(x[j], rin[j]);
    if (kFull || j < n) absmax = max(absmax, math::abs_bits(acc[j]));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, absmax, offset);
    if (offset < lanes_per_block) absmax = max(absmax, other);
  }
  const float step = math::q4_step_from_absmax_bits(absmax);
  uint32_t r[4] = {0, 0, 0, 0};
  if (kSR) {
    const math::Philox4 p = math::philox4x32_10(static_cast<uint32_t>((a.begin + first) >> 3),
                                                static_cast<uint32_t>((a.begin + first) >> 35),
                                                a.rng_step, a.rng_bucket, a.key0, a.key1);
    r[0] = p.v[0], r[1] = p.v[1], r[2] = p.v[2], r[3] = p.v[3];
  }
  auto rand16 = [&](int j) { return (j & 1) ? (r[j >> 1] >> 16) : (r[j >> 1] & 0xFFFFu); };
  // The quotients without a division per element where the block and the lane's values allow
  // (q4_math.h: equal to the division there); a lane with a tiny value or step divides.
  uint32_t key = 0xFFFFFFFFu;
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j)
    key = min(key, math::q4_dividend_key(math::abs_bits(acc[j])));
  float q[kLaneElements];
  if (math::q4_fast_step(step) && math::q4_fast_dividends(key)) {
    const float y = math::q4_refine_reciprocal(step, approx_reciprocal(step));
#pragma unroll
    for (int j = 0; j < kLaneElements; ++j)
      q[j] =
          math::q4_quantize_quotient(math::q4_fast_quotient(acc[j], step, y), step, rand16(j), kSR);
  } else {
#pragma unroll
    for (int j = 0; j < kLaneElements; ++j)
      q[j] = math::q4_quantize_float(acc[j], step, rand16(j), kSR);
  }
  uint32_t packed = 0;
  const bool finite = math::is_finite_bits(absmax);
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    packed |= math::q4_nibble_of(q[j]) << (4 * j);
    out[j] = kRes == kNoResidual ? 0.0f
             : finite            ? math::sub_rn(acc[j], math::mul_rn(q[j], step))
                                 : rin[j];
  }
  const uint64_t code_at = code_bytes_at(a.layout, first);
  if (kFull) {
    __stcs(reinterpret_cast<unsigned int*>(a.payload + code_at), packed);
  } else {
    const int bytes = code_byte_count(n);
    for (int b = 0; b < bytes; ++b)
      a.payload[code_at + b] = static_cast<uint8_t>(packed >> (8 * b));
    packed &= bytes == 4 ? 0xFFFFFFFFu : ((1u << (8 * bytes)) - 1u);
  }
  *sum += format::body_checksum_term(packed, body_word_index(code_at));
  if (lane_writes_scale(a.layout, first, n)) {
    const uint64_t s = scale_index(a.layout, first);
    reinterpret_cast<float*>(a.payload + a.layout.scales_at)[s] = step;
    *sum += format::body_checksum_term(__float_as_uint(step), s);
  }
}

template <uint8_t kRes>
__device__ __forceinline__ void load_residual(const Q4EncodeArgs& a, uint64_t first, int n,
                                              bool aligned, float (&rin)[kLaneElements]) {
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) rin[j] = 0.0f;
  if constexpr (kRes != kNoResidual) {
    if (a.residual_in == nullptr) return;
    if (aligned && n == kLaneElements) {
      load8_aligned<kRes>(static_cast<const char*>(a.residual_in) + first * Dtype<kRes>::kBytes,
                          rin);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneElements; ++j)
        if (j < n) rin[j] = load1<kRes>(a.residual_in, static_cast<int64_t>(first) + j);
    }
  }
}

template <uint8_t kRes>
__device__ __forceinline__ void store_residual(const Q4EncodeArgs& a, uint64_t first, int n,
                                               bool aligned, const float (&out)[kLaneElements]) {
  if constexpr (kRes != kNoResidual) {
    if (a.residual_out == nullptr) return;
    if (aligned && n == kLaneElements) {
      store8_aligned<kRes>(static_cast<char*>(a.residual_out) + first * Dtype<kRes>::kBytes, out);
    } else {
#pragma unroll
      for (int j = 0; j < kLaneElements; ++j)
        if (j < n) store1<kRes>(a.residual_out, static_cast<int64_t>(first) + j, out[j]);
    }
  }
}

// Adds the block's checksum terms to the header; the last block to finish writes the header
// (with the sum) and the padding. The header's checksum word and the two words the blocks count
// in (body checksum, reserved2) were zeroed before the launch.
__device__ __forceinline__ void seal(const Q4EncodeArgs& a, uint64_t sum) {
  sum = warp_sum(sum);
  uint8_t* header = a.payload;
  if ((threadIdx.x & 31) == 0 && sum != 0)
    atomicAdd(reinterpret_cast<unsigned long long*>(header +
                                                    offsetof(format::PayloadHeader, body_checksum)),
              static_cast<unsigned long long>(sum));
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  unsigned int* ticket =
      reinterpret_cast<unsigned int*>(header + offsetof(format::PayloadHeader, reserved2));
  if (atomicAdd(ticket, 1u) != gridDim.x - 1) return;
  __threadfence();
  const uint64_t total = atomicAdd(reinterpret_cast<unsigned long long*>(
                                       header + offsetof(format::PayloadHeader, body_checksum)),
                                   0ull);
  for (uint64_t i = scale_padding_at(a.layout); i < a.layout.codes_at; ++i) header[i] = 0;
  for (uint64_t i = a.layout.codes_end; i < a.layout.total; ++i) header[i] = 0;
  const format::PayloadHeader sealed = format::with_body_checksum(a.header, total);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(&sealed);
  for (int i = 0; i < static_cast<int>(sizeof sealed / 4); ++i)
    reinterpret_cast<uint32_t*>(header)[i] = words[i];
}

// kAligned: one segment whose first element (and the residuals) sit at 16-byte addresses, so
// every full span takes two 16-byte loads a lane. Otherwise each span finds its segment: inside
// one at a 16-byte address, the same; inside one elsewhere, consecutive loads traded through
// shared memory; across segments, element by element.
template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2) q4_encode_v2_kernel(const Q4EncodeArgs a) {
  __shared__ float stage[kAligned ? 1 : kWarpsPerBlock * kSpanElements];
  const int lane = threadIdx.x & 31;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x) >> 5;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const int lanes_per_block = 1 << (a.layout.log2_block - 3);
  const uint64_t spans = full_spans(a.numel);
  float* my_stage = stage + (kAligned ? 0 : (threadIdx.x >> 5) * kSpanElements);
  const bool res_aligned = kAligned || a.residuals_aligned;
  uint64_t sum = 0;
  uint64_t span = warp;
  for (; span < spans; span += warps) {
    const uint64_t first = lane_first(span, lane);
    float x[kLaneElements], rin[kLaneElements], out[kLaneElements];
    if (kAligned) {
      load8_aligned<kIn>(static_cast<const char*>(a.input) + first * Dtype<kIn>::kBytes, x);
    } else {
      const int64_t span_at = a.begin + static_cast<int64_t>(span * kSpanElements);
      const SpanPlace place = place_span<kIn>(a.segments, a.num_segments, span_at);
      if (place.inside && aligned16(place.data)) {
        load8_aligned<kIn>(
            static_cast<const char*>(place.data) + lane * kLaneElements * Dtype<kIn>::kBytes, x);
      } else if (place.inside) {
        load_span_unaligned<kIn>(place.data, my_stage, lane, x);
      } else {
        load_lane_general<kIn>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first),
                               kLaneElements, x);
      }
    }
    load_residual<kRes>(a, first, kLaneElements, res_aligned, rin);
    encode_lane<kRes, kSR, true>(a, first, kLaneElements, lanes_per_block, x, rin, out, &sum);
    store_residual<kRes>(a, first, kLaneElements, res_aligned, out);
  }
  // The last, partial span: the warp whose turn it is (its loop stopped at it), element by
  // element.
  if (span == spans && spans * kSpanElements < static_cast<uint64_t>(a.numel)) {
    const uint64_t first = lane_first(spans, lane);
    const int n = lane_count(a.numel, first);
    float x[kLaneElements], rin[kLaneElements], out[kLaneElements];
    load_lane_general<kIn>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first), n, x);
    load_residual<kRes>(a, first, n, false, rin);
    encode_lane<kRes, kSR, false>(a, first, n, lanes_per_block, x, rin, out, &sum);
    store_residual<kRes>(a, first, n, false, out);
  }
  seal(a, sum);
}

// ---- decode ---------------------------------------------------------------------------------

struct Q4DecodeArgs {
  const uint8_t* const* payloads;
  int num_payloads;
  int64_t numel;
  int64_t begin;
  const Segment* segments;
  int num_segments;
  void* output;  // single aligned segment: the first element to write
  float divisor;
  float inverse;  // 1 / divisor when it is exact (math::pow2_reciprocal)
  Q4Layout layout;
  const int32_t* status;
  uint32_t* nonfinite;
};

// Sums lane `first`'s 8 elements over the payloads in order and divides; returns whether any of
// the n that exist is non-finite. kPow2: divide by multiplying with the exact inverse (the same
// result as the division for every value).
template <bool kPow2>
__device__ __forceinline__ bool decode_lane(const Q4DecodeArgs& a, uint64_t first, int n,
                                            float (&v)[kLaneElements]) {
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) v[j] = 0.0f;
  const uint64_t block = scale_index(a.layout, first);
  const uint64_t code_at = code_bytes_at(a.layout, first);
  for (int w = 0; w < a.num_payloads; ++w) {
    const uint8_t* payload = reinterpret_cast<const uint8_t*>(
        __ldg(reinterpret_cast<const unsigned long long*>(a.payloads) + w));
    const float step = __ldg(reinterpret_cast<const float*>(payload + a.layout.scales_at) + block);
    uint32_t packed;
    if (n == kLaneElements) {
      packed = __ldg(reinterpret_cast<const unsigned int*>(payload + code_at));
    } else {
      packed = 0;
      for (int b = 0; b < code_byte_count(n); ++b)
        packed |= static_cast<uint32_t>(__ldg(payload + code_at + b)) << (8 * b);
    }
#pragma unroll
    for (int j = 0; j < kLaneElements; ++j)
      v[j] =
          math::add_rn(v[j], math::mul_rn(math::q4_code_value((packed >> (4 * j)) & 0xFu), step));
  }
  bool bad = false;
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    v[j] = kPow2 ? math::mul_rn(v[j], a.inverse) : math::div_rn(v[j], a.divisor);
    if (j < n) bad |= !math::is_finite_bits(math::float_bits(v[j]));
  }
  return bad;
}

// fp32 output of a full span: staged through shared memory so each warp store writes 512
// contiguous bytes (fp32_store_first); 16-bit outputs are contiguous across lanes already.
template <uint8_t kOut>
__device__ __forceinline__ void store_span_aligned(void* span, float* stage, int lane,
                                                   const float (&v)[kLaneElements]) {
  if (kOut != math::kDtypeF32) {
    store8_aligned<kOut>(static_cast<char*>(span) + lane * kLaneElements * 2, v);
    return;
  }
  reinterpret_cast<float4*>(stage)[2 * lane] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(stage)[2 * lane + 1] = make_float4(v[4], v[5], v[6], v[7]);
  __syncwarp();
#pragma unroll
  for (int round = 0; round < 2; ++round) {
    const int i = lane + kWarpLanes * round;
    __stcs(static_cast<float4*>(span) + i, reinterpret_cast<const float4*>(stage)[i]);
  }
  __syncwarp();
}

template <uint8_t kOut, bool kPow2, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2) q4_decode_v2_kernel(const Q4DecodeArgs a) {
  __shared__ float4 stage4[kWarpsPerBlock * kSpanElements / 4];
  if (__ldg(a.status) != 0) return;  // a payload failed its checks: write nothing
  const int lane = threadIdx.x & 31;
  const uint64_t warp = (static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x) >> 5;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kWarpsPerBlock;
  const uint64_t spans = full_spans(a.numel);
  float* stage = reinterpret_cast<float*>(stage4) + (threadIdx.x >> 5) * kSpanElements;
  bool bad = false;
  uint64_t span = warp;
  for (; span < spans; span += warps) {
    const uint64_t first = lane_first(span, lane);
    float v[kLaneElements];
    bad |= decode_lane<kPow2>(a, first, kLaneElements, v);
    if (kAligned) {
      store_span_aligned<kOut>(
          static_cast<char*>(a.output) + span * kSpanElements * Dtype<kOut>::kBytes, stage, lane,
          v);
    } else {
      const int64_t span_at = a.begin + static_cast<int64_t>(span * kSpanElements);
      const SpanPlace place = place_span<kOut>(a.segments, a.num_segments, span_at);
      if (place.inside && aligned16(place.data)) {
        store_span_aligned<kOut>(const_cast<void*>(place.data), stage, lane, v);
      } else if (place.inside) {
        store_span_unaligned<kOut>(const_cast<void*>(place.data), stage, lane, v);
      } else {
        store_lane_general<kOut>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first),
                                 kLaneElements, v);
      }
    }
  }
  if (span == spans && spans * kSpanElements < static_cast<uint64_t>(a.numel)) {
    const uint64_t first = lane_first(spans, lane);
    const int n = lane_count(a.numel, first);
    float v[kLaneElements];
    if (n > 0) {
      bad |= decode_lane<kPow2>(a, first, n, v);
      store_lane_general<kOut>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first), n,
                               v);
    }
  }
  if (a.nonfinite != nullptr && __any_sync(0xFFFFFFFFu, bad) && lane == 0)
    atomicOr(a.nonfinite, 1u);
}

// ---- dispatch: dtype, residual and rounding chosen on the host -----------------------------

template <uint8_t kIn, uint8_t kRes, bool kSR>
cudaError_t launch_encode(const Q4EncodeArgs& a, bool aligned, int grid, cudaStream_t stream) {
  if (aligned)
    q4_encode_v2_kernel<kIn, kRes, kSR, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  else
    q4_encode_v2_kernel<kIn, kRes, kSR, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

template <uint8_t kIn, uint8_t kRes>
cudaError_t launch_encode(const Q4EncodeArgs& a, bool sr, bool aligned, int grid,
                          cudaStream_t stream) {
  return sr ? launch_encode<kIn, kRes, true>(a, aligned, grid, stream)
            : launch_encode<kIn, kRes, false>(a, aligned, grid, stream);
}

template <uint8_t kIn>
cudaError_t launch_encode(const Q4EncodeArgs& a, uint8_t residual, bool sr, bool aligned, int grid,
                          cudaStream_t stream) {
  switch (residual) {
    case math::kDtypeF32:
      return launch_encode<kIn, math::kDtypeF32>(a, sr, aligned, grid, stream);
    case math::kDtypeBF16:
      return launch_encode<kIn, math::kDtypeBF16>(a, sr, aligned, grid, stream);
    case math::kDtypeF16:
      return launch_encode<kIn, math::kDtypeF16>(a, sr, aligned, grid, stream);
    default:
      return launch_encode<kIn, kNoResidual>(a, sr, aligned, grid, stream);
  }
}

template <uint8_t kOut, bool kPow2>
cudaError_t launch_decode(const Q4DecodeArgs& a, bool aligned, int grid, cudaStream_t stream) {
  if (aligned)
    q4_decode_v2_kernel<kOut, kPow2, true><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  else
    q4_decode_v2_kernel<kOut, kPow2, false><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

template <uint8_t kOut>
cudaError_t launch_decode(const Q4DecodeArgs& a, bool pow2, bool aligned, int grid,
                          cudaStream_t stream) {
  return pow2 ? launch_decode<kOut, true>(a, aligned, grid, stream)
              : launch_decode<kOut, false>(a, aligned, grid, stream);
}

// Blocks for `spans` warp spans (at least one: the encoder's last block seals the header).
int blocks_for_spans(uint64_t spans, int max_ctas) {
  uint64_t g = (spans + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (g < 1) g = 1;
  const uint64_t cap = max_ctas > 0 ? static_cast<uint64_t>(max_ctas) : (uint64_t{1} << 30);
  return static_cast<int>(g < cap ? g : cap);
}

// Whether every span of a single-segment range is 16-byte aligned: the first element's address
// and every residual buffer.
bool single_aligned(const Segment* host_first, int count, int64_t begin, uint32_t bytes) {
  if (count != 1) return false;
  return aligned16(static_cast<const char*>(host_first->data) +
                   (begin - host_first->offset) * bytes);
}

}  // namespace

LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.num_segments < 1 || p.segments == nullptr) {
    s.rejected = "no segments";
    return s;
  }
  Q4EncodeArgs a;
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
  a.layout = q4_layout(static_cast<uint64_t>(p.numel), p.block_size);
  a.header =
      format::make_q4_header(static_cast<uint64_t>(p.numel), p.block_size, p.dtype, p.stochastic);
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
      err = launch_encode<math::kDtypeF32>(a, residual, p.stochastic, aligned, grid, stream);
      break;
    case math::kDtypeBF16:
      err = launch_encode<math::kDtypeBF16>(a, residual, p.stochastic, aligned, grid, stream);
      break;
    default:
      err = launch_encode<math::kDtypeF16>(a, residual, p.stochastic, aligned, grid, stream);
      break;
  }
  return launched(err);
}

LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  if (p.num_segments < 1 || p.segments == nullptr) {
    s.rejected = "no segments";
    return s;
  }
  cudaError_t err =
      launch_checks(p.payloads, p.num_payloads, nullptr, p.numel, format::kCodecQ4, p.block_size,
                    math::kDtypeF32, p.payload_bytes, p.body_sums, p.status, stream);
  if (err != cudaSuccess || p.numel == 0) return launched(err);
  Q4DecodeArgs a;
  a.payloads = p.payloads;
  a.num_payloads = p.num_payloads;
  a.numel = p.numel;
  a.begin = p.begin;
  a.segments = p.segments;
  a.num_segments = p.num_segments;
  a.divisor = p.divisor;
  a.inverse = 0.0f;
  const bool pow2 = math::pow2_reciprocal(p.divisor, &a.inverse);
  a.layout = q4_layout(static_cast<uint64_t>(p.numel), p.block_size);
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
      err = launch_decode<math::kDtypeF32>(a, pow2, aligned, grid, stream);
      break;
    case math::kDtypeBF16:
      err = launch_decode<math::kDtypeBF16>(a, pow2, aligned, grid, stream);
      break;
    default:
      err = launch_decode<math::kDtypeF16>(a, pow2, aligned, grid, stream);
      break;
  }
  return launched(err);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
