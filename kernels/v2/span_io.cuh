// v2 device I/O: a lane's 8 elements by dtype through explicit global loads and stores, the
// segment table read through the read-only path, and the fallback for segment edges.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "q4_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// Storage dtypes as compile-time tags: the element width and its conversions to and from fp32.
// 16-bit values are converted exactly: bf16 by a shift, fp16 by the hardware conversion (exact
// for every half; a NaN's payload is never observed, as the encoders add it to the residual,
// which canonicalizes it on both backends). Stores use the reference's software rounding so
// NaNs keep the CPU's bits.
template <uint8_t D>
struct Dtype;
template <>
struct Dtype<math::kDtypeF32> {
  static constexpr int kBytes = 4;
};
template <>
struct Dtype<math::kDtypeF16> {
  static constexpr int kBytes = 2;
};
template <>
struct Dtype<math::kDtypeBF16> {
  static constexpr int kBytes = 2;
};

// How a kernel's accesses reach its data. kStreamed: data each kernel reads or writes once (the
// codecs' buckets and residuals): cache-streaming accesses, fp16 widened by the hardware
// conversion. kInPlace: data a kernel may rewrite in place (DiLoCo's outer state and
// parameters, outer_v2_kernels.cu): ordinary accesses, fp16 widened by the reference's software
// conversion (math/half.h), as a parameter's NaN reaches the outer gradient bit for bit.
enum class Access { kStreamed, kInPlace };

template <uint8_t D, Access A = Access::kStreamed>
__device__ __forceinline__ float widen(uint32_t half_bits) {
  if (D == math::kDtypeBF16) return __uint_as_float(half_bits << 16);
  if (A == Access::kInPlace) return math::half_to_float(static_cast<uint16_t>(half_bits));
  return __half2float(__ushort_as_half(static_cast<unsigned short>(half_bits)));
}

template <uint8_t D>
__device__ __forceinline__ uint32_t narrow(float v) {
  return D == math::kDtypeBF16 ? math::float_to_bf16(v) : math::float_to_half(v);
}

// One global load or store with A's cache policy. kInPlace's are the default policy (.ca, .wb)
// spelled as global accesses: the outer kernels take their pointers from a device table, whose
// address space the compiler cannot see (a plain dereference would be a generic access).
template <Access A, typename T>
__device__ __forceinline__ T load_global(const T* p) {
  if constexpr (A == Access::kStreamed) return __ldcs(p);
  return __ldca(p);
}
template <Access A, typename T>
__device__ __forceinline__ void store_global(T* p, T v) {
  if constexpr (A == Access::kStreamed) {
    __stcs(p, v);
  } else {
    __stwb(p, v);
  }
}

// 8 elements at a 16-byte aligned global address: two 16-byte accesses for fp32, one otherwise.
template <uint8_t D, Access A = Access::kStreamed>
__device__ __forceinline__ void load8_aligned(const void* p, float (&v)[kLaneElements]) {
  if (D == math::kDtypeF32) {
    const float4 a = load_global<A>(static_cast<const float4*>(p));
    const float4 b = load_global<A>(static_cast<const float4*>(p) + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 a = load_global<A>(static_cast<const uint4*>(p));
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[2 * j] = widen<D, A>(w[j] & 0xFFFFu);
      v[2 * j + 1] = widen<D, A>(w[j] >> 16);
    }
  }
}

