// The v2 block-codec kernels' shared bodies (q4, q2): encode with error feedback and the body
// checksum in one pass, sealed by the last block; decode-and-mean of W payloads.
#pragma once

#include "v2/block_v2_codes.cuh"
#include "v2/launchers_v2.h"
#include "v2/payload_v2.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace block {

constexpr uint8_t kNoResidual = 0xFF;

// The hardware's reciprocal approximation (within 1 ulp for normal steps), which
// math::q4_refine_reciprocal turns into the step's reciprocal.
__device__ __forceinline__ float approx_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// q4_v2_map.h's byte map with the codec's widths as constants (the layout's copies are for the
// host tests), so q4's code and scale words stay whole aligned words without a run-time shift.
template <class Codes>
__device__ __forceinline__ uint64_t lane_codes_at(const BlockLayout& l, uint64_t first) {
  return l.codes_at + (first >> Codes::kLog2CodesPerByte);
}
template <class Codes>
__device__ __forceinline__ int lane_code_bytes(int count) {
  return (count + (1 << Codes::kLog2CodesPerByte) - 1) >> Codes::kLog2CodesPerByte;
}
// The checksum term of a value of kBytes bytes written at byte `at`: four bytes fill an aligned
// body word (q4's lane codes and steps), two bytes either half of one (q2's).
template <int kBytes>
__device__ __forceinline__ uint64_t term_at(uint32_t value, uint64_t at) {
  return kBytes == 4 ? format::body_checksum_term(value, body_word_index(at))
                     : body_term_at(value, at);
}

// Everything an encode needs, by value (no table reads for the hot path but the segments').
struct EncodeArgs {
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
  BlockLayout layout;
  format::PayloadHeader header;  // body checksum 0; sealed by the last block
  const uint32_t* nan_head;      // Q4EncodeParams::nan_head (device memory) or null
};

// Q4EncodeParams::nan_head: element 0's lane reads the flag and substitutes NaN (one predicated
// load per warp span that holds element 0; no other lane touches the flag).
__device__ __forceinline__ void apply_nan_head(const EncodeArgs& a, uint64_t first,
                                               float (&x)[kLaneElements]) {
  if (first == 0 && a.nan_head != nullptr && __ldg(a.nan_head) != 0u)
    x[0] = __int_as_float(0x7fc00000);
}

// The encode of one lane's 8 elements: step from the block's absmax (shuffled among its lanes),
// codes, scale, new residual, and the lane's checksum terms added to *sum. kFull: all 8 exist.
template <class Codes, uint8_t kRes, bool kSR, bool kFull>
__device__ __forceinline__ void encode_lane(const EncodeArgs& a, uint64_t first, int n,
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
  const float step = Codes::step_of_absmax(absmax);
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
      q[j] = Codes::code_of_quotient(math::q4_fast_quotient(acc[j], step, y), step, rand16(j), kSR);
  } else {
#pragma unroll
    for (int j = 0; j < kLaneElements; ++j) q[j] = Codes::code_of(acc[j], step, rand16(j), kSR);
  }
  uint32_t packed = 0;
  const bool finite = math::is_finite_bits(absmax);
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    packed |= Codes::bits_of(q[j]) << (Codes::kCodeBits * j);
    out[j] = kRes == kNoResidual ? 0.0f
             : finite            ? math::sub_rn(acc[j], math::mul_rn(Codes::level_of(q[j]), step))
                                 : rin[j];
  }
  const uint64_t code_at = lane_codes_at<Codes>(a.layout, first);
  if (kFull) {
    Codes::store_codes(a.payload + code_at, packed);
  } else {
    packed = Codes::pad(packed, n);
    const int bytes = lane_code_bytes<Codes>(n);
    for (int b = 0; b < bytes; ++b)
      a.payload[code_at + b] = static_cast<uint8_t>(packed >> (8 * b));
    packed &= bytes == 4 ? 0xFFFFFFFFu : ((1u << (8 * bytes)) - 1u);
  }
  *sum += term_at<kLaneElements * Codes::kCodeBits / 8>(packed, code_at);
  if (lane_writes_scale(a.layout, first, n)) {
    const uint64_t scale_at =
        a.layout.scales_at + Codes::kScaleBytes * scale_index(a.layout, first);
    *sum += term_at<Codes::kScaleBytes>(Codes::store_scale(a.payload + scale_at, step), scale_at);
  }
}

