// 4-bit weight v2 encode (GCW4): a fused pass for runs at aligned offsets, else a scales pass then
// a bytes pass; each sums the body checksum, and int8's seal finishes the row. Bytes equal the
// CPU's (csrc/codec/cpu_int4.cpp).
#include "int4_params.h"
#include "v2/int4_v2_map.h"
#include "v2/int8_v2.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

using namespace int8;  // the pieces the weight kernels share (int8_v2.cuh)

struct Int4EncodeArgs {
  Int8RunArgs run;                // codes_at: the codes section; row_offset places the nibbles
  uint8_t* body;                  // the payload after its header
  unsigned long long* sum;        // the body checksum, summed by every block
  unsigned long long* nonfinite;  // max of ~(row offset of a non-finite element), 0: none
};

// A lane's share of a block: the largest |x| bits, the smallest dividend key (the fast quotient's
// domain) and the block offset of the first non-finite element.
struct BlockScan {
  uint32_t max_bits = 0, min_key = 0xFFFFFFFFu, first_bad = 0xFFFFFFFFu;
  __device__ __forceinline__ void add(float x, uint32_t i) {
    const uint32_t bits = math::abs_bits(x);
    max_bits = bits > max_bits ? bits : max_bits;
    const uint32_t key = math::q4_dividend_key(bits);
    min_key = key < min_key ? key : min_key;
    if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
  }
};

// Fused pass, aligned layout (the run's elements 16-byte aligned, its row offset a multiple of 16,
// int4::run_aligned): int8's chunk map; a lane reads its 16 elements as 16-byte loads and writes
// their 8 code bytes as one 8-byte store. A block outside the refined reciprocal's domain, and a
// run's last partial chunk, go element by element through the one division site. A non-finite
// block writes nothing: the seal zeroes the whole body.
template <uint8_t D>
__global__ void __launch_bounds__(kThreadsPerBlock) int4_encode_v2_kernel(const Int4EncodeArgs a) {
  const ChunkMap map = chunk_map(a.run.block_log2);
  const uint32_t block = 1u << a.run.block_log2;
  const uint64_t blocks = (static_cast<uint64_t>(a.run.numel) + block - 1) >> a.run.block_log2;
  const char* elements = static_cast<const char*>(a.run.elements);
  uint64_t local = 0;
  // Rounds are bounded by the warp's first block, so all 32 lanes run every round's shuffles.
  for (uint64_t first = map.warp_first; first < blocks; first += map.stride) {
    const uint64_t b = first + map.group;
    const int64_t start = static_cast<int64_t>(b << a.run.block_log2);
    const int64_t rest = b < blocks ? a.run.numel - start : 0;
    const uint32_t n = rest < block ? static_cast<uint32_t>(rest) : block;
    BlockScan scan;
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      if (e + kChunk <= n) {
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
          load8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
#pragma unroll
          for (int j = 0; j < kLaneElements; ++j) scan.add(v[j], e + half * kLaneElements + j);
        }
      } else {
        for (uint32_t i = e; i < n; ++i) scan.add(load1<D>(elements, start + i), i);
      }
    }
    for (uint32_t offset = (1u << map.group_log2) >> 1; offset > 0; offset >>= 1) {
      scan.max_bits = max(scan.max_bits, __shfl_xor_sync(0xFFFFFFFFu, scan.max_bits, offset));
      scan.min_key = min(scan.min_key, __shfl_xor_sync(0xFFFFFFFFu, scan.min_key, offset));
      scan.first_bad = min(scan.first_bad, __shfl_xor_sync(0xFFFFFFFFu, scan.first_bad, offset));
    }
    if (n == 0) continue;
    if (scan.first_bad != 0xFFFFFFFFu) {
      if (map.sub == 0)
        atomicMax(a.nonfinite,
                  ~static_cast<unsigned long long>(a.run.row_offset + start + scan.first_bad));
      continue;
    }
    const uint16_t sbits = int4::block_scale_bits(scan.max_bits);
    const float scale = math::bf16_to_float(sbits);
    const uint64_t scale_at = 2 * (a.run.first_block + b);
    if (map.sub == 0) {
      __stcs(reinterpret_cast<unsigned short*>(a.body + scale_at), sbits);
      local += format::body_checksum_term(static_cast<uint32_t>(sbits) << (8 * (scale_at & 3)),
                                          scale_at >> 2);
    }
    const bool fast = math::int8_fast_block(scale, scan.min_key);  // the same for the block's lanes
    const float y = fast ? math::q4_refine_reciprocal(scale, approx_reciprocal(scale)) : 0.0f;
    // Even: the run's row offset and the block's start are multiples of 16.
    const uint64_t codes_at =
        a.run.codes_at + (a.run.row_offset + static_cast<uint64_t>(start)) / 2;
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      if (fast && e + kChunk <= n) {
        uint32_t w[2];
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
          load8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
          w[half] = int4::codes_word(v, scale, y);
        }
        __stcs(reinterpret_cast<uint2*>(a.body + codes_at + e / 2), make_uint2(w[0], w[1]));
        const uint64_t word = (codes_at + e / 2) >> 2;
        local +=
            format::body_checksum_term(w[0], word) + format::body_checksum_term(w[1], word + 1);
      } else {
        // Pairs of elements to bytes; an odd last element (the run's) leaves the high nibble 0.
        const uint32_t end = e + kChunk < n ? e + kChunk : n;
        uint32_t byte = 0;
#pragma unroll 1  // one division site (an unrolled copy would repeat the division's subroutine)
        for (uint32_t i = e; i < end; ++i) {
          const float x = load1<D>(elements, start + i);
          const float t0 = fast ? math::q4_fast_quotient(x, scale, y) : math::div_rn(x, scale);
          byte |= math::int4_nibble_of_quotient(t0, scale) << (4 * (i & 1));
          if ((i & 1) != 0 || i + 1 == end) {
            __stcs(a.body + codes_at + i / 2, static_cast<uint8_t>(byte));
            local += byte_term(byte, codes_at + i / 2);
            byte = 0;
          }
        }
      }
    }
  }
  local = warp_sum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(a.sum, local);
}

