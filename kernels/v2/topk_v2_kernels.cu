// top-k v2 kernels (opt-in, KernelGeneration::kV2): v1's contracts (kernels/launchers.h) with
// fewer passes over the bucket.
//
// Encode. The payload depends only on the threshold key T and on how many keys equal to T are
// taken (eq_limit), so any exact selection may find them; only the write is ordered.
//   approximate: init -> sample (one block: strided sample, sort, T) -> compact.   1 read.
//   exact, fused (default when the residual output does not overlap the input; 1 read + write
//   of the bucket): init -> sample (bracket) -> gather (writes every residual as unselected,
//   counts keys above / inside the bracket, buffers (index, acc) of keys >= lo in index order by
//   look-back) -> 3 radix passes over the buffered bracket keys -> buffered compaction (payload,
//   selected residuals fixed); a miss runs the full path below instead (the compaction exits
//   at once otherwise).
//   exact, unfused (overlapping residuals, or GRADCOMP_TOPK_FUSED=0):
//                init -> sample (bracket [lo, hi] around T from the same sample)
//                -> bracket pass (count keys > hi, buffer keys in [lo, hi])
//                -> 3 radix passes over the buffered keys (or, when the bracket missed T, over
//                   the whole bucket), the digit chosen by the last block of each pass
//                -> compact.                                                       2 reads.
//   compact: one pass, ordered by decoupled look-back (one 64-bit word per tile): position =
//   greater-before + min(equal-before, eq_limit) as in v1's tile_write, writing indices, values
//   and every element's residual, and summing the body checksum; the last block to finish writes
//   the sealed header.
// Decode. Indices and header checked on the device (16-byte index loads), the body checksum
// checked, then one kernel per output tile sums every payload's run of entries in shared memory
// in rank order (fp32, the CPU's order) and writes the tile once: no per-payload launches, no
// workspace memset.
//
// Global memory is reached through typed pointers and __ldg / __ldcg / __stcg / __stcs only.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

// cub::DeviceTopK (CCCL >= 3.3, from the pinned nvidia-cuda-cccl headers CMake puts before the
// toolkit's for this file only) is the second exact threshold finder, chosen by
// GRADCOMP_TOPK_EXACT=cub; without it that choice falls back to the bracket and says so.
#if __has_include(<cub/device/device_topk.cuh>)
#include <cub/device/device_topk.cuh>
#include <cuda/iterator>
#if CUB_VERSION >= 300300
#define GRADCOMP_V2_DEVICE_TOPK 1
#endif
#endif

#include "segment_io.cuh"
#include "v2/launchers_v2.h"
#include "v2/payload_v2.h"
#include "v2/topk_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

using ull = unsigned long long;
constexpr int kThreads = kTopKThreads;
constexpr int kItems = kTopKItems;
constexpr int kBins = math::kTopKMaxBins;
constexpr int kSampleThreads = 1024;
constexpr int kSampleItems = static_cast<int>(math::kTopKSampleMax) / kSampleThreads;
constexpr int kMaxSelectBlocks = 1024;
static_assert(kBins == kThreads * kTopKChooseSlots, "one block chooses a digit");
static_assert(kSampleItems * kSampleThreads == math::kTopKSampleMax, "sample fits the block");

// Selection state between kernels (device memory), so no step waits on the host.
struct State {
  unsigned threshold;  // compaction threshold key
  unsigned hi, lo;     // exact: the sample bracket
  unsigned prefix;     // exact: radix prefix so far
  unsigned use_cand;   // exact: radix passes over the buffered keys (1), the buffered pairs in
                       // the bracket (2, fused), or the bucket (0)
  unsigned done;       // exact: threshold already known (k == 0)
  unsigned ticket;     // blocks finished in the current kernel
  unsigned pad;
  ull eq_limit;
  ull remaining;
  ull gt_hi;            // keys above the bracket
  ull ncand;            // keys buffered
  ull checksum;         // body checksum terms
  ull total;            // packed greater/equal totals of the bucket
  unsigned kmin;        // cub path: smallest of the k keys DeviceTopK returned
  unsigned skip_full;   // fused exact: the buffered pass wrote the payload (the full one exits)
  unsigned tile_next;   // dynamic tile assignment of the full compaction
  unsigned tiles_done;  // its finished tiles
  unsigned tile_next2;  // ... and of the buffered compaction
  unsigned tiles_done2;
  ull bracket_counts;  // fused exact: (keys above the bracket) << 32 | (keys inside it)
  ull nbuf;            // fused exact: entries buffered (keys at or above the bracket's bottom)
};

struct Workspace {
  State* state;
  unsigned* hist;  // kBins
  ull* tiles;      // look-back words (topk_tile_word), one per compaction tile
  ull* tiles2;     // ... of the buffered compaction (fused exact)
  unsigned* cand;  // numel keys, or numel / 2 (index, acc bits) pairs (fused exact)
};

constexpr size_t kStateBytes = 256;
constexpr size_t kHistBytes = kBins * 4;

size_t tile_state_bytes(int64_t numel) {
  const int64_t tiles = topk_tiles(numel);
  return (static_cast<size_t>(tiles > 0 ? tiles : 1) * 8 + 255) / 256 * 256;
}

// The candidate area: numel keys (bracket path) or numel / 2 (index, acc) pairs (fused path).
size_t cand_bytes(int64_t numel) {
  return (static_cast<size_t>(numel > 0 ? numel : 1) * 4 + 15) / 16 * 16;
}

// The caller's workspace is aligned up to 256 bytes here (topk_workspace_bytes adds the slack).
Workspace carve(void* base, int64_t numel) {
  char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + 255) & ~uintptr_t{255});
  Workspace w;
  w.state = reinterpret_cast<State*>(p);
  w.hist = reinterpret_cast<unsigned*>(p + kStateBytes);
  w.tiles = reinterpret_cast<ull*>(p + kStateBytes + kHistBytes);
  w.tiles2 = reinterpret_cast<ull*>(p + kStateBytes + kHistBytes + tile_state_bytes(numel));
  w.cand = reinterpret_cast<unsigned*>(p + kStateBytes + kHistBytes + 2 * tile_state_bytes(numel));
  return w;
}

// ---- typed global access -------------------------------------------------------------------

struct Seg {
  const char* data;
  long long offset;
  long long numel;
};

__device__ __forceinline__ long long seg_offset(const Segment* segs, int s) {
  return __ldg(reinterpret_cast<const long long*>(&segs[s].offset));
}
__device__ __forceinline__ Seg seg_load(const Segment* segs, int s) {
  Seg g;
  g.data = reinterpret_cast<const char*>(
      __ldg(reinterpret_cast<const unsigned long long*>(&segs[s].data)));
  g.offset = __ldg(reinterpret_cast<const long long*>(&segs[s].offset));
  g.numel = __ldg(reinterpret_cast<const long long*>(&segs[s].numel));
  return g;
}
// Index of the segment holding flattened element e (segments sorted by offset).
__device__ __forceinline__ int seg_find(const Segment* segs, int count, long long e) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (seg_offset(segs, mid) <= e)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float half_bits_to_float(unsigned short h, uint8_t dtype) {
  return dtype == math::kDtypeF16 ? math::half_to_float(h) : math::bf16_to_float(h);
}
__device__ __forceinline__ unsigned short float_to_half_bits(float v, uint8_t dtype) {
  return dtype == math::kDtypeF16 ? math::float_to_half(v) : math::float_to_bf16(v);
}

