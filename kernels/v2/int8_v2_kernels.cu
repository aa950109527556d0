// int8 v2 decode (the weight all-gather): a device check of W payloads, then their decode into
// FSDP's output, nothing written unless every payload passes. Bytes equal the CPU's
// (csrc/codec/cpu_int8.cpp).
#include "v2/int8_v2.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

using namespace int8;  // the pieces the int8 kernels share (int8_v2.cuh)

struct Int8CheckArgs {
  const uint8_t* const* payloads;  // device array of 16-byte aligned payloads
  int n;
  uint64_t total;           // every payload's expected size
  uint32_t magic, version;  // GCW8's or GCW4's
  uint32_t block, num_runs;
  uint64_t numel;
  unsigned long long* sums;  // n sums, then the finished-block count
  int32_t* verdicts;         // n verdicts, then whether any is not kInt8Ok
};

// blockIdx.y: the payload; blockIdx.x: a slice of its body in 16-byte loads. The last block to
// finish reads every header and forms the verdicts as cpu::int8_row_verdict does.
__global__ void __launch_bounds__(kThreadsPerBlock) int8_check_v2_kernel(const Int8CheckArgs a) {
  __shared__ bool last;
  __shared__ int any;
  const int w = blockIdx.y;
  const uint4* body = reinterpret_cast<const uint4*>(payload_at(a.payloads, w) + kInt8HeaderBytes);
  const uint64_t vectors = (a.total - kInt8HeaderBytes) / 16;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreadsPerBlock;
  uint64_t local = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x; i < vectors;
       i += stride) {
    const uint4 v = __ldcs(body + i);
    local += format::body_checksum_term(v.x, 4 * i) + format::body_checksum_term(v.y, 4 * i + 1) +
             format::body_checksum_term(v.z, 4 * i + 2) +
             format::body_checksum_term(v.w, 4 * i + 3);
  }
  local = warp_sum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(&a.sums[w], local);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long blocks = static_cast<unsigned long long>(gridDim.x) * gridDim.y;
    last = atomicAdd(&a.sums[a.n], 1ull) == blocks - 1;
    any = 0;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int p = threadIdx.x; p < a.n; p += kThreadsPerBlock) {
    const uint4* h = reinterpret_cast<const uint4*>(payload_at(a.payloads, p));
    const uint4 h0 = __ldcg(h), h1 = __ldcg(h + 1);
    const uint64_t numel = h1.x | (static_cast<uint64_t>(h1.y) << 32);
    const uint64_t sum = h1.z | (static_cast<uint64_t>(h1.w) << 32);
    const uint32_t version = h0.y & 0xFFFFu, flags = (h0.y >> 16) & 0xFFu, reserved = h0.y >> 24;
    int32_t v = kInt8Ok;
    if (h0.x != a.magic) {
      v = kInt8BadMagic;
    } else if (version != a.version) {
      v = kInt8BadVersion;
    } else if (h0.z != a.block || h0.w != a.num_runs || numel != a.numel) {
      v = kInt8BadLayout;
    } else if ((flags & ~static_cast<uint32_t>(kInt8FlagNonfinite)) != 0 || reserved != 0) {
      v = kInt8BadFlags;
    } else if (atomicAdd(&a.sums[p], 0ull) != sum) {
      v = kInt8BadChecksum;
    } else if (flags != 0) {
      v = kInt8Nonfinite;
    }
    a.verdicts[p] = v;
    if (v != kInt8Ok) any = 1;  // benign race: every writer writes 1
  }
  __syncthreads();
  if (threadIdx.x == 0) a.verdicts[a.n] = any;
}

struct Int8DecodeArgs {
  Int8RunArgs run;  // elements: the run's bytes in row 0 of the output
  const uint8_t* const* payloads;
  int n;
  uint64_t row_bytes;
  const int32_t* verdicts;  // n + 1 words: nothing is written unless the last is 0
};

// blockIdx.y: the payload (and output row). Unaligned layout: a warp per int8 block of the run,
// lanes on consecutive elements.
template <uint8_t D>
__device__ __forceinline__ void decode_unaligned(const Int8DecodeArgs& a, const uint8_t* body,
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
    const uint8_t* codes = body + a.run.codes_at + start;
    for (uint32_t i = lane; i < n; i += 32)
      store1<D>(out, start + i, math::int8_dequantize_byte(__ldg(codes + i), scale));
  }
}