// Scales pass, any layout: a warp per block, lanes on consecutive elements (coalesced, scalar);
// the block's scale or its non-finite mark, as the fused pass forms them.
template <uint8_t D>
__global__ void __launch_bounds__(kThreadsPerBlock) int4_scales_v2_kernel(const Int4EncodeArgs a) {
  const int lane = threadIdx.x & 31;
  const uint32_t block = 1u << a.run.block_log2;
  const uint64_t blocks = (static_cast<uint64_t>(a.run.numel) + block - 1) >> a.run.block_log2;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kInt8Warps;
  uint64_t local = 0;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * kInt8Warps + (threadIdx.x >> 5); b < blocks;
       b += warps) {
    const int64_t start = static_cast<int64_t>(b << a.run.block_log2);
    const int64_t rest = a.run.numel - start;  // may exceed 2^32: compared before narrowing
    const uint32_t n = rest < block ? static_cast<uint32_t>(rest) : block;
    uint32_t max_bits = 0, first_bad = 0xFFFFFFFFu;
    for (uint32_t i = lane; i < n; i += 32) {
      const uint32_t bits = math::abs_bits(load1<D>(a.run.elements, start + i));
      max_bits = bits > max_bits ? bits : max_bits;
      if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
    }
    max_bits = __reduce_max_sync(0xFFFFFFFFu, max_bits);
    first_bad = __reduce_min_sync(0xFFFFFFFFu, first_bad);
    if (first_bad != 0xFFFFFFFFu) {
      if (lane == 0)
        atomicMax(a.nonfinite,
                  ~static_cast<unsigned long long>(a.run.row_offset + start + first_bad));
      continue;
    }
    const uint16_t sbits = int4::block_scale_bits(max_bits);
    const uint64_t scale_at = 2 * (a.run.first_block + b);
    if (lane == 0) {
      __stcs(reinterpret_cast<unsigned short*>(a.body + scale_at), sbits);
      local += format::body_checksum_term(static_cast<uint32_t>(sbits) << (8 * (scale_at & 3)),
                                          scale_at >> 2);
    }
  }
  local = warp_sum(local);
  if (lane == 0 && local != 0) atomicAdd(a.sum, local);
}