// Read-only input (the bucket): the non-coherent path.
__device__ __forceinline__ float ld_in(const char* base, long long i, uint8_t dtype) {
  if (dtype == math::kDtypeF32) return __ldg(reinterpret_cast<const float*>(base) + i);
  return half_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(base) + i), dtype);
}
// Residuals may alias the residual output: the coherent path.
__device__ __forceinline__ float ld_res(const char* base, long long i, uint8_t dtype) {
  if (dtype == math::kDtypeF32) return __ldcg(reinterpret_cast<const float*>(base) + i);
  return half_bits_to_float(__ldcg(reinterpret_cast<const unsigned short*>(base) + i), dtype);
}
__device__ __forceinline__ void st_elem(char* base, long long i, uint8_t dtype, float v) {
  if (dtype == math::kDtypeF32) {
    __stcg(reinterpret_cast<float*>(base) + i, v);
  } else {
    __stcg(reinterpret_cast<unsigned short*>(base) + i, float_to_half_bits(v, dtype));
  }
}

__device__ __forceinline__ void unpack8(const uint4 a, uint8_t dtype, float (&v)[kItems]) {
  const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = half_bits_to_float(static_cast<unsigned short>(w[j] & 0xFFFFu), dtype);
    v[2 * j + 1] = half_bits_to_float(static_cast<unsigned short>(w[j] >> 16), dtype);
  }
}

// Element `i` of the range as the encode reads it: the NaN head when the poison word
// (TopKEncodeParams::nan_head) is set and i is 0, else `v`. Only element 0 loads the word.
__device__ __forceinline__ float with_nan_head(const TopKEncodeParams& p, long long i, float v) {
  if (i != 0 || p.nan_head == nullptr) return v;
  return topk_element_with_nan_head(i, __ldg(p.nan_head), v);
}

// acc = input + residual for the kItems elements at `first` (n of them exist; the others read 0).
// The aligned single-segment case takes 16-byte loads; the branch is warp-uniform in a bucket of
// one aligned segment.
__device__ __forceinline__ void load_acc(const TopKEncodeParams& p, long long first, int n,
                                         float (&acc)[kItems], float (&rin)[kItems]) {
  const long long e = p.begin + first;
  int s = seg_find(p.segments, p.num_segments, e);
  Seg g = seg_load(p.segments, s);
  const long long local = e - g.offset;
  const int in_bytes = p.dtype == math::kDtypeF32 ? 4 : 2;
  const char* in_base = g.data + local * in_bytes;
  if (n == kItems && local + kItems <= g.numel &&
      (reinterpret_cast<uintptr_t>(in_base) & 15) == 0) {
    if (p.dtype == math::kDtypeF32) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(in_base));
      const float4 b = __ldg(reinterpret_cast<const float4*>(in_base) + 1);
      acc[0] = a.x, acc[1] = a.y, acc[2] = a.z, acc[3] = a.w;
      acc[4] = b.x, acc[5] = b.y, acc[6] = b.z, acc[7] = b.w;
    } else {
      unpack8(__ldg(reinterpret_cast<const uint4*>(in_base)), p.dtype, acc);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      acc[j] = 0.0f;
      if (j < n) {
        const long long x = e + j;
        while (s + 1 < p.num_segments && seg_offset(p.segments, s + 1) <= x)
          g = seg_load(p.segments, ++s);
        acc[j] = ld_in(g.data, x - g.offset, p.dtype);
      }
    }
  }
  acc[0] = with_nan_head(p, first, acc[0]);
#pragma unroll
  for (int j = 0; j < kItems; ++j) rin[j] = 0.0f;
  if (p.residual_in != nullptr) {
    const int r_bytes = p.residual_dtype == math::kDtypeF32 ? 4 : 2;
    const char* r_base = static_cast<const char*>(p.residual_in) + first * r_bytes;
    if (n == kItems && (reinterpret_cast<uintptr_t>(r_base) & 15) == 0) {
      if (p.residual_dtype == math::kDtypeF32) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(r_base));
        const float4 b = __ldcg(reinterpret_cast<const float4*>(r_base) + 1);
        rin[0] = a.x, rin[1] = a.y, rin[2] = a.z, rin[3] = a.w;
        rin[4] = b.x, rin[5] = b.y, rin[6] = b.z, rin[7] = b.w;
      } else {
        unpack8(__ldcg(reinterpret_cast<const uint4*>(r_base)), p.residual_dtype, rin);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j)
        if (j < n) rin[j] = ld_res(r_base, j, p.residual_dtype);
    }
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) acc[j] = math::add_rn(acc[j], rin[j]);
}