// Aligned layout (the run's codes and every row's elements start 16-byte aligned): a lane reads
// its chunk's 16 codes as one 16-byte load and writes its elements as 16-byte stores; a run's last,
// partial chunk goes element by element.
template <uint8_t D>
__device__ __forceinline__ void decode_aligned(const Int8DecodeArgs& a, const uint8_t* body,
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
    const uint8_t* codes = body + a.run.codes_at + start;
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      if (e + kChunk <= n) {
        const uint4 c = __ldcs(reinterpret_cast<const uint4*>(codes + e));
        const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
#pragma unroll
          for (int j = 0; j < kLaneElements; ++j) {
            const uint8_t code = static_cast<uint8_t>(w[2 * half + (j >> 2)] >> (8 * (j & 3)));
            v[j] = math::int8_dequantize_byte(code, scale);
          }
          store8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
        }
      } else {
        for (uint32_t i = e; i < n; ++i)
          store1<D>(out, start + i, math::int8_dequantize_byte(__ldg(codes + i), scale));
      }
    }
  }
}

template <uint8_t D, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock) int8_decode_v2_kernel(const Int8DecodeArgs a) {
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
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int8DecodeArgs& a) {
    int8_decode_v2_kernel<D, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

LaunchStatus run_int8_decode(const Int8DecodeParams& p, uint64_t* sums, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (sums == nullptr) {
    s.rejected = "no body-sum words";
    return s;
  }
  s.error = launch_row_check(p, int8_row_payload_bytes(p.runs, p.num_runs, p.block_size),
                             kInt8PayloadMagic, kInt8PayloadVersion, sums, stream);
  if (s.error != cudaSuccess) return s;
  const uint64_t blocks = int8_row_blocks(p.runs, p.num_runs, p.block_size);
  Int8DecodeArgs d;
  d.payloads = p.payloads;
  d.n = p.num_payloads;
  d.row_bytes = int8_row_bytes(p.runs, p.num_runs);
  d.verdicts = p.verdicts;
  d.run.block_log2 = log2_of(p.block_size);
  d.run.first_block = 0;
  d.run.row_offset = 0;
  const uint64_t codes_section = int8_align16(2 * blocks);
  uint8_t* out = static_cast<uint8_t*>(p.output);
  for (int r = 0; r < p.num_runs; ++r) {
    d.run.elements = out;
    d.run.numel = p.runs[r].numel;
    d.run.codes_at = codes_section + d.run.row_offset;
    const uint64_t run_blocks = math::int8_num_blocks(d.run.numel, p.block_size);
    // Row w starts row_bytes * w after row 0: every row is aligned only if row 0 and that are.
    const bool aligned =
        int8_run_aligned16(out, d.run.row_offset) && (p.num_payloads == 1 || d.row_bytes % 16 == 0);
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

namespace int8 {

cudaError_t launch_row_check(const Int8DecodeParams& p, uint64_t total, uint32_t magic,
                             uint16_t version, uint64_t* sums, cudaStream_t stream) {
  Int8CheckArgs c;
  c.payloads = p.payloads;
  c.n = p.num_payloads;
  c.total = total;
  c.magic = magic;
  c.version = version;
  c.block = p.block_size;
  c.num_runs = static_cast<uint32_t>(p.num_runs);
  c.numel = int8_row_numel(p.runs, p.num_runs);
  c.sums = reinterpret_cast<unsigned long long*>(sums);
  c.verdicts = p.verdicts;
  const uint64_t per_cta = static_cast<uint64_t>(kThreadsPerBlock) * 4;
  const uint64_t cap = kInt8MaxCtas / static_cast<uint64_t>(p.num_payloads) + 1;
  uint64_t x = ((total - kInt8HeaderBytes) / 16 + per_cta - 1) / per_cta;
  x = x < 1 ? 1 : (x > cap ? cap : x);
  int8_check_v2_kernel<<<dim3(static_cast<unsigned>(x), static_cast<unsigned>(p.num_payloads)),
                         kThreadsPerBlock, 0, stream>>>(c);
  return cudaGetLastError();
}

}  // namespace int8
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
