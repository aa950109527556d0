// End-of-bucket kernels: flag a gathered bucket's non-finite values, and keep the committed
// residuals when the bucket's result is non-finite.
#include "end_bucket_grid.h"
#include "launchers.h"
#include "segment_io.cuh"

namespace gradcomp {
namespace kernels {
namespace {

__global__ void __launch_bounds__(kEndBucketThreads) end_bucket_kernel(const EndBucketParams p) {
  if (*p.nonfinite == 0) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (tid == 0) atomicAdd(p.nonfinite_buckets, 1u);
  for (int i = 0; i < p.num_pairs; ++i) {
    const ResidualPair pair = p.pairs[i];
    uint8_t* to = static_cast<uint8_t*>(pair.candidate);
    const uint8_t* from = static_cast<const uint8_t*>(pair.committed);
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) & 3) == 0;
    const int64_t words = aligned ? static_cast<int64_t>(pair.bytes / 4) : 0;
    for (int64_t w = tid; w < words; w += stride)
      reinterpret_cast<uint32_t*>(to)[w] = reinterpret_cast<const uint32_t*>(from)[w];
    for (int64_t b = words * 4 + tid; b < static_cast<int64_t>(pair.bytes); b += stride)
      to[b] = from[b];
  }
}

// Grid-stride over the flattened segments; any thread that sees a NaN or an infinity sets the
// flag (every writer stores the same value).
__global__ void __launch_bounds__(kEndBucketThreads)
    nonfinite_scan_kernel(const NonfiniteScanParams p) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool bad = false;
  for (int s = 0; s < p.num_segments && !bad; ++s) {
    const Segment seg = p.segments[s];
    for (int64_t i = tid; i < seg.numel; i += stride) {
      if (!math::element_finite(seg.data, i, p.dtype)) {
        bad = true;
        break;
      }
    }
  }
  if (bad) *p.nonfinite = 1u;
}

}  // namespace

LaunchStatus run_nonfinite_scan(const NonfiniteScanParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.numel == 0) return s;
  nonfinite_scan_kernel<<<end_bucket_blocks_for(static_cast<uint64_t>(p.numel)), kEndBucketThreads,
                          0, stream>>>(p);
  return launched(cudaGetLastError());
}

LaunchStatus run_end_bucket(const EndBucketParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.nonfinite == nullptr || p.nonfinite_buckets == nullptr) {
    s.rejected = "no device status words";
    return s;
  }
  end_bucket_kernel<<<end_bucket_blocks(p), kEndBucketThreads, 0, stream>>>(p);
  return launched(cudaGetLastError());
}

}  // namespace kernels
}  // namespace gradcomp