// Residual store of the kItems elements at `first`: 16-byte stores when aligned and whole.
__device__ __forceinline__ void store_residual(const TopKEncodeParams& p, long long first, int n,
                                               const float (&out)[kItems]) {
  const int r_bytes = p.residual_dtype == math::kDtypeF32 ? 4 : 2;
  char* base = static_cast<char*>(p.residual_out) + first * r_bytes;
  if (n == kItems && (reinterpret_cast<uintptr_t>(base) & 15) == 0) {
    if (p.residual_dtype == math::kDtypeF32) {
      __stcs(reinterpret_cast<float4*>(base), make_float4(out[0], out[1], out[2], out[3]));
      __stcs(reinterpret_cast<float4*>(base) + 1, make_float4(out[4], out[5], out[6], out[7]));
    } else {
      unsigned w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        w[j] = static_cast<unsigned>(float_to_half_bits(out[2 * j], p.residual_dtype)) |
               (static_cast<unsigned>(float_to_half_bits(out[2 * j + 1], p.residual_dtype)) << 16);
      __stcs(reinterpret_cast<uint4*>(base), make_uint4(w[0], w[1], w[2], w[3]));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j)
    if (j < n) st_elem(base, j, p.residual_dtype, out[j]);
}

// Whether this block is the last of the grid to finish; call with every thread after the
// block's global writes.
__device__ __forceinline__ bool last_block_done(unsigned* ticket) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// The sealed header and the zero padding after each section (format::write_header's bytes),
// through global stores. One thread.
__device__ void store_header(uint8_t* payload, const format::PayloadHeader& h) {
  const unsigned* src = reinterpret_cast<const unsigned*>(&h);
  unsigned* dst = reinterpret_cast<unsigned*>(payload);
#pragma unroll
  for (int i = 0; i < 16; ++i) __stcg(dst + i, src[i]);
  const uint64_t s1 = format::section1_offset(h);
  for (uint64_t i = kPayloadHeaderBytes + h.section0_bytes; i < s1; ++i)
    __stcg(reinterpret_cast<unsigned char*>(payload) + i, static_cast<unsigned char>(0));
  const uint64_t total = format::payload_bytes_of(h);
  for (uint64_t i = s1 + h.section1_bytes; i < total; ++i)
    __stcg(reinterpret_cast<unsigned char*>(payload) + i, static_cast<unsigned char>(0));
}

__device__ __forceinline__ ull ld_relaxed(const ull* p) {
  ull v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_relaxed(ull* p, ull v) {
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Decoupled look-back, by one whole warp: posts the tile's aggregate, sums the predecessors'
// words back to the nearest inclusive one (32 tiles per step), posts the inclusive prefix and
// returns the exclusive one (to every lane).
__device__ __forceinline__ ull lookback(ull* tiles, int tile, ull aggregate) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) st_relaxed(tiles + tile, topk_tile_word(aggregate, tile == 0));
  ull excl = 0;
  for (int pred = tile - 1; pred >= 0; pred -= 32) {
    const int idx = pred - lane;
    ull w = idx >= 0 ? ld_relaxed(tiles + idx) : kTopKInclusiveFlag;
    while (__any_sync(0xFFFFFFFFu, (w & kTopKFlags) == 0)) {
      if ((w & kTopKFlags) == 0) w = ld_relaxed(tiles + idx);
    }
    const unsigned inclusive = __ballot_sync(0xFFFFFFFFu, (w & kTopKInclusiveFlag) != 0);
    const int stop = inclusive != 0 ? __ffs(inclusive) - 1 : 32;
    ull v = lane <= stop ? topk_tile_value(w) : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    excl += v;
    if (inclusive != 0) break;
  }
  if (tile > 0 && lane == 0) st_relaxed(tiles + tile, topk_tile_word(excl + aggregate, true));
  return excl;
}

// This thread's exclusive prefix of `mine` over the whole grid: the block's scan plus the tiles
// before this one (look-back by warp 0). tile_excl and tile_end are __shared__; tile_end receives
// the inclusive prefix at this tile's end. Ends with the block synchronized.
template <typename Scan>
__device__ __forceinline__ ull grid_exclusive_sum(typename Scan::TempStorage& temp, ull* tiles,
                                                  int tile, ull mine, ull* tile_excl,
                                                  ull* tile_end) {
  ull before, aggregate;
  Scan(temp).ExclusiveSum(mine, before, aggregate);
  if (threadIdx.x < 32) {
    const ull excl = lookback(tiles, tile, aggregate);
    if (threadIdx.x == 0) {
      *tile_excl = excl;
      *tile_end = excl + aggregate;
    }
  }
  __syncthreads();
  return before + *tile_excl;
}

// ---- encode kernels ------------------------------------------------------------------------

// Resets the selection state and the look-back tile states.
__global__ void __launch_bounds__(kThreads) topk_v2_init_kernel(Workspace ws, int num_tiles) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_tiles) {
    __stcg(ws.tiles + t, 0ull);
    __stcg(ws.tiles2 + t, 0ull);
  }
  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) __stcg(ws.hist + i, 0u);
    if (threadIdx.x == 0) {
      State* s = ws.state;
      __stcg(&s->prefix, 0u);
      __stcg(&s->use_cand, 0u);
      __stcg(&s->done, 0u);
      __stcg(&s->ticket, 0u);
      __stcg(&s->gt_hi, 0ull);
      __stcg(&s->ncand, 0ull);
      __stcg(&s->checksum, 0ull);
      __stcg(&s->total, 0ull);
      __stcg(&s->kmin, 0xFFFFFFFFu);
      __stcg(&s->skip_full, 0u);
      __stcg(&s->tile_next, 0u);
      __stcg(&s->tiles_done, 0u);
      __stcg(&s->tile_next2, 0u);
      __stcg(&s->tiles_done2, 0u);
      __stcg(&s->bracket_counts, 0ull);
      __stcg(&s->nbuf, 0ull);
    }
  }
}

// The strided sample (kernels/math/topk_math.h), sorted in one block. Approximate mode: T = its
// m-th largest key. Exact mode: the bracket around the exact threshold.
__global__ void __launch_bounds__(kSampleThreads)
    topk_v2_sample_kernel(const TopKEncodeParams p, Workspace ws, long long m, long long r_hi,
                          long long r_lo) {
  using Sort = cub::BlockRadixSort<unsigned, kSampleThreads, kSampleItems>;
  __shared__ typename Sort::TempStorage temp;
  const long long n = p.numel;
  const long long samples = math::topk_sample_size(n);
  unsigned keys[kSampleItems];
#pragma unroll
  for (int i = 0; i < kSampleItems; ++i) {
    const long long j = static_cast<long long>(threadIdx.x) * kSampleItems + i;
    keys[i] = 0;
    if (j < samples) {
      const long long e = topk_sample_index_shift(j, n);
      const int s = seg_find(p.segments, p.num_segments, p.begin + e);
      const Seg g = seg_load(p.segments, s);
      const float v = with_nan_head(p, e, ld_in(g.data, p.begin + e - g.offset, p.dtype));
      const float r = p.residual_in != nullptr
                          ? ld_res(static_cast<const char*>(p.residual_in), e, p.residual_dtype)
                          : 0.0f;
      keys[i] = math::topk_key(math::add_rn(v, r));
    }
  }
  Sort(temp).SortDescending(keys);
  State* st = ws.state;
  long long want0 = m, want1 = -1;  // 1-based ranks this kernel reads
  if (p.exact) {
    if (p.k == 0) {
      if (threadIdx.x == 0) {
        __stcg(&st->threshold, 0xFFFFFFFFu);  // selects nothing
        __stcg(&st->eq_limit, 0ull);
        __stcg(&st->done, 1u);
      }
      return;
    }
    want0 = r_hi;
    want1 = r_lo;
    if (threadIdx.x == 0) {
      if (r_hi == 0) __stcg(&st->hi, 0xFFFFFFFFu);
      if (r_lo == 0) __stcg(&st->lo, 0u);
    }
  }
#pragma unroll
  for (int i = 0; i < kSampleItems; ++i) {
    const long long rank = static_cast<long long>(threadIdx.x) * kSampleItems + i + 1;
    if (p.exact) {
      if (rank == want0) __stcg(&st->hi, keys[i]);
      if (rank == want1) __stcg(&st->lo, keys[i]);
    } else if (rank == want0) {
      __stcg(&st->threshold, keys[i]);
      __stcg(&st->eq_limit, ~0ull);
    }
  }
}

// Exact mode, pass 1 over the bucket: counts the keys above the bracket and buffers the keys
// inside it (one atomic per block and tile). The last block decides where the radix passes run.
__global__ void __launch_bounds__(kThreads)
    topk_v2_bracket_kernel(const TopKEncodeParams p, Workspace ws, long long num_tiles) {
  using Scan = cub::BlockScan<unsigned, kThreads>;
  using Reduce = cub::BlockReduce<ull, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ ull base;
  State* st = ws.state;
  if (__ldcg(&st->done) != 0) return;
  const unsigned hi = __ldcg(&st->hi), lo = __ldcg(&st->lo);
  ull above = 0;
  for (long long tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const long long first = topk_thread_first(tile, threadIdx.x);
    const int n = topk_thread_count(p.numel, first);
    float acc[kItems], rin[kItems];
    load_acc(p, first, n, acc, rin);
    unsigned keys[kItems];
    unsigned c = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      keys[j] = math::topk_key(acc[j]);
      const bool ok = j < n;
      above += (ok && keys[j] > hi) ? 1 : 0;
      c += (ok && keys[j] >= lo && keys[j] <= hi) ? 1 : 0;
    }
    unsigned off, total;
    Scan(temp.scan).ExclusiveSum(c, off, total);
    if (threadIdx.x == 0 && total != 0) base = atomicAdd(&st->ncand, static_cast<ull>(total));
    __syncthreads();
    if (total != 0) {
      ull at = base + off;
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        if (j < n && keys[j] >= lo && keys[j] <= hi) __stcg(ws.cand + at++, keys[j]);
      }
    }
    __syncthreads();
  }
  const ull block_above = Reduce(temp.reduce).Sum(above);
  if (threadIdx.x == 0 && block_above != 0) atomicAdd(&st->gt_hi, block_above);
  if (last_block_done(&st->ticket) && threadIdx.x == 0) {
    const ull gt = __ldcg(&st->gt_hi), nc = __ldcg(&st->ncand);
    const ull k = static_cast<ull>(p.k);
    const bool hit = gt < k && gt + nc >= k;
    __stcg(&st->use_cand, hit ? 1u : 0u);
    __stcg(&st->remaining, hit ? k - gt : k);
    __stcg(&st->prefix, 0u);
    __stcg(&st->ticket, 0u);
  }
}

