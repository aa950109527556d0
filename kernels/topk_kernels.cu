// top-k CUDA kernels: radix select (11/11/9-bit passes), sampled threshold, ordered compaction,
// and validated scatter-add decoding.
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "launchers.h"
#include "payload_kernels.h"
#include "segment_io.cuh"

namespace gradcomp {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = kThreads * kGroup;  // elements per compaction tile
constexpr int kHistBins = math::kTopKMaxBins;
constexpr int kSampleThreads = 1024;
constexpr int kSampleItems = static_cast<int>(math::kTopKSampleMax) / kSampleThreads;

// Selection state kept on the device between kernels, so no step waits on the host.
struct SelectState {
  uint32_t prefix;
  uint32_t threshold;
  uint64_t remaining;
  uint64_t eq_limit;
  uint64_t total;  // packed: selected-above count << 32 | equal count
};

struct Workspace {
  uint32_t* hist;
  SelectState* state;
  uint64_t* tile_counts;
  uint64_t* tile_prefix;
};

__host__ __device__ inline int64_t num_tiles(int64_t numel) {
  return (numel + kTile - 1) / kTile;
}

__host__ __device__ inline Workspace carve(void* base, int64_t numel) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.hist = reinterpret_cast<uint32_t*>(p);
  w.state = reinterpret_cast<SelectState*>(p + kHistBins * 4);
  w.tile_counts = reinterpret_cast<uint64_t*>(p + kHistBins * 4 + 64);
  w.tile_prefix = w.tile_counts + num_tiles(numel);
  return w;
}

// acc = input + residual for the 8 elements of group g; returns how many exist.
__device__ __forceinline__ int load_acc(const TopKEncodeParams& p, int64_t g, float (&acc)[kGroup],
                                        float (&rin)[kGroup]) {
  const int64_t first = g * kGroup;
  const int n = group_count(p.numel, first);
#pragma unroll
  for (int j = 0; j < kGroup; ++j) acc[j] = rin[j] = 0.0f;
  if (n == 0) return 0;
  load_group(p.segments, p.num_segments, p.dtype, p.begin + first, n, acc);
  if (p.residual_in != nullptr) {
    const Segment r{const_cast<void*>(p.residual_in), 0, p.numel};
    load_group(&r, 1, p.residual_dtype, first, n, rin);
  }
#pragma unroll
  for (int j = 0; j < kGroup; ++j) acc[j] = math::add_rn(acc[j], rin[j]);
  return n;
}

__global__ void init_state_kernel(Workspace ws, int64_t k) {
  ws.state->prefix = 0;
  ws.state->remaining = static_cast<uint64_t>(k);
  ws.state->threshold = 0;
  ws.state->eq_limit = 0;
  ws.state->total = 0;
  for (int i = 0; i < kHistBins; ++i) ws.hist[i] = 0;
}