template <uint8_t kRes>
__device__ __forceinline__ void load_residual(const EncodeArgs& a, uint64_t first, int n,
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
__device__ __forceinline__ void store_residual(const EncodeArgs& a, uint64_t first, int n,
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
__device__ __forceinline__ void seal(const EncodeArgs& a, uint64_t sum) {
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

// The encode kernel's body. kAligned: one segment whose first element (and the residuals) sit at
// 16-byte addresses, so every full span takes two 16-byte loads a lane. Otherwise each span finds
// its segment: inside one at a 16-byte address, the same; inside one elsewhere, consecutive loads
// traded through shared memory; across segments, element by element.
template <class Codes, uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
__device__ __forceinline__ void encode_body(const EncodeArgs& a) {
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
    apply_nan_head(a, first, x);
    load_residual<kRes>(a, first, kLaneElements, res_aligned, rin);
    encode_lane<Codes, kRes, kSR, true>(a, first, kLaneElements, lanes_per_block, x, rin, out,
                                        &sum);
    store_residual<kRes>(a, first, kLaneElements, res_aligned, out);
  }
  // The last, partial span: the warp whose turn it is (its loop stopped at it), element by
  // element.
  if (span == spans && spans * kSpanElements < static_cast<uint64_t>(a.numel)) {
    const uint64_t first = lane_first(spans, lane);
    const int n = lane_count(a.numel, first);
    float x[kLaneElements], rin[kLaneElements], out[kLaneElements];
    load_lane_general<kIn>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first), n, x);
    apply_nan_head(a, first, x);
    load_residual<kRes>(a, first, n, false, rin);
    encode_lane<Codes, kRes, kSR, false>(a, first, n, lanes_per_block, x, rin, out, &sum);
    store_residual<kRes>(a, first, n, false, out);
  }
  seal(a, sum);
}

// ---- decode ---------------------------------------------------------------------------------

struct DecodeArgs {
  const uint8_t* const* payloads;
  int num_payloads;
  int64_t numel;
  int64_t begin;
  const Segment* segments;
  int num_segments;
  void* output;  // single aligned segment: the first element to write
  float divisor;
  float inverse;  // 1 / divisor when it is exact (math::pow2_reciprocal)
  BlockLayout layout;
  const int32_t* status;
  uint32_t* nonfinite;
};

// Sums lane `first`'s 8 elements over the payloads in order and divides; returns whether any of
// the n that exist is non-finite. kPow2: divide by multiplying with the exact inverse (the same
// result as the division for every value).
template <class Codes, bool kPow2>
__device__ __forceinline__ bool decode_lane(const DecodeArgs& a, uint64_t first, int n,
                                            float (&v)[kLaneElements]) {
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) v[j] = 0.0f;
  const uint64_t block = scale_index(a.layout, first);
  const uint64_t code_at = lane_codes_at<Codes>(a.layout, first);
  for (int w = 0; w < a.num_payloads; ++w) {
    const uint8_t* payload = reinterpret_cast<const uint8_t*>(
        __ldg(reinterpret_cast<const unsigned long long*>(a.payloads) + w));
    const float step = Codes::load_step(payload + a.layout.scales_at, block);
    uint32_t packed;
    if (n == kLaneElements) {
      packed = Codes::load_codes(payload + code_at);
    } else {
      packed = 0;
      for (int b = 0; b < lane_code_bytes<Codes>(n); ++b)
        packed |= static_cast<uint32_t>(__ldg(payload + code_at + b)) << (8 * b);
    }
#pragma unroll
    for (int j = 0; j < kLaneElements; ++j)
      v[j] = math::add_rn(
          v[j], math::mul_rn(Codes::level_of_bits(packed >> (Codes::kCodeBits * j)), step));
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

template <class Codes, uint8_t kOut, bool kPow2, bool kAligned>
__device__ __forceinline__ void decode_body(const DecodeArgs& a) {
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
    bad |= decode_lane<Codes, kPow2>(a, first, kLaneElements, v);
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
      bad |= decode_lane<Codes, kPow2>(a, first, n, v);
      store_lane_general<kOut>(a.segments, a.num_segments, a.begin + static_cast<int64_t>(first), n,
                               v);
    }
  }
  if (a.nonfinite != nullptr && __any_sync(0xFFFFFFFFu, bad) && lane == 0)
    atomicOr(a.nonfinite, 1u);
}

}  // namespace block
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