// Counts key into the shared histogram, one atomic per distinct digit of the warp.
__device__ __forceinline__ void hist_add(unsigned* hist, bool ok, unsigned digit) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned tag = ok ? digit : 0xFFFFFFFFu;
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, tag);
  if (ok && (__ffs(peers) - 1) == static_cast<int>(lane)) atomicAdd(hist + digit, __popc(peers));
}

// Exact mode, radix pass `pass` (11, 11, 9 bits) over the buffered keys, or the bucket when the
// bracket missed. The last block chooses the digit with one block-wide scan.
__global__ void __launch_bounds__(kThreads)
    topk_v2_radix_kernel(const TopKEncodeParams p, Workspace ws, long long num_tiles, int pass) {
  using Scan = cub::BlockScan<ull, kThreads>;
  __shared__ unsigned hist[kBins];
  __shared__ typename Scan::TempStorage temp;
  State* st = ws.state;
  if (__ldcg(&st->done) != 0) return;
  const unsigned prefix = __ldcg(&st->prefix);
  const unsigned mask = math::topk_pass_mask_above(pass);
  const int shift = math::topk_pass_shift(pass);
  const unsigned digit_mask = static_cast<unsigned>(math::topk_pass_bins(pass) - 1);
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const unsigned use_cand = __ldcg(&st->use_cand);
  if (use_cand == 2) {
    // Fused path: (index, acc bits) pairs, two per 16-byte load; only the bracket's keys count.
    const unsigned hi = __ldcg(&st->hi), lo = __ldcg(&st->lo);
    const ull nb = __ldcg(&st->nbuf);
    const ull quads = (nb + 1) / 2;
    for (ull q = static_cast<ull>(blockIdx.x) * blockDim.x + threadIdx.x; q - threadIdx.x < quads;
         q += static_cast<ull>(gridDim.x) * blockDim.x) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (q < quads) v = __ldcg(reinterpret_cast<const uint4*>(ws.cand) + q);
      const unsigned k2[2] = {v.y & 0x7FFFFFFFu, v.w & 0x7FFFFFFFu};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = q * 2 + j < nb && k2[j] >= lo && k2[j] <= hi && (k2[j] & mask) == prefix;
        hist_add(hist, ok, (k2[j] >> shift) & digit_mask);
      }
    }
  } else if (use_cand == 1) {
    const ull nc = __ldcg(&st->ncand);
    const ull quads = (nc + 3) / 4;  // the buffer is 16-byte aligned
    for (ull q = static_cast<ull>(blockIdx.x) * blockDim.x + threadIdx.x; q - threadIdx.x < quads;
         q += static_cast<ull>(gridDim.x) * blockDim.x) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (q < quads) v = __ldcg(reinterpret_cast<const uint4*>(ws.cand) + q);
      const unsigned k4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool ok = q * 4 + j < nc && (k4[j] & mask) == prefix;
        hist_add(hist, ok, (k4[j] >> shift) & digit_mask);
      }
    }
  } else {
    for (long long tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const long long first = topk_thread_first(tile, threadIdx.x);
      const int n = topk_thread_count(p.numel, first);
      float acc[kItems], rin[kItems];
      load_acc(p, first, n, acc, rin);
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const unsigned key = math::topk_key(acc[j]);
        hist_add(hist, j < n && (key & mask) == prefix, (key >> shift) & digit_mask);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kBins; i += blockDim.x)
    if (hist[i] != 0) atomicAdd(ws.hist + i, hist[i]);
  if (!last_block_done(&st->ticket)) return;
  // Slot s holds digit bins - 1 - s; thread t holds slots [8t, 8t + 8).
  const int bins = math::topk_pass_bins(pass);
  uint32_t c[kTopKChooseSlots];
  ull mine = 0;
#pragma unroll
  for (int i = 0; i < kTopKChooseSlots; ++i) {
    const int slot = threadIdx.x * kTopKChooseSlots + i;
    c[i] = slot < bins ? __ldcg(ws.hist + (bins - 1 - slot)) : 0u;
    mine += c[i];
  }
  ull excl;
  Scan(temp).ExclusiveSum(mine, excl);
  const ull remaining = __ldcg(&st->remaining);
  uint32_t digit = 0;
  uint64_t above = 0;
  if (topk_choose_in_slots(c, threadIdx.x, bins, excl, remaining, &digit, &above)) {
    const unsigned new_prefix = prefix | (digit << shift);
    const ull left = remaining - above;
    __stcg(&st->prefix, new_prefix);
    __stcg(&st->remaining, left);
    if (pass == math::kTopKPasses - 1) {
      __stcg(&st->threshold, new_prefix);
      __stcg(&st->eq_limit, left);
    }
  }
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) __stcg(ws.hist + i, 0u);
  if (threadIdx.x == 0) __stcg(&st->ticket, 0u);
}

// Writes one selected entry at payload position pos; returns its body-checksum terms and the
// stored value in *v.
__device__ __forceinline__ ull put_entry(const TopKEncodeParams& p, unsigned index, ull pos,
                                         float acc, unsigned long long values_offset, float* v) {
  unsigned* indices = reinterpret_cast<unsigned*>(p.payload + kPayloadHeaderBytes);
  char* values = reinterpret_cast<char*>(p.payload + values_offset);
  *v = math::topk_value_round(acc, p.value_dtype);
  unsigned bits;
  __stcg(indices + pos, index);
  if (p.value_dtype == math::kDtypeF32) {
    bits = math::float_bits(*v);
    __stcg(reinterpret_cast<float*>(values) + pos, *v);
  } else {
    bits = float_to_half_bits(*v, p.value_dtype);
    __stcg(reinterpret_cast<unsigned short*>(values) + pos, static_cast<unsigned short>(bits));
  }
  return topk_entry_checksum(index, pos, bits, p.value_dtype,
                             (values_offset - kPayloadHeaderBytes) / 4);
}

// The sealed header, by the block that finished the last tile.
__device__ __forceinline__ void seal(const TopKEncodeParams& p, const State* st, ull eq_limit) {
  const ull count = topk_entry_count(__ldcg(&st->total), eq_limit, p.capacity);
  const format::PayloadHeader h =
      format::make_topk_header(p.numel, p.capacity, count, p.dtype, p.value_dtype);
  store_header(p.payload, format::with_body_checksum(h, __ldcg(&st->checksum)));
}

// Takes the next tile (thread 0's atomic, broadcast); every thread calls it.
__device__ __forceinline__ int next_tile(unsigned* counter, int* slot) {
  __syncthreads();  // the previous tile's shared memory is free
  if (threadIdx.x == 0) *slot = static_cast<int>(atomicAdd(counter, 1u));
  __syncthreads();
  return *slot;
}

