// v2's end-of-bucket kernel: the committed residuals kept for a non-finite result or a rejected
// payload, decided on the device so that the host never reads the verdict inside a call.
#include "end_bucket_grid.h"
#include "v2/end_bucket_v2.h"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

// Nothing to do (the common case) costs two loads; otherwise a grid-stride copy, 4-byte words
// where both ends are aligned (residual buffers are), bytes otherwise.
__global__ void __launch_bounds__(kEndBucketThreads)
    end_bucket_v2_kernel(const EndBucketParams p, const int32_t* status) {
  const bool nonfinite = *p.nonfinite != 0;
  if (!nonfinite && *status == 0) return;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if (tid == 0 && nonfinite) atomicAdd(p.nonfinite_buckets, 1u);
#pragma unroll
  for (int i = 0; i < EndBucketParams::kMaxPairs; ++i) {
    // Constant indices (unrolled): a run-time index into the params would copy them to a stack
    // frame read through generic loads.
    if (i >= p.num_pairs) break;
    const ResidualPair pair = p.pairs[i];
    uint8_t* to = static_cast<uint8_t*>(pair.candidate);
    const uint8_t* from = static_cast<const uint8_t*>(pair.committed);
    const bool aligned =
        ((reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) & 3) == 0;
    const int64_t words = aligned ? static_cast<int64_t>(pair.bytes >> 2) : 0;
    for (int64_t w = tid; w < words; w += stride)
      reinterpret_cast<uint32_t*>(to)[w] = reinterpret_cast<const uint32_t*>(from)[w];
    for (int64_t b = words * 4 + tid; b < static_cast<int64_t>(pair.bytes); b += stride)
      to[b] = from[b];
  }
}

}  // namespace

LaunchStatus run_end_bucket(const EndBucketParams& p, const int32_t* status, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.nonfinite == nullptr || p.nonfinite_buckets == nullptr || status == nullptr) {
    s.rejected = "no device status words";
    return s;
  }
  end_bucket_v2_kernel<<<end_bucket_blocks(p), kEndBucketThreads, 0, stream>>>(p, status);
  return launched(cudaGetLastError());
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