__global__ void __launch_bounds__(kThreads)
    histogram_kernel(const TopKEncodeParams p, Workspace ws, int pass) {
  __shared__ uint32_t hist[kHistBins];
  for (int i = threadIdx.x; i < kHistBins; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const uint32_t prefix = ws.state->prefix;
  const uint32_t mask = math::topk_pass_mask_above(pass);
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc[kGroup], rin[kGroup];
    const int n = load_acc(p, g, acc, rin);
    for (int j = 0; j < n; ++j) {
      const uint32_t key = math::topk_key(acc[j]);
      if ((key & mask) == prefix) atomicAdd(&hist[math::topk_digit(key, pass)], 1u);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < math::topk_pass_bins(pass); i += blockDim.x) {
    if (hist[i] != 0) atomicAdd(&ws.hist[i], hist[i]);
  }
}

// Picks the digit holding the remaining-th largest key, as the CPU reference does.
__global__ void choose_digit_kernel(Workspace ws, int pass) {
  uint64_t above = 0;
  const uint32_t digit =
      math::topk_choose_digit(ws.hist, math::topk_pass_bins(pass), ws.state->remaining, &above);
  ws.state->remaining -= above;
  ws.state->prefix |= digit << math::topk_pass_shift(pass);
  for (int i = 0; i < kHistBins; ++i) ws.hist[i] = 0;
  if (pass == math::kTopKPasses - 1) {
    ws.state->threshold = ws.state->prefix;
    ws.state->eq_limit = ws.state->remaining;
  }
}

// Approximate mode: the m-th largest key of the strided sample, sorted in one block.
__global__ void __launch_bounds__(kSampleThreads)
    sample_threshold_kernel(const TopKEncodeParams p, Workspace ws) {
  using Sort = cub::BlockRadixSort<uint32_t, kSampleThreads, kSampleItems>;
  __shared__ typename Sort::TempStorage temp;
  const int64_t samples = math::topk_sample_size(p.numel);
  uint32_t keys[kSampleItems];
  for (int i = 0; i < kSampleItems; ++i) {
    const int64_t j = static_cast<int64_t>(threadIdx.x) * kSampleItems + i;
    keys[i] = 0;
    if (j < samples) {
      const int64_t e = math::topk_sample_index(j, p.numel, samples);
      float v = 0.0f, r = 0.0f;
      int s = find_segment(p.segments, p.num_segments, p.begin + e);
      v = math::load_as_float(p.segments[s].data, p.begin + e - p.segments[s].offset, p.dtype);
      if (p.residual_in != nullptr) r = math::load_as_float(p.residual_in, e, p.residual_dtype);
      keys[i] = math::topk_key(math::add_rn(v, r));
    }
  }
  Sort(temp).SortDescending(keys);
  const int64_t m = math::topk_sample_rank(p.k, p.numel, samples);
  for (int i = 0; i < kSampleItems; ++i) {
    if (static_cast<int64_t>(threadIdx.x) * kSampleItems + i == m - 1) {
      ws.state->threshold = keys[i];
      ws.state->eq_limit = ~uint64_t{0};
    }
  }
}

__device__ __forceinline__ uint64_t count_pair(uint32_t key, uint32_t threshold) {
  return (key > threshold ? (uint64_t{1} << 32) : 0) + (key == threshold ? 1 : 0);
}

__global__ void __launch_bounds__(kThreads)
    tile_count_kernel(const TopKEncodeParams p, Workspace ws) {
  using Reduce = cub::BlockReduce<uint64_t, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const uint32_t threshold = ws.state->threshold;
  float acc[kGroup], rin[kGroup];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int n = load_acc(p, g, acc, rin);
  uint64_t mine = 0;
  for (int j = 0; j < n; ++j) mine += count_pair(math::topk_key(acc[j]), threshold);
  const uint64_t total = Reduce(temp).Sum(mine);
  if (threadIdx.x == 0) ws.tile_counts[blockIdx.x] = total;
}

__global__ void __launch_bounds__(1024) tile_scan_kernel(Workspace ws, int64_t tiles) {
  using Scan = cub::BlockScan<uint64_t, 1024>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ uint64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base < tiles; base += 1024) {
    const int64_t t = base + threadIdx.x;
    const uint64_t v = t < tiles ? ws.tile_counts[t] : 0;
    uint64_t excl, chunk_total;
    Scan(temp).ExclusiveSum(v, excl, chunk_total);
    if (t < tiles) ws.tile_prefix[t] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) ws.state->total = carry;
}

