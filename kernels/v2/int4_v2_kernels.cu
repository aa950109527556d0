// 4-bit weight v2 decode (GCW4): int8's device check of W payloads, then their decode into FSDP's
// output, nothing written unless every payload passes. Bytes equal the CPU's
// (csrc/codec/cpu_int4.cpp).
#include "int4_params.h"
#include "v2/int4_v2_map.h"
#include "v2/int8_v2.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

using namespace int8;  // the pieces the weight kernels share (int8_v2.cuh)

struct Int4DecodeArgs {
  Int8RunArgs run;  // elements: the run's bytes in row 0; codes_at: the codes section
  const uint8_t* const* payloads;
  int n;
  uint64_t row_bytes;
  const int32_t* verdicts;  // n + 1 words: nothing is written unless the last is 0
};

// Any layout: a warp per block of the run, lanes on consecutive elements, each reading its nibble.
template <uint8_t D>
__device__ __forceinline__ void decode_unaligned(const Int4DecodeArgs& a, const uint8_t* body,
                                                 void* out) {
  const int lane = threadIdx.x & 31;
  const uint32_t block = 1u << a.run.block_log2;
  const uint64_t blocks = (static_cast<uint64_t>(a.run.numel) + block - 1) >> a.run.block_log2;
  const uint64_t warps = static_cast<uint64_t>(gridDim.x) * kInt8Warps;
  for (uint64_t b = static_cast<uint64_t>(blockIdx.x) * kInt8Warps + (threadIdx.x >> 5); b < blocks;
       b += warps) {
    const int64_t start = static_cast<int64_t>(b << a.run.block_log2);
    const int64_t rest = a.run.numel - start;  // may exceed 2^32: compared before narrowing
    const uint32_t n = rest < block ? static_cast<uint32_t>(rest) : block;
    const float scale = math::bf16_to_float(
        __ldg(reinterpret_cast<const unsigned short*>(body + 2 * (a.run.first_block + b))));
    const uint64_t first = a.run.row_offset + static_cast<uint64_t>(start);
    for (uint32_t i = lane; i < n; i += 32) {
      const uint64_t at = first + i;
      const uint32_t nibble = __ldg(body + a.run.codes_at + at / 2) >> (4 * (at & 1));
      store1<D>(out, start + i, math::int4_dequantize_nibble(nibble, scale));
    }
  }
}

// Aligned layout (int4::run_aligned for every row): a lane reads its chunk's 8 code bytes as one
// 8-byte load and writes its 16 elements as 16-byte stores; a run's last, partial chunk goes
// element by element.
template <uint8_t D>
__device__ __forceinline__ void decode_aligned(const Int4DecodeArgs& a, const uint8_t* body,
                                               void* out) {
  const ChunkMap map = chunk_map(a.run.block_log2);
  const uint32_t block = 1u << a.run.block_log2;
  const uint64_t blocks = (static_cast<uint64_t>(a.run.numel) + block - 1) >> a.run.block_log2;
  char* elements = static_cast<char*>(out);
  for (uint64_t b = map.warp_first + map.group; b < blocks; b += map.stride) {
    const int64_t start = static_cast<int64_t>(b << a.run.block_log2);
    const int64_t rest = a.run.numel - start;
    const uint32_t n = rest < block ? static_cast<uint32_t>(rest) : block;
    const float scale = math::bf16_to_float(
        __ldg(reinterpret_cast<const unsigned short*>(body + 2 * (a.run.first_block + b))));
    // Even: the run's row offset and the block's start are multiples of 16.
    const uint8_t* codes =
        body + a.run.codes_at + (a.run.row_offset + static_cast<uint64_t>(start)) / 2;
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      if (e + kChunk <= n) {
        const uint2 c = __ldcs(reinterpret_cast<const uint2*>(codes + e / 2));
        const uint32_t w[2] = {c.x, c.y};
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
#pragma unroll
          for (int j = 0; j < kLaneElements; ++j)
            v[j] = math::int4_dequantize_nibble(w[half] >> (4 * j), scale);
          store8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
        }
      } else {
        for (uint32_t i = e; i < n; ++i)
          store1<D>(out, start + i,
                    math::int4_dequantize_nibble(__ldg(codes + i / 2) >> (4 * (i & 1)), scale));
      }
    }
  }
}

template <uint8_t D, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock) int4_decode_v2_kernel(const Int4DecodeArgs a) {
  if (__ldcg(a.verdicts + a.n) != 0) return;
  const int w = blockIdx.y;
  const uint8_t* body = payload_at(a.payloads, w) + kInt8HeaderBytes;
  void* out = static_cast<uint8_t*>(const_cast<void*>(a.run.elements)) + a.row_bytes * w;
  if (kAligned) {
    decode_aligned<D>(a, body, out);
  } else {
    decode_unaligned<D>(a, body, out);
  }
}

template <uint8_t D, bool kAligned>
struct LaunchDecode {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int4DecodeArgs& a) {
    int4_decode_v2_kernel<D, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

LaunchStatus run_int4_decode(const Int8DecodeParams& p, uint64_t* sums, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = int4_params_problem(p)) != nullptr) return s;
  if (sums == nullptr) {
    s.rejected = "no body-sum words";
    return s;
  }
  s.error = launch_row_check(p, int4_row_payload_bytes(p.runs, p.num_runs, p.block_size),
                             kInt4PayloadMagic, kInt4PayloadVersion, sums, stream);
  if (s.error != cudaSuccess) return s;
  Int4DecodeArgs d;
  d.payloads = p.payloads;
  d.n = p.num_payloads;
  d.row_bytes = int8_row_bytes(p.runs, p.num_runs);
  d.verdicts = p.verdicts;
  d.run.block_log2 = log2_of(p.block_size);
  d.run.first_block = 0;
  d.run.row_offset = 0;
  d.run.codes_at = int8_align16(2 * int8_row_blocks(p.runs, p.num_runs, p.block_size));
  uint8_t* out = static_cast<uint8_t*>(p.output);
  for (int r = 0; r < p.num_runs; ++r) {
    d.run.elements = out;
    d.run.numel = p.runs[r].numel;
    const uint64_t run_blocks = math::int8_num_blocks(d.run.numel, p.block_size);
    // Row w starts row_bytes * w after row 0: every row is aligned only if row 0 and that are.
    const bool aligned = int4::run_aligned(reinterpret_cast<uintptr_t>(out), d.run.row_offset) &&
                         (p.num_payloads == 1 || d.row_bytes % 16 == 0);
    const uint64_t per_warp = blocks_per_warp(p.block_size, aligned);
    const unsigned gx =
        grid_for((run_blocks + per_warp - 1) / per_warp * static_cast<uint64_t>(p.num_payloads)) /
            static_cast<unsigned>(p.num_payloads) +
        1;
    s.error = by_dtype<LaunchDecode>(p.runs[r].dtype, aligned,
                                     dim3(gx, static_cast<unsigned>(p.num_payloads)), stream, d);
    if (s.error != cudaSuccess) return s;
    out += static_cast<uint64_t>(d.run.numel) * math::dtype_bytes(p.runs[r].dtype);
    d.run.first_block += run_blocks;
    d.run.row_offset += static_cast<uint64_t>(d.run.numel);
  }
  return s;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