// After a tile's global writes and its checksum atomic: whether it was the last tile to finish.
__device__ __forceinline__ bool last_tile_done(unsigned* done, int num_tiles, bool* flag) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *flag = atomicAdd(done, 1u) == static_cast<unsigned>(num_tiles - 1);
  __syncthreads();
  if (*flag) __threadfence();
  return *flag;
}

// The ordered compaction over the bucket: tiles taken in order by a persistent grid, positions by
// decoupled look-back, every residual written. Exits at once when the fused exact pass already
// wrote the payload.
__global__ void __launch_bounds__(kThreads, 4)
    topk_v2_compact_kernel(const TopKEncodeParams p, Workspace ws, int num_tiles,
                           unsigned long long values_offset) {
  using Scan = cub::BlockScan<ull, kThreads>;
  using Reduce = cub::BlockReduce<ull, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ ull tile_excl, tile_total;
  __shared__ int slot;
  __shared__ bool last;
  State* st = ws.state;
  if (__ldcg(&st->skip_full) != 0) return;
  const unsigned threshold = __ldcg(&st->threshold);
  const ull eq_limit = __ldcg(&st->eq_limit);
  for (int tile = next_tile(&st->tile_next, &slot); tile < num_tiles;
       tile = next_tile(&st->tile_next, &slot)) {
    const long long first = topk_thread_first(tile, threadIdx.x);
    const int n = topk_thread_count(p.numel, first);
    float acc[kItems], rin[kItems];
    load_acc(p, first, n, acc, rin);
    unsigned keys[kItems];
    ull mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      keys[j] = math::topk_key(acc[j]);
      if (j < n) mine += topk_count_pair(keys[j], threshold);
    }
    const ull before =
        grid_exclusive_sum<Scan>(temp.scan, ws.tiles, tile, mine, &tile_excl, &tile_total);
    ull gt = before >> 32, eq = before & 0xFFFFFFFFull;
    ull sum = 0;
    float out[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const unsigned key = keys[j];
      const bool ok = j < n;
      const bool selected = ok && (key > threshold || (key == threshold && eq < eq_limit));
      const ull pos = topk_position(gt, eq, eq_limit);
      if (ok && key > threshold) ++gt;
      if (ok && key == threshold) ++eq;
      out[j] = acc[j];
      if (selected && pos < p.capacity) {
        float v;
        sum += put_entry(p, static_cast<unsigned>(first + j), pos, acc[j], values_offset, &v);
        out[j] = math::sub_rn(acc[j], v);
      }
      if (!math::is_finite_bits(key)) out[j] = rin[j];
    }
    if (p.residual_out != nullptr && n > 0) store_residual(p, first, n, out);
    const ull block_sum = Reduce(temp.reduce).Sum(sum);
    if (threadIdx.x == 0) {
      if (block_sum != 0) atomicAdd(&st->checksum, block_sum);
      if (tile == num_tiles - 1) __stcg(&st->total, tile_total);
    }
    if (last_tile_done(&st->tiles_done, num_tiles, &last) && threadIdx.x == 0)
      seal(p, st, eq_limit);
  }
}

// Fused exact, pass 1 over the bucket (when the residual output does not overlap the input):
// writes every residual as if unselected (acc, or the old residual for a non-finite element),
// counts the keys above and inside the sample bracket, and buffers (index, acc) of every key at or
// above the bracket's bottom in index order (decoupled look-back). The last block decides: the
// bracket holds the threshold and the buffer fits -> radix over the buffer, then the buffered
// compaction writes the payload and fixes the selected residuals; else the full path runs.
__global__ void __launch_bounds__(kThreads, 4)
    topk_v2_gather_kernel(const TopKEncodeParams p, Workspace ws, int num_tiles, ull cap) {
  using Scan = cub::BlockScan<ull, kThreads>;
  using Reduce = cub::BlockReduce<ull, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ ull tile_excl, tile_end;
  State* st = ws.state;
  if (__ldcg(&st->done) != 0) return;
  const unsigned hi = __ldcg(&st->hi), lo = __ldcg(&st->lo);
  const int tile = blockIdx.x;
  const long long first = topk_thread_first(tile, threadIdx.x);
  const int n = topk_thread_count(p.numel, first);
  float acc[kItems], rin[kItems];
  load_acc(p, first, n, acc, rin);
  unsigned keys[kItems];
  ull mine = 0, counts = 0;
  float out[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    keys[j] = math::topk_key(acc[j]);
    const bool ok = j < n;
    mine += (ok && keys[j] >= lo) ? 1 : 0;
    counts += (ok && keys[j] > hi) ? (ull{1} << 32) : 0;
    counts += (ok && keys[j] >= lo && keys[j] <= hi) ? 1 : 0;
    out[j] = math::is_finite_bits(keys[j]) ? acc[j] : rin[j];
  }
  if (p.residual_out != nullptr && n > 0) store_residual(p, first, n, out);
  ull before = grid_exclusive_sum<Scan>(temp.scan, ws.tiles, tile, mine, &tile_excl, &tile_end);
  if (threadIdx.x == 0 && tile == num_tiles - 1) __stcg(&st->nbuf, tile_end);
  uint2* buf = reinterpret_cast<uint2*>(ws.cand);
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    if (j < n && keys[j] >= lo) {
      if (before < cap)
        __stcg(buf + before,
               make_uint2(static_cast<unsigned>(first + j), math::float_bits(acc[j])));
      ++before;
    }
  }
  const ull block_counts = Reduce(temp.reduce).Sum(counts);
  if (threadIdx.x == 0 && block_counts != 0) atomicAdd(&st->bracket_counts, block_counts);
  if (last_block_done(&st->ticket) && threadIdx.x == 0) {
    const ull bc = __ldcg(&st->bracket_counts);
    const ull gt = bc >> 32, inside = bc & 0xFFFFFFFFull, k = static_cast<ull>(p.k);
    const bool hit = gt < k && gt + inside >= k && __ldcg(&st->nbuf) <= cap;
    __stcg(&st->use_cand, hit ? 2u : 0u);
    __stcg(&st->remaining, hit ? k - gt : k);
    __stcg(&st->prefix, 0u);
    __stcg(&st->skip_full, hit ? 1u : 0u);
    __stcg(&st->ticket, 0u);
  }
}