// Writes the selected entries in index order: position = (greater before) + min(equal before,
// eq_limit), the same rule as the CPU reference.
__global__ void __launch_bounds__(kThreads)
    tile_write_kernel(const TopKEncodeParams p, Workspace ws, uint64_t values_offset) {
  using Scan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const uint32_t threshold = ws.state->threshold;
  const uint64_t eq_limit = ws.state->eq_limit;
  float acc[kGroup], rin[kGroup];
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int n = load_acc(p, g, acc, rin);
  uint32_t keys[kGroup];
  uint64_t mine = 0;
#pragma unroll
  for (int j = 0; j < kGroup; ++j) {
    keys[j] = math::topk_key(acc[j]);
    if (j < n) mine += count_pair(keys[j], threshold);
  }
  uint64_t before;
  Scan(temp).ExclusiveSum(mine, before);
  before += ws.tile_prefix[blockIdx.x];
  uint64_t gt = before >> 32, eq = before & 0xFFFFFFFFu;
  uint32_t* indices = reinterpret_cast<uint32_t*>(p.payload + kPayloadHeaderBytes);
  uint8_t* values = p.payload + values_offset;
  float out[kGroup];
  for (int j = 0; j < n; ++j) {
    const uint32_t key = keys[j];
    const bool selected = key > threshold || (key == threshold && eq < eq_limit);
    const uint64_t pos = gt + (eq < eq_limit ? eq : eq_limit);
    if (key > threshold) ++gt;
    if (key == threshold) ++eq;
    out[j] = acc[j];
    if (selected && pos < p.capacity) {
      const float v = math::topk_value_round(acc[j], p.value_dtype);
      indices[pos] = static_cast<uint32_t>(g * kGroup + j);
      math::store_from_float(values, static_cast<int64_t>(pos), p.value_dtype, v);
      out[j] = math::sub_rn(acc[j], v);
    }
    if (!math::is_finite_bits(key)) out[j] = rin[j];
  }
  if (p.residual_out != nullptr && n > 0) {
    const Segment r{p.residual_out, 0, p.numel};
    store_group(&r, 1, p.residual_dtype, g * kGroup, n, out);
  }
}

__global__ void topk_header_kernel(const TopKEncodeParams p, Workspace ws) {
  uint64_t count = 0;
  if (p.numel > 0) {
    const uint64_t total = ws.state->total;
    const uint64_t eq = total & 0xFFFFFFFFu;
    count = (total >> 32) + (eq < ws.state->eq_limit ? eq : ws.state->eq_limit);
    if (count > p.capacity) count = p.capacity;
  }
  format::write_header(
      p.payload, format::make_topk_header(p.numel, p.capacity, count, p.dtype, p.value_dtype));
}

__global__ void topk_validate_kernel(const TopKDecodeParams p) {
  const int w = blockIdx.y;
  const format::PayloadHeader h = format::read_header(p.payloads[w]);
  const int code = format::check_header(h, format::kCodecTopK, p.numel, p.capacity, p.value_dtype,
                                        p.payload_bytes);
  if (code != 0) {
    set_status(p.status, code);
    return;
  }
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(p.payloads[w] + kPayloadHeaderBytes);
  for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < h.count;
       e += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t i = idx[e];
    if (i >= p.numel || (e > 0 && idx[e - 1] >= i)) set_status(p.status, format::kBadIndex);
  }
}

__global__ void topk_scatter_kernel(const TopKDecodeParams p, int w) {
  if (*p.status != 0) return;
  const uint8_t* payload = p.payloads[w];
  const format::PayloadHeader h = format::read_header(payload);
  const uint32_t* idx = reinterpret_cast<const uint32_t*>(payload + kPayloadHeaderBytes);
  const uint8_t* values = payload + format::section1_offset(h);
  float* sums = static_cast<float*>(p.workspace);
  for (uint64_t e = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < h.count;
       e += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    const uint32_t i = idx[e];
    sums[i] =
        math::add_rn(sums[i], math::load_as_float(values, static_cast<int64_t>(e), p.value_dtype));
  }
}

__global__ void __launch_bounds__(kThreads) topk_finish_kernel(const TopKDecodeParams p) {
  if (*p.status != 0) return;
  const float* sums = static_cast<const float*>(p.workspace);
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  bool bad = false;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t first = g * kGroup;
    const int n = group_count(p.numel, first);
    float v[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      v[j] = j < n ? math::div_rn(sums[first + j], p.divisor) : 0.0f;
      if (!math::is_finite_bits(math::float_bits(v[j]))) bad = true;
    }
    store_group(p.segments, p.num_segments, p.dtype, p.begin + first, n, v);
  }
  if (p.nonfinite != nullptr && bad) atomicOr(p.nonfinite, 1u);
}