template <uint8_t D, Access A = Access::kStreamed>
__device__ __forceinline__ void store8_aligned(void* p, const float (&v)[kLaneElements]) {
  if (D == math::kDtypeF32) {
    store_global<A>(static_cast<float4*>(p), make_float4(v[0], v[1], v[2], v[3]));
    store_global<A>(static_cast<float4*>(p) + 1, make_float4(v[4], v[5], v[6], v[7]));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = narrow<D>(v[2 * j]) | (narrow<D>(v[2 * j + 1]) << 16);
    store_global<A>(static_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
  }
}

// One element at a global address of any element alignment.
template <uint8_t D, Access A = Access::kStreamed>
__device__ __forceinline__ float load1(const void* base, int64_t i) {
  if (D == math::kDtypeF32) return load_global<A>(static_cast<const float*>(base) + i);
  return widen<D, A>(load_global<A>(static_cast<const unsigned short*>(base) + i));
}
template <uint8_t D, Access A = Access::kStreamed>
__device__ __forceinline__ void store1(void* base, int64_t i, float v) {
  if (D == math::kDtypeF32) {
    store_global<A>(static_cast<float*>(base) + i, v);
  } else {
    store_global<A>(static_cast<unsigned short*>(base) + i,
                    static_cast<unsigned short>(narrow<D>(v)));
  }
}

// A segment-table entry through the read-only path (the table is never written by a kernel).
struct SegmentView {
  const void* data;
  int64_t offset;
  int64_t numel;
};
__device__ __forceinline__ SegmentView segment_at(const Segment* table, int i) {
  const longlong2 a = __ldg(reinterpret_cast<const longlong2*>(table + i));
  const long long n = __ldg(reinterpret_cast<const long long*>(table + i) + 2);
  return SegmentView{reinterpret_cast<const void*>(a.x), a.y, n};
}

// The segment holding flattened element e (the table is sorted by offset).
__device__ __forceinline__ int segment_of(const Segment* table, int count, int64_t e) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(reinterpret_cast<const long long*>(table + mid) + 1) <= e)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Elements [e, e + n) of the flattened segments, element by element (segment edges and the
// last partial span); the rest read 0.
template <uint8_t D>
__device__ __forceinline__ void load_lane_general(const Segment* table, int count, int64_t e, int n,
                                                  float (&v)[kLaneElements]) {
  int s = n > 0 ? segment_of(table, count, e) : 0;
  SegmentView seg = segment_at(table, s);
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    v[j] = 0.0f;
    if (j < n) {
      while (e + j >= seg.offset + seg.numel && s + 1 < count) seg = segment_at(table, ++s);
      v[j] = load1<D>(seg.data, e + j - seg.offset);
    }
  }
}

template <uint8_t D>
__device__ __forceinline__ void store_lane_general(const Segment* table, int count, int64_t e,
                                                   int n, const float (&v)[kLaneElements]) {
  int s = n > 0 ? segment_of(table, count, e) : 0;
  SegmentView seg = segment_at(table, s);
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    if (j < n) {
      while (e + j >= seg.offset + seg.numel && s + 1 < count) seg = segment_at(table, ++s);
      store1<D>(const_cast<void*>(seg.data), e + j - seg.offset, v[j]);
    }
  }
}

// Whether a warp's full span [e, e + 256) lies in one segment, and where it starts there:
// warp-uniform (every lane reads the same entries).
struct SpanPlace {
  const void* data;  // the span's first element
  bool inside;       // all 256 elements in this one segment
};
template <uint8_t D>
__device__ __forceinline__ SpanPlace place_span(const Segment* table, int count, int64_t e) {
  const SegmentView seg = segment_at(table, segment_of(table, count, e));
  const int64_t local = e - seg.offset;
  SpanPlace p;
  p.data = static_cast<const char*>(seg.data) + local * Dtype<D>::kBytes;
  p.inside = local >= 0 && local + kSpanElements <= seg.numel;
  return p;
}

// A whole span of one segment at any element alignment: each load instruction of the warp reads
// consecutive elements (lane l reads l, l + 32, ...), then the lanes trade through shared memory
// (`stage`: this warp's 256 floats) so each holds its own 8 consecutive elements.
template <uint8_t D>
__device__ __forceinline__ void load_span_unaligned(const void* span, float* stage, int lane,
                                                    float (&v)[kLaneElements]) {
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j)
    stage[lane + kWarpLanes * j] = load1<D>(span, lane + kWarpLanes * j);
  __syncwarp();
  const float4 a = reinterpret_cast<const float4*>(stage)[2 * lane];
  const float4 b = reinterpret_cast<const float4*>(stage)[2 * lane + 1];
  __syncwarp();
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <uint8_t D>
__device__ __forceinline__ void store_span_unaligned(void* span, float* stage, int lane,
                                                     const float (&v)[kLaneElements]) {
  reinterpret_cast<float4*>(stage)[2 * lane] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(stage)[2 * lane + 1] = make_float4(v[4], v[5], v[6], v[7]);
  __syncwarp();
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j)
    store1<D>(span, lane + kWarpLanes * j, stage[lane + kWarpLanes * j]);
  __syncwarp();
}

// The 64-bit sum of a warp, on every lane.
__device__ __forceinline__ uint64_t warp_sum(uint64_t x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    x += __shfl_xor_sync(0xFFFFFFFFu, static_cast<unsigned long long>(x), offset);
  return x;
}

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