// Fused exact, pass 2 over the buffer only (when the bracket held the threshold): the ordered
// compaction of the buffered entries (already in index order), fixing the selected elements'
// residuals. Persistent grid; exits at once when the full path runs instead.
__global__ void __launch_bounds__(kThreads, 4)
    topk_v2_buffer_compact_kernel(const TopKEncodeParams p, Workspace ws,
                                  unsigned long long values_offset) {
  using Scan = cub::BlockScan<ull, kThreads>;
  using Reduce = cub::BlockReduce<ull, kThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ ull tile_excl, tile_total;
  __shared__ int slot;
  __shared__ bool last;
  State* st = ws.state;
  if (__ldcg(&st->skip_full) == 0) return;
  const unsigned threshold = __ldcg(&st->threshold);
  const ull eq_limit = __ldcg(&st->eq_limit);
  const ull nbuf = __ldcg(&st->nbuf);
  const int num_tiles = static_cast<int>((nbuf + kTopKTile - 1) / kTopKTile);
  const uint2* buf = reinterpret_cast<const uint2*>(ws.cand);
  for (int tile = next_tile(&st->tile_next2, &slot); tile < num_tiles;
       tile = next_tile(&st->tile_next2, &slot)) {
    const long long first = topk_thread_first(tile, threadIdx.x);
    const int n = topk_thread_count(static_cast<long long>(nbuf), first);
    unsigned index[kItems], bits[kItems];
    if (n == kItems) {
#pragma unroll
      for (int q = 0; q < kItems / 2; ++q) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(buf + first) + q);
        index[2 * q] = v.x, bits[2 * q] = v.y, index[2 * q + 1] = v.z, bits[2 * q + 1] = v.w;
      }
    } else {
#pragma unroll
      for (int j = 0; j < kItems; ++j) {
        const uint2 v = j < n ? __ldcg(buf + first + j) : make_uint2(0u, 0u);
        index[j] = v.x, bits[j] = v.y;
      }
    }
    ull mine = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (j < n) mine += topk_count_pair(bits[j] & 0x7FFFFFFFu, threshold);
    const ull before =
        grid_exclusive_sum<Scan>(temp.scan, ws.tiles2, tile, mine, &tile_excl, &tile_total);
    ull gt = before >> 32, eq = before & 0xFFFFFFFFull;
    ull sum = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const unsigned key = bits[j] & 0x7FFFFFFFu;
      const bool ok = j < n;
      const bool selected = ok && (key > threshold || (key == threshold && eq < eq_limit));
      const ull pos = topk_position(gt, eq, eq_limit);
      if (ok && key > threshold) ++gt;
      if (ok && key == threshold) ++eq;
      if (selected && pos < p.capacity) {
        const float acc = math::bits_float(bits[j]);
        float v;
        sum += put_entry(p, index[j], pos, acc, values_offset, &v);
        if (p.residual_out != nullptr && math::is_finite_bits(key))
          st_elem(static_cast<char*>(p.residual_out), index[j], p.residual_dtype,
                  math::sub_rn(acc, v));
      }
    }
    const ull block_sum = Reduce(temp.reduce).Sum(sum);
    if (threadIdx.x == 0) {
      if (block_sum != 0) atomicAdd(&st->checksum, block_sum);
      if (tile == num_tiles - 1) __stcg(&st->total, tile_total);
    }
    if (last_tile_done(&st->tiles_done2, num_tiles, &last) && threadIdx.x == 0)
      seal(p, st, eq_limit);
  }
}

#if defined(GRADCOMP_V2_DEVICE_TOPK)
// The key of flattened element i (input + residual), for cub::DeviceTopK's input iterator.
struct KeyOf {
  TopKEncodeParams p;
  __device__ unsigned operator()(long long i) const {
    const int s = seg_find(p.segments, p.num_segments, p.begin + i);
    const Seg g = seg_load(p.segments, s);
    const float v = with_nan_head(p, i, ld_in(g.data, p.begin + i - g.offset, p.dtype));
    const float r = p.residual_in != nullptr
                        ? ld_res(static_cast<const char*>(p.residual_in), i, p.residual_dtype)
                        : 0.0f;
    return math::topk_key(math::add_rn(v, r));
  }
};

// cub path, after DeviceTopK wrote the k largest keys (in no order): T is their minimum.
__global__ void __launch_bounds__(kThreads) topk_v2_keys_min_kernel(Workspace ws, long long k) {
  using Reduce = cub::BlockReduce<unsigned, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  unsigned m = 0xFFFFFFFFu;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < k;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    m = min(m, __ldcg(ws.cand + i));
  const unsigned block_min = Reduce(temp).Reduce(m, ::cuda::minimum<>{});
  if (threadIdx.x == 0) atomicMin(&ws.state->kmin, block_min);
}

// ... and the ties taken are k minus the keys above T (every key above T is among the k).
__global__ void __launch_bounds__(kThreads) topk_v2_keys_above_kernel(Workspace ws, long long k) {
  using Reduce = cub::BlockReduce<ull, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  State* st = ws.state;
  const unsigned t = __ldcg(&st->kmin);
  ull above = 0;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < k;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    above += __ldcg(ws.cand + i) > t ? 1 : 0;
  const ull block_above = Reduce(temp).Sum(above);
  if (threadIdx.x == 0 && block_above != 0) atomicAdd(&st->gt_hi, block_above);
  if (last_block_done(&st->ticket) && threadIdx.x == 0) {
    __stcg(&st->threshold, t);
    __stcg(&st->eq_limit, static_cast<ull>(k) - __ldcg(&st->gt_hi));
    __stcg(&st->ticket, 0u);
  }
}
#endif

// An empty bucket's header (nothing to select, an all-zero body).
__global__ void topk_v2_empty_header_kernel(const TopKEncodeParams p) {
  store_header(p.payload, format::make_topk_header(0, p.capacity, 0, p.dtype, p.value_dtype));
}

// ---- decode kernels ------------------------------------------------------------------------

__device__ __forceinline__ const uint8_t* payload_at(const uint8_t* const* payloads, int w) {
  return reinterpret_cast<const uint8_t*>(
      __ldg(reinterpret_cast<const unsigned long long*>(payloads) + w));
}

__device__ __forceinline__ format::PayloadHeader load_header(const uint8_t* payload) {
  format::PayloadHeader h;
  unsigned* dst = reinterpret_cast<unsigned*>(&h);
#pragma unroll
  for (int i = 0; i < 16; ++i) dst[i] = __ldg(reinterpret_cast<const unsigned*>(payload) + i);
  return h;
}

// Header and index checks: blockIdx.y is the payload; each thread checks 4 entries with a 16-byte
// load (the index section starts 64 bytes into the payload; scalar loads for a payload that is
// not 16-byte aligned).
__global__ void __launch_bounds__(kThreads) topk_v2_validate_kernel(const TopKDecodeParams p) {
  __shared__ int header_code;
  __shared__ ull count;
  const uint8_t* payload = payload_at(p.payloads, blockIdx.y);
  if (threadIdx.x == 0) {
    const format::PayloadHeader h = load_header(payload);
    const int code = format::check_header(h, format::kCodecTopK, p.numel, p.capacity, p.value_dtype,
                                          p.payload_bytes);
    header_code = code;
    count = h.count;
    if (code != 0 && blockIdx.x == 0) set_status(p.status, code);
  }
  __syncthreads();
  if (header_code != 0) return;
  const unsigned* idx = reinterpret_cast<const unsigned*>(payload + kPayloadHeaderBytes);
  const ull n = count;
  const ull quads = (n + 3) / 4;
  const bool aligned = (reinterpret_cast<uintptr_t>(idx) & 15) == 0;
  bool bad = false;
  for (ull q = static_cast<ull>(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += static_cast<ull>(gridDim.x) * blockDim.x) {
    uint4 v;
    if (aligned && 4 * q + 4 <= n) {
      v = __ldg(reinterpret_cast<const uint4*>(idx) + q);
    } else {
      v.x = __ldg(idx + 4 * q);
      v.y = 4 * q + 1 < n ? __ldg(idx + 4 * q + 1) : 0u;
      v.z = 4 * q + 2 < n ? __ldg(idx + 4 * q + 2) : 0u;
      v.w = 4 * q + 3 < n ? __ldg(idx + 4 * q + 3) : 0u;
    }
    const unsigned i4[4] = {v.x, v.y, v.z, v.w};
    unsigned prev = q > 0 ? __ldg(idx + 4 * q - 1) : 0u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const ull e = 4 * q + j;
      if (e < n) {
        if (i4[j] >= static_cast<ull>(p.numel) || (e > 0 && prev >= i4[j])) bad = true;
      }
      prev = i4[j];
    }
  }
  if (bad) set_status(p.status, format::kBadIndex);
}