// Bytes pass, after the run's scales pass: a thread per code byte of the run (int4::RunBytes), so
// a byte whose nibbles lie in two blocks (a run at an odd row offset) has one writer. Its scales
// are read back from the payload; each element divides (this path is the rare one).
template <uint8_t D>
__global__ void __launch_bounds__(kThreadsPerBlock) int4_bytes_v2_kernel(const Int4EncodeArgs a) {
  if (__ldcg(a.nonfinite) != 0) return;  // the seal zeroes the body
  const int4::RunBytes bytes(a.run.row_offset, static_cast<uint64_t>(a.run.numel));
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreadsPerBlock;
  uint64_t local = 0;
  for (uint64_t g =
           bytes.first + static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
       g < bytes.end; g += stride) {
    const int64_t lo = int4::byte_low_element(g, a.run.row_offset);
    uint32_t mine = 0;
#pragma unroll 1  // one division site
    for (int h = 0; h < 2; ++h) {
      const int64_t i = lo + h;
      if (i < 0 || i >= a.run.numel) continue;
      const uint64_t scale_at =
          2 * (a.run.first_block + (static_cast<uint64_t>(i) >> a.run.block_log2));
      const float scale =
          math::bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(a.body + scale_at)));
      const float x = load1<D>(a.run.elements, i);
      mine |= math::int4_nibble_of_quotient(math::div_rn(x, scale), scale) << (4 * h);
    }
    // The previous run's low nibble stays (its launch has finished); its checksum share is its own.
    const uint32_t kept = lo < 0 ? __ldcg(a.body + a.run.codes_at + g) & 0xFu : 0u;
    __stcs(a.body + a.run.codes_at + g, static_cast<uint8_t>(kept | mine));
    local += byte_term(mine, a.run.codes_at + g);
  }
  local = warp_sum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(a.sum, local);
}

template <uint8_t D, bool kAligned>
struct LaunchEncode {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int4EncodeArgs& a) {
    if (kAligned) {
      int4_encode_v2_kernel<D><<<grid, kThreadsPerBlock, 0, stream>>>(a);
      return cudaGetLastError();
    }
    int4_scales_v2_kernel<D><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
    const int4::RunBytes bytes(a.run.row_offset, static_cast<uint64_t>(a.run.numel));
    int4_bytes_v2_kernel<D>
        <<<grid_for((bytes.end - bytes.first + 31) / 32), kThreadsPerBlock, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

LaunchStatus run_int4_encode(const Int8EncodeParams& p, uint64_t* scratch, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = int4_params_problem(p)) != nullptr) return s;
  if (scratch == nullptr || !aligned16(p.payload)) {
    s.rejected = "no scratch words, or a payload that is not 16-byte aligned";
    return s;
  }
  const uint64_t blocks = int8_row_blocks(p.runs, p.num_runs, p.block_size);
  Int4EncodeArgs a;
  a.body = p.payload + kInt8HeaderBytes;
  a.sum = reinterpret_cast<unsigned long long*>(scratch);
  a.nonfinite = reinterpret_cast<unsigned long long*>(scratch + 1);
  a.run.block_log2 = log2_of(p.block_size);
  a.run.first_block = 0;
  a.run.row_offset = 0;
  a.run.codes_at = int8_align16(2 * blocks);
  const uint8_t* input = static_cast<const uint8_t*>(p.input);
  for (int r = 0; r < p.num_runs; ++r) {
    a.run.elements = input;
    a.run.numel = p.runs[r].numel;
    const uint64_t run_blocks = math::int8_num_blocks(a.run.numel, p.block_size);
    // Runs go in order: a run at an odd offset keeps the previous run's nibble of their byte.
    const bool aligned = int4::run_aligned(reinterpret_cast<uintptr_t>(input), a.run.row_offset);
    const uint64_t per_warp = blocks_per_warp(p.block_size, aligned);
    s.error =
        by_dtype<LaunchEncode>(p.runs[r].dtype, aligned,
                               dim3(grid_for((run_blocks + per_warp - 1) / per_warp)), stream, a);
    if (s.error != cudaSuccess) return s;
    input += static_cast<uint64_t>(a.run.numel) * math::dtype_bytes(p.runs[r].dtype);
    a.run.first_block += run_blocks;
    a.run.row_offset += static_cast<uint64_t>(a.run.numel);
  }
  s.error = launch_row_seal(p, int4_row_payload_bytes(p.runs, p.num_runs, p.block_size),
                            (a.run.row_offset + 1) / 2, kInt4PayloadMagic, kInt4PayloadVersion,
                            scratch, stream);
  return s;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
