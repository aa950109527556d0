// Device helpers shared by the kernels: segment lookup, 8-element loads and stores, grid sizes.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace gradcomp {
namespace kernels {

constexpr int kGroup = math::kRandomGroup;  // elements one thread owns in the q4 kernels

// Elements of the group starting at `first` that exist (0 to kGroup).
__host__ __device__ __forceinline__ int group_count(int64_t numel, int64_t first) {
  const int64_t left = numel - first;
  return left <= 0 ? 0 : (left < kGroup ? static_cast<int>(left) : kGroup);
}

// Index of the segment holding flattened element e (segments are sorted by offset).
__device__ __forceinline__ int find_segment(const Segment* segs, int count, int64_t e) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (segs[mid].offset <= e)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Loads up to kGroup elements [e, e + n) of the flattened segments as fp32 (the rest read 0).
__device__ __forceinline__ void load_group(const Segment* segs, int count, uint8_t dtype, int64_t e,
                                           int n, float (&v)[kGroup]) {
  int s = find_segment(segs, count, e);
  const Segment seg = segs[s];
  const int64_t local = e - seg.offset;
  if (n == kGroup && local + kGroup <= seg.numel) {
    const size_t bytes = dtype == math::kDtypeF32 ? 4 : 2;
    const char* base = static_cast<const char*>(seg.data) + local * bytes;
    if ((reinterpret_cast<uintptr_t>(base) & 15) == 0) {
      if (dtype == math::kDtypeF32) {
        const float4 a = reinterpret_cast<const float4*>(base)[0];
        const float4 b = reinterpret_cast<const float4*>(base)[1];
        v[0] = a.x;
        v[1] = a.y;
        v[2] = a.z;
        v[3] = a.w;
        v[4] = b.x;
        v[5] = b.y;
        v[6] = b.z;
        v[7] = b.w;
      } else {
        const uint4 a = reinterpret_cast<const uint4*>(base)[0];
        const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint16_t lo = static_cast<uint16_t>(w[j] & 0xFFFFu),
                         hi = static_cast<uint16_t>(w[j] >> 16);
          v[2 * j] = dtype == math::kDtypeF16 ? math::half_to_float(lo) : math::bf16_to_float(lo);
          v[2 * j + 1] =
              dtype == math::kDtypeF16 ? math::half_to_float(hi) : math::bf16_to_float(hi);
        }
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kGroup; ++j) v[j] = math::load_as_float(seg.data, local + j, dtype);
    return;
  }
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    v[j] = 0.0f;
    if (j < n) {
      const int64_t x = e + j;
      while (s + 1 < count && segs[s + 1].offset <= x) ++s;
      v[j] = math::load_as_float(segs[s].data, x - segs[s].offset, dtype);
    }
  }
}

// Stores n <= kGroup fp32 values to elements [e, e + n) of the flattened segments.
__device__ __forceinline__ void store_group(const Segment* segs, int count, uint8_t dtype,
                                            int64_t e, int n, const float (&v)[kGroup]) {
  int s = find_segment(segs, count, e);
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    if (j < n) {
      const int64_t x = e + j;
      while (s + 1 < count && segs[s + 1].offset <= x) ++s;
      math::store_from_float(segs[s].data, x - segs[s].offset, dtype, v[j]);
    }
  }
}

// Records the first failure; later ones keep it.
__device__ __forceinline__ void set_status(int32_t* status, int code) {
  if (code != 0) atomicCAS(status, 0, code);
}

inline int grid_for(int64_t threads, int block, int max_ctas) {
  int64_t g = (threads + block - 1) / block;
  if (g < 1) g = 1;
  const int64_t cap = max_ctas > 0 ? max_ctas : 65535 * 16;
  return static_cast<int>(g < cap ? g : cap);
}

}  // namespace kernels
}  // namespace gradcomp