// One output tile: zeroes a shared fp32 window, adds every payload's run of entries in rank order,
// divides, and writes the tile once. Nothing is written when a check failed.
template <bool kPow2>
__global__ void __launch_bounds__(kTopKDecodeThreads)
    topk_v2_decode_kernel(const TopKDecodeParams p, float inv) {
  __shared__ __align__(16) float window[kTopKDecodeTile];
  __shared__ unsigned long long run_begin[kTopKDecodeThreads], run_end[kTopKDecodeThreads];
  __shared__ const uint8_t* run_values[kTopKDecodeThreads];
  __shared__ const unsigned* run_index[kTopKDecodeThreads];
  if (__ldcg(p.status) != 0) return;
  const long long lo = static_cast<long long>(blockIdx.x) * kTopKDecodeTile;
  const long long left = p.numel - lo;
  const int len =
      left < kTopKDecodeTile ? static_cast<int>(left) : static_cast<int>(kTopKDecodeTile);
#pragma unroll
  for (int i = 0; i < kTopKDecodeItems; ++i) window[topk_decode_scalar_elem(i, threadIdx.x)] = 0.0f;
  for (int w0 = 0; w0 < p.num_payloads; w0 += kTopKDecodeThreads) {
    __syncthreads();
    const int w = w0 + threadIdx.x;
    if (w < p.num_payloads) {
      const uint8_t* payload = payload_at(p.payloads, w);
      const unsigned* words = reinterpret_cast<const unsigned*>(payload);  // header.count
      const ull count = __ldg(words + 6) | (static_cast<ull>(__ldg(words + 7)) << 32);
      const unsigned* idx = reinterpret_cast<const unsigned*>(payload + kPayloadHeaderBytes);
      auto load = [idx](uint64_t e) { return __ldg(idx + e); };
      run_begin[threadIdx.x] = topk_lower_bound(load, count, static_cast<unsigned>(lo));
      run_end[threadIdx.x] = topk_lower_bound(load, count, static_cast<unsigned>(lo + len));
      run_index[threadIdx.x] = idx;
      run_values[threadIdx.x] = payload + format::section1_offset(format::make_topk_header(
                                              p.numel, p.capacity, 0, 0, p.value_dtype));
    }
    __syncthreads();
    const int chunk =
        p.num_payloads - w0 < kTopKDecodeThreads ? p.num_payloads - w0 : kTopKDecodeThreads;
    for (int r = 0; r < chunk; ++r) {
      const unsigned* idx = run_index[r];
      const uint8_t* values = run_values[r];
      for (ull e = run_begin[r] + threadIdx.x; e < run_end[r]; e += kTopKDecodeThreads) {
        const unsigned i = __ldg(idx + e);
        const float v =
            p.value_dtype == math::kDtypeF32
                ? __ldg(reinterpret_cast<const float*>(values) + e)
                : half_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(values) + e),
                                     p.value_dtype);
        float& s = window[i - lo];
        s = math::add_rn(s, v);
      }
      __syncthreads();  // a later payload may add to the same element
    }
  }
  __syncthreads();
  // The output: the tile's segment and alignment decided once per block.
  const long long e0 = p.begin + lo;
  int s = seg_find(p.segments, p.num_segments, e0);
  Seg g = seg_load(p.segments, s);
  const long long local = e0 - g.offset;
  char* out = const_cast<char*>(g.data);
  bool bad = false;
  if (p.dtype == math::kDtypeF32 && len == kTopKDecodeTile && local + kTopKDecodeTile <= g.numel &&
      (reinterpret_cast<uintptr_t>(out + local * 4) & 15) == 0) {
    float4* o = reinterpret_cast<float4*>(out + local * 4);
#pragma unroll
    for (int i = 0; i < kTopKDecodeItems / 4; ++i) {
      const int j = topk_decode_chunk_first(i, threadIdx.x);
      float4 v = *reinterpret_cast<const float4*>(&window[j]);
      v.x = kPow2 ? math::mul_rn(v.x, inv) : math::div_rn(v.x, p.divisor);
      v.y = kPow2 ? math::mul_rn(v.y, inv) : math::div_rn(v.y, p.divisor);
      v.z = kPow2 ? math::mul_rn(v.z, inv) : math::div_rn(v.z, p.divisor);
      v.w = kPow2 ? math::mul_rn(v.w, inv) : math::div_rn(v.w, p.divisor);
      bad |= !math::is_finite_bits(math::float_bits(v.x)) ||
             !math::is_finite_bits(math::float_bits(v.y)) ||
             !math::is_finite_bits(math::float_bits(v.z)) ||
             !math::is_finite_bits(math::float_bits(v.w));
      __stcs(o + j / 4, v);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kTopKDecodeItems; ++i) {
      const int j = topk_decode_scalar_elem(i, threadIdx.x);
      if (j < len) {
        const long long x = e0 + j;
        while (s + 1 < p.num_segments && seg_offset(p.segments, s + 1) <= x)
          g = seg_load(p.segments, ++s);
        const float v = kPow2 ? math::mul_rn(window[j], inv) : math::div_rn(window[j], p.divisor);
        bad |= !math::is_finite_bits(math::float_bits(v));
        st_elem(const_cast<char*>(g.data), x - g.offset, p.dtype, v);
      }
    }
  }
  if (p.nonfinite != nullptr && __syncthreads_or(bad) && threadIdx.x == 0)
    atomicOr(p.nonfinite, 1u);
}

// GRADCOMP_TOPK_EXACT=cub selects cub::DeviceTopK as the exact threshold finder (for measuring
// it against the bracket); anything else, or a build without CCCL >= 3.3, the sample bracket.
// Read at every encode (a getenv), so one process can measure both.
bool want_cub_select() {
  const char* e = std::getenv("GRADCOMP_TOPK_EXACT");
  return e != nullptr && std::strcmp(e, "cub") == 0;
}

// GRADCOMP_TOPK_FUSED=0 runs the unfused exact path (bracket pass that writes nothing, then the
// full compaction), for measuring the two against each other.
bool want_unfused() {
  const char* e = std::getenv("GRADCOMP_TOPK_FUSED");
  return e != nullptr && std::strcmp(e, "0") == 0;
}

void note_cub_fallback(const char* why) {
  static bool said = false;
  if (!said) {
    said = true;
    std::fprintf(stderr,
                 "gradcomp: GRADCOMP_TOPK_EXACT=cub: %s; exact top-k uses the sample bracket\n",
                 why);
  }
}

}  // namespace

const char* topk_exact_method() {
#if defined(GRADCOMP_V2_DEVICE_TOPK)
  return want_cub_select() ? "cub::DeviceTopK threshold + ordered compaction"
                           : "sample bracket + radix over candidates + ordered compaction";
#else
  return want_cub_select()
             ? "sample bracket + radix over candidates + ordered compaction (cub::DeviceTopK "
               "requested, but this build has no CCCL >= 3.3)"
             : "sample bracket + radix over candidates + ordered compaction";
#endif
}