// The radix-select state: histogram, selection state, per-tile counts and prefixes.
size_t select_state_bytes(int64_t numel) {
  return kHistBins * 4 + 64 +
         2 * sizeof(uint64_t) * static_cast<size_t>(num_tiles(numel > 0 ? numel : 1));
}

}  // namespace

size_t topk_workspace_bytes(int64_t numel) {
  const size_t sums = static_cast<size_t>(numel > 0 ? numel : 0) * 4;
  const size_t select = select_state_bytes(numel);
  return sums > select ? sums : select;
}

LaunchStatus run_topk_encode(const TopKEncodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.workspace == nullptr) {
    s.rejected = "no workspace";
    return s;
  }
  const format::PayloadHeader h =
      format::make_topk_header(p.numel, p.capacity, 0, p.dtype, p.value_dtype);
  cudaError_t err = cudaMemsetAsync(p.payload, 0, format::payload_bytes_of(h), stream);
  if (err != cudaSuccess) return launched(err);
  const Workspace ws = carve(p.workspace, p.numel);
  init_state_kernel<<<1, 1, 0, stream>>>(ws, p.k);
  if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  if (p.numel > 0) {
    const int64_t groups = (p.numel + kGroup - 1) / kGroup;
    if (p.exact) {
      for (int pass = 0; pass < math::kTopKPasses; ++pass) {
        histogram_kernel<<<grid_for(groups, kThreads, 1024), kThreads, 0, stream>>>(p, ws, pass);
        if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
        choose_digit_kernel<<<1, 1, 0, stream>>>(ws, pass);
        if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
      }
    } else {
      sample_threshold_kernel<<<1, kSampleThreads, 0, stream>>>(p, ws);
      if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
    }
    const int64_t tiles = num_tiles(p.numel);
    tile_count_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(p, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
    tile_scan_kernel<<<1, 1024, 0, stream>>>(ws, tiles);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
    tile_write_kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(
        p, ws, format::section1_offset(h));
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  }
  topk_header_kernel<<<1, 1, 0, stream>>>(p, ws);
  if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  return launched(detail::launch_seal(p.payload, format::payload_bytes_of(h), stream));
}

LaunchStatus run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.workspace == nullptr || p.status == nullptr || p.body_sums == nullptr) {
    s.rejected =
        p.workspace == nullptr ? "no workspace" : "no device status word or body-sum words";
    return s;
  }
  const dim3 grid(static_cast<unsigned>(grid_for(p.capacity, kThreads, 1024)),
                  static_cast<unsigned>(p.num_payloads));
  topk_validate_kernel<<<grid, kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return launched(err);
  err = detail::launch_payload_checks(p.payloads, p.num_payloads, nullptr, p.numel,
                                      format::kCodecTopK, p.capacity, p.value_dtype,
                                      p.payload_bytes, p.body_sums, p.status, stream);
  if (err != cudaSuccess || p.numel == 0) return launched(err);
  if ((err = cudaMemsetAsync(p.workspace, 0, static_cast<size_t>(p.numel) * 4, stream)) !=
      cudaSuccess)
    return launched(err);
  // One launch per payload, in rank order: the fp32 sums then match the CPU's order exactly.
  for (int w = 0; w < p.num_payloads; ++w) {
    topk_scatter_kernel<<<grid_for(p.capacity, kThreads, 1024), kThreads, 0, stream>>>(p, w);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  }
  const int64_t groups = (p.numel + kGroup - 1) / kGroup;
  topk_finish_kernel<<<grid_for(groups, kThreads, 0), kThreads, 0, stream>>>(p);
  return launched(cudaGetLastError());
}

}  // namespace kernels
}  // namespace gradcomp
