// DGC's remedies around a top-k encode on the GPU: local clipping (a fixed-order norm), the
// momentum-corrected velocity, and factor masking of the sent coordinates.
#include "launchers.h"
#include "segment_io.cuh"

namespace gradcomp {
namespace kernels {
namespace {

constexpr int kThreads = 256;

// One thread per clip chunk sums its squares in index order, as the CPU reference does.
__global__ void __launch_bounds__(kThreads) clip_chunk_kernel(const TopKAccumulateParams p) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= math::topk_clip_chunks(p.numel)) return;
  const int64_t first = c * math::kTopKClipChunk;
  const int64_t end =
      first + math::kTopKClipChunk < p.numel ? first + math::kTopKClipChunk : p.numel;
  float sum = 0.0f;
  for (int64_t e = first; e < end; e += kGroup) {
    float v[kGroup];
    const int n = group_count(end, e);
    load_group(p.segments, p.num_segments, p.dtype, e, n, v);
    for (int j = 0; j < n; ++j) sum = math::topk_clip_sum(sum, v[j]);
  }
  p.scratch[c + 1] = sum;
}

// The chunk sums in chunk order, then the factor, into scratch[0].
__global__ void clip_scale_kernel(const TopKAccumulateParams p) {
  float total = 0.0f;
  for (int64_t c = 0; c < math::topk_clip_chunks(p.numel); ++c)
    total = math::add_rn(total, p.scratch[c + 1]);
  p.scratch[0] = math::topk_clip_scale(total, p.clip_threshold);
}

__global__ void __launch_bounds__(kThreads) accumulate_kernel(const TopKAccumulateParams p) {
  const float scale = p.clip_threshold > 0.0f ? p.scratch[0] : 1.0f;
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = g * kGroup;
    const int n = group_count(p.numel, first);
    float v[kGroup];
    load_group(p.segments, p.num_segments, p.dtype, first, n, v);
    for (int j = 0; j < n; ++j)
      p.out[first + j] =
          math::topk_accumulate_element(v[j], scale, p.momentum, p.velocity_in, first + j);
  }
}

__global__ void __launch_bounds__(kThreads) mask_kernel(const TopKMaskParams p) {
  const format::PayloadHeader h = format::read_header(p.payload);
  const uint64_t count = h.count < p.capacity ? h.count : p.capacity;
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payload + kPayloadHeaderBytes);
  for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < count;
       e += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    if (idx[e] < static_cast<uint64_t>(p.numel)) p.target[idx[e]] = 0.0f;
  }
}

}  // namespace

LaunchStatus run_topk_accumulate(const TopKAccumulateParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.clip_threshold > 0.0f && p.scratch == nullptr) {
    s.rejected = "clipping needs scratch memory";
    return s;
  }
  if (p.numel == 0) return s;
  cudaError_t err;
  if (p.clip_threshold > 0.0f) {
    const int64_t chunks = math::topk_clip_chunks(p.numel);
    clip_chunk_kernel<<<grid_for(chunks, kThreads, 0), kThreads, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
    clip_scale_kernel<<<1, 1, 0, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  }
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  accumulate_kernel<<<grid_for(groups, kThreads, 1024), kThreads, 0, stream>>>(p);
  return launched(cudaGetLastError());
}

LaunchStatus run_topk_mask(const TopKMaskParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.capacity == 0 || p.numel == 0) return s;
  mask_kernel<<<grid_for(p.capacity, kThreads, 1024), kThreads, 0, stream>>>(p);
  return launched(cudaGetLastError());
}

}  // namespace kernels
}  // namespace gradcomp