namespace {

#if defined(GRADCOMP_V2_DEVICE_TOPK)
auto device_topk_env(cudaStream_t stream) {
  return ::cuda::std::execution::env{
      ::cuda::stream_ref{stream},
      ::cuda::execution::require(::cuda::execution::determinism::not_guaranteed,
                                 ::cuda::execution::output_ordering::unsorted)};
}

// Runs DeviceTopK into the candidate buffer and derives T and eq_limit there. Returns false
// (nothing launched) when the workspace's candidate area cannot hold the keys and temp storage.
bool launch_cub_threshold(const TopKEncodeParams& p, const Workspace& ws, cudaStream_t stream,
                          cudaError_t* err) {
  auto keys = ::cuda::make_transform_iterator(::cuda::counting_iterator<long long>(0), KeyOf{p});
  size_t temp_bytes = 0;
  *err =
      cub::DeviceTopK::MaxKeys(nullptr, temp_bytes, keys, ws.cand, static_cast<long long>(p.numel),
                               static_cast<long long>(p.k), device_topk_env(stream));
  if (*err != cudaSuccess) return true;
  const size_t keys_bytes = (static_cast<size_t>(p.k) * 4 + 255) / 256 * 256;
  if (keys_bytes + temp_bytes > static_cast<size_t>(p.numel) * 4) {
    note_cub_fallback("its temp storage does not fit the workspace");
    return false;
  }
  void* temp = reinterpret_cast<char*>(ws.cand) + keys_bytes;
  *err = cub::DeviceTopK::MaxKeys(temp, temp_bytes, keys, ws.cand, static_cast<long long>(p.numel),
                                  static_cast<long long>(p.k), device_topk_env(stream));
  if (*err != cudaSuccess) return true;
  long long blocks = (p.k + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : (blocks > kMaxSelectBlocks ? kMaxSelectBlocks : blocks);
  topk_v2_keys_min_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(ws, p.k);
  if ((*err = cudaGetLastError()) != cudaSuccess) return true;
  topk_v2_keys_above_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(ws, p.k);
  *err = cudaGetLastError();
  return true;
}
#endif

}  // namespace

size_t topk_workspace_bytes(int64_t numel) {
  return 256 + kStateBytes + kHistBytes + 2 * tile_state_bytes(numel) + cand_bytes(numel);
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
  cudaError_t err = cudaSuccess;
  if (p.numel == 0) {
    topk_v2_empty_header_kernel<<<1, 1, 0, stream>>>(p);
    return launched(cudaGetLastError());
  }
  // Exact mode writes every entry (count == k == capacity); approximate mode may write fewer,
  // so its sections start zeroed.
  if (!p.exact) {
    err = cudaMemsetAsync(p.payload + kPayloadHeaderBytes, 0,
                          format::payload_bytes_of(h) - kPayloadHeaderBytes, stream);
    if (err != cudaSuccess) return launched(err);
  }
  const Workspace ws = carve(p.workspace, p.numel);
  const long long tiles = topk_tiles(p.numel);
  if (tiles > 0x7FFFFFFFLL) {
    s.rejected = "bucket has too many tiles";
    return s;
  }
  const int num_tiles = static_cast<int>(tiles);
  topk_v2_init_kernel<<<static_cast<unsigned>((num_tiles + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(ws, num_tiles);
  if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  const int64_t samples = math::topk_sample_size(p.numel);
  const int64_t m = math::topk_sample_rank(p.k, p.numel, samples);
  int64_t r_hi = 0, r_lo = 0;
  topk_bracket_ranks(m, samples, &r_hi, &r_lo);
  topk_v2_sample_kernel<<<1, kSampleThreads, 0, stream>>>(p, ws, m, r_hi, r_lo);
  if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  const unsigned long long values_offset = format::section1_offset(h);
  bool threshold_known = false;
  if (p.exact && p.k > 0 && want_cub_select()) {
#if defined(GRADCOMP_V2_DEVICE_TOPK)
    threshold_known = launch_cub_threshold(p, ws, stream, &err);
    if (err != cudaSuccess) return launched(err);
#else
    note_cub_fallback("this build has no CCCL >= 3.3 (set GRADCOMP_CCCL_INCLUDE_DIR)");
#endif
  }
  // The fused exact path writes residuals in its first pass, so its fallback (the full path)
  // needs the old residuals intact: it runs only when the residual output does not overlap them.
  const size_t r_bytes = static_cast<size_t>(p.numel) * math::dtype_bytes(p.residual_dtype);
  const char* rin = static_cast<const char*>(p.residual_in);
  const char* rout = static_cast<const char*>(p.residual_out);
  const bool overlap =
      rin != nullptr && rout != nullptr && rin < rout + r_bytes && rout < rin + r_bytes;
  const bool fused = p.exact && !threshold_known && !overlap && !want_unfused();
  const unsigned select_grid =
      static_cast<unsigned>(tiles < kMaxSelectBlocks ? tiles : kMaxSelectBlocks);
  if (fused) {
    topk_v2_gather_kernel<<<static_cast<unsigned>(num_tiles), kThreads, 0, stream>>>(
        p, ws, num_tiles, static_cast<ull>(cand_bytes(p.numel) / 8));
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  } else if (p.exact && !threshold_known) {
    topk_v2_bracket_kernel<<<select_grid, kThreads, 0, stream>>>(p, ws, tiles);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  }
  if (p.exact && !threshold_known) {
    for (int pass = 0; pass < math::kTopKPasses; ++pass) {
      topk_v2_radix_kernel<<<select_grid, kThreads, 0, stream>>>(p, ws, tiles, pass);
      if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
    }
  }
  // Persistent grids for the compactions: 4 blocks per SM (their occupancy), tiles taken in
  // order from a counter.
  int device = 0, sms = 0;
  if ((err = cudaGetDevice(&device)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) != cudaSuccess)
    return launched(err);
  const long long resident = static_cast<long long>(sms > 0 ? sms : 1) * 4;
  if (fused) {
    const long long buf_tiles = topk_tiles(static_cast<long long>(cand_bytes(p.numel) / 8));
    topk_v2_buffer_compact_kernel<<<
        static_cast<unsigned>(buf_tiles < resident ? buf_tiles : resident), kThreads, 0, stream>>>(
        p, ws, values_offset);
    if ((err = cudaGetLastError()) != cudaSuccess) return launched(err);
  }
  topk_v2_compact_kernel<<<static_cast<unsigned>(tiles < resident ? tiles : resident), kThreads, 0,
                           stream>>>(p, ws, num_tiles, values_offset);
  return launched(cudaGetLastError());
}

LaunchStatus run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  const uint64_t quads = (static_cast<uint64_t>(p.capacity) + 3) / 4;
  uint64_t blocks = (quads + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(p.num_payloads));
  topk_v2_validate_kernel<<<grid, kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return launched(err);
  err = launch_checks(p.payloads, p.num_payloads, nullptr, p.numel, format::kCodecTopK, p.capacity,
                      p.value_dtype, p.payload_bytes, p.body_sums, p.status, stream);
  if (err != cudaSuccess || p.numel == 0) return launched(err);
  const int64_t tiles = topk_decode_tiles(p.numel);
  float inv = 0.0f;
  if (math::pow2_reciprocal(p.divisor, &inv)) {
    topk_v2_decode_kernel<true>
        <<<static_cast<unsigned>(tiles), kTopKDecodeThreads, 0, stream>>>(p, inv);
  } else {
    topk_v2_decode_kernel<false>
        <<<static_cast<unsigned>(tiles), kTopKDecodeThreads, 0, stream>>>(p, 0.0f);
  }
  return launched(cudaGetLastError());
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
