// int8 v2 encode (the weight all-gather): a run's blocks with the body checksum summed in the
// pass, then a seal writing the header (or zeroing a flagged body). Bytes equal the CPU's
// (csrc/codec/cpu_int8.cpp).
#include "v2/int8_v2.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

using namespace int8;  // the pieces the int8 kernels share (int8_v2.cuh)

struct Int8EncodeArgs {
  Int8RunArgs run;
  uint8_t* body;                  // the payload after its header
  unsigned long long* sum;        // the body checksum, summed by every block
  unsigned long long* nonfinite;  // max of ~(row offset of a non-finite element), 0: none
};

// Unaligned layout: a warp per int8 block, lanes on consecutive elements (coalesced, scalar).
// |x| reduced over the warp (its bits: the largest finite |x| has the largest bits, and NaN or
// infinity bits exceed all finite ones), then the block's codes from the scale's refined
// reciprocal (math::int8_fast_block) or, outside that domain, the division. A non-finite block
// writes nothing: the seal zeroes the whole body.
template <uint8_t D>
__device__ __forceinline__ void encode_unaligned(const Int8EncodeArgs& a) {
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
    uint32_t max_bits = 0, min_key = 0xFFFFFFFFu, first_bad = 0xFFFFFFFFu;
    for (uint32_t i = lane; i < n; i += 32) {
      const uint32_t bits = math::abs_bits(load1<D>(a.run.elements, start + i));
      max_bits = bits > max_bits ? bits : max_bits;
      const uint32_t key = math::q4_dividend_key(bits);
      min_key = key < min_key ? key : min_key;
      if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
    }
    max_bits = __reduce_max_sync(0xFFFFFFFFu, max_bits);
    min_key = __reduce_min_sync(0xFFFFFFFFu, min_key);
    first_bad = __reduce_min_sync(0xFFFFFFFFu, first_bad);
    if (first_bad != 0xFFFFFFFFu) {
      if (lane == 0)
        atomicMax(a.nonfinite,
                  ~static_cast<unsigned long long>(a.run.row_offset + start + first_bad));
      continue;
    }
    const uint16_t sbits = math::int8_scale_bits(__uint_as_float(max_bits));
    const float scale = math::bf16_to_float(sbits);
    const uint64_t scale_at = 2 * (a.run.first_block + b);
    if (lane == 0) {
      __stcs(reinterpret_cast<unsigned short*>(a.body + scale_at), sbits);
      local += format::body_checksum_term(static_cast<uint32_t>(sbits) << (8 * (scale_at & 3)),
                                          scale_at >> 2);
    }
    const bool fast = math::int8_fast_block(scale, min_key);  // the same for the whole warp
    const float y = fast ? math::q4_refine_reciprocal(scale, approx_reciprocal(scale)) : 0.0f;
    const uint64_t codes_at = a.run.codes_at + static_cast<uint64_t>(start);
    for (uint32_t i = lane; i < n; i += 32) {
      const float x = load1<D>(a.run.elements, start + i);
      const float t0 = fast ? math::q4_fast_quotient(x, scale, y) : math::div_rn(x, scale);
      const uint8_t code = math::int8_code_byte(t0, scale);
      __stcs(a.body + codes_at + i, code);
      local += byte_term(code, codes_at + i);
    }
  }
  local = warp_sum(local);
  if (lane == 0 && local != 0) atomicAdd(a.sum, local);
}

// Two little-endian code words of 8 elements' codes (one half of a chunk), by the refined
// reciprocal: blocks outside its domain take the element-by-element division instead.
__device__ __forceinline__ void codes8(const float (&v)[kLaneElements], float scale, float y,
                                       uint32_t* w) {
  uint32_t word[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < kLaneElements; ++j) {
    const float t0 = math::q4_fast_quotient(v[j], scale, y);
    word[j >> 2] |= static_cast<uint32_t>(math::int8_code_byte(t0, scale)) << (8 * (j & 3));
  }
  w[0] = word[0];
  w[1] = word[1];
}

// Aligned layout (the run's elements and its codes start 16-byte aligned): a lane reads its chunk
// as 16-byte loads (two halves of 8 elements) and writes its 16 codes as one 16-byte store; a
// run's last, partial chunk and the rare blocks outside the refined reciprocal's domain go element
// by element. The same codes, verdict on non-finite blocks and checksum terms as the unaligned
// path.
template <uint8_t D>
__device__ __forceinline__ void encode_aligned(const Int8EncodeArgs& a) {
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
    uint32_t max_bits = 0, min_key = 0xFFFFFFFFu, first_bad = 0xFFFFFFFFu;
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      if (e + kChunk <= n) {
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
          load8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
#pragma unroll
          for (int j = 0; j < kLaneElements; ++j) {
            const uint32_t bits = math::abs_bits(v[j]);
            max_bits = bits > max_bits ? bits : max_bits;
            const uint32_t key = math::q4_dividend_key(bits);
            min_key = key < min_key ? key : min_key;
            const uint32_t i = e + half * kLaneElements + j;
            if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
          }
        }
      } else {
        for (uint32_t i = e; i < n; ++i) {
          const uint32_t bits = math::abs_bits(load1<D>(elements, start + i));
          max_bits = bits > max_bits ? bits : max_bits;
          const uint32_t key = math::q4_dividend_key(bits);
          min_key = key < min_key ? key : min_key;
          if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
        }
      }
    }
    for (uint32_t offset = (1u << map.group_log2) >> 1; offset > 0; offset >>= 1) {
      max_bits = max(max_bits, __shfl_xor_sync(0xFFFFFFFFu, max_bits, offset));
      min_key = min(min_key, __shfl_xor_sync(0xFFFFFFFFu, min_key, offset));
      first_bad = min(first_bad, __shfl_xor_sync(0xFFFFFFFFu, first_bad, offset));
    }
    if (n == 0) continue;
    if (first_bad != 0xFFFFFFFFu) {
      if (map.sub == 0)
        atomicMax(a.nonfinite,
                  ~static_cast<unsigned long long>(a.run.row_offset + start + first_bad));
      continue;
    }
    const uint16_t sbits = math::int8_scale_bits(__uint_as_float(max_bits));
    const float scale = math::bf16_to_float(sbits);
    const uint64_t scale_at = 2 * (a.run.first_block + b);
    if (map.sub == 0) {
      __stcs(reinterpret_cast<unsigned short*>(a.body + scale_at), sbits);
      local += format::body_checksum_term(static_cast<uint32_t>(sbits) << (8 * (scale_at & 3)),
                                          scale_at >> 2);
    }
    const bool fast = math::int8_fast_block(scale, min_key);  // the same for the block's lanes
    const float y = fast ? math::q4_refine_reciprocal(scale, approx_reciprocal(scale)) : 0.0f;
    const uint64_t codes_at = a.run.codes_at + static_cast<uint64_t>(start);
    for (uint32_t s = 0; s < map.steps; ++s) {
      const uint32_t e = map.chunk(s);
      // A whole chunk of a block in the refined reciprocal's domain (the common case) is vector
      // work; a partial chunk, or a block whose scale or dividends lie outside that domain, takes
      // the one division site, element by element, so the division is not unrolled 16 times.
      if (fast && e + kChunk <= n) {
        uint32_t w[4];
#pragma unroll
        for (uint32_t half = 0; half < 2; ++half) {
          float v[kLaneElements];
          load8_aligned<D>(elements + (start + e + half * kLaneElements) * Dtype<D>::kBytes, v);
          codes8(v, scale, y, w + 2 * half);
        }
        __stcs(reinterpret_cast<uint4*>(a.body + codes_at + e), make_uint4(w[0], w[1], w[2], w[3]));
        const uint64_t word = (codes_at + e) >> 2;
#pragma unroll
        for (int k = 0; k < 4; ++k) local += format::body_checksum_term(w[k], word + k);
      } else {
        const uint32_t end = e + kChunk < n ? e + kChunk : n;
#pragma unroll 1  // one division site (an unrolled copy would repeat the division's subroutine)
        for (uint32_t i = e; i < end; ++i) {
          const float x = load1<D>(elements, start + i);
          const float t0 = fast ? math::q4_fast_quotient(x, scale, y) : math::div_rn(x, scale);
          const uint8_t code = math::int8_code_byte(t0, scale);
          __stcs(a.body + codes_at + i, code);
          local += byte_term(code, codes_at + i);
        }
      }
    }
  }
  local = warp_sum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(a.sum, local);
}

template <uint8_t D, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock) int8_encode_v2_kernel(const Int8EncodeArgs a) {
  if (kAligned) {
    encode_aligned<D>(a);
  } else {
    encode_unaligned<D>(a);
  }
}

struct Int8SealArgs {
  uint8_t* payload;  // 16-byte aligned
  uint64_t total;    // the row's payload bytes: a multiple of 16
  uint32_t magic;    // GCW8's or GCW4's
  uint32_t version;
  uint32_t block;
  uint32_t num_runs;
  uint64_t numel;
  uint64_t codes_bytes;           // the codes section before its padding
  uint64_t scales_end, codes_at;  // body offsets: the scales' end, the codes section
  const unsigned long long* sum;
  const unsigned long long* nonfinite;
  unsigned long long* nonfinite_at;  // the caller's report word
};

// After every run's encode: a flagged row's body is zeroed by every block (16-byte stores);
// otherwise block 0 zeroes the sections' padding. Block 0 writes the header and the report.
__global__ void __launch_bounds__(kThreadsPerBlock) int8_seal_v2_kernel(const Int8SealArgs a) {
  const unsigned long long bad = __ldcg(a.nonfinite);
  uint8_t* body = a.payload + kInt8HeaderBytes;
  const uint64_t body_bytes = a.total - kInt8HeaderBytes;
  if (bad != 0) {
    const uint64_t vectors = body_bytes / 16;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreadsPerBlock;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
         i < vectors; i += stride)
      __stcs(reinterpret_cast<uint4*>(body) + i, make_uint4(0, 0, 0, 0));
  } else if (blockIdx.x == 0 && threadIdx.x < 32) {
    const uint64_t at = threadIdx.x < 16 ? a.scales_end + threadIdx.x
                                         : a.codes_at + a.codes_bytes + (threadIdx.x - 16);
    const uint64_t end = threadIdx.x < 16 ? a.codes_at : body_bytes;
    if (at < end) __stcs(body + at, static_cast<uint8_t>(0));
  }
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const unsigned long long sum = bad != 0 ? 0ull : __ldcg(a.sum);
  const uint32_t flags = bad != 0 ? kInt8FlagNonfinite : 0u;
  __stcs(reinterpret_cast<uint4*>(a.payload),
         make_uint4(a.magic, a.version | (flags << 16), a.block, a.num_runs));
  __stcs(reinterpret_cast<uint4*>(a.payload) + 1,
         make_uint4(static_cast<uint32_t>(a.numel), static_cast<uint32_t>(a.numel >> 32),
                    static_cast<uint32_t>(sum), static_cast<uint32_t>(sum >> 32)));
  __stcs(a.nonfinite_at, bad != 0 ? ~bad + 1ull : 0ull);
}

template <uint8_t D, bool kAligned>
struct LaunchEncode {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int8EncodeArgs& a) {
    int8_encode_v2_kernel<D, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

}  // namespace

LaunchStatus run_int8_encode(const Int8EncodeParams& p, uint64_t* scratch, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (scratch == nullptr || !aligned16(p.payload)) {
    s.rejected = "no scratch words, or a payload that is not 16-byte aligned";
    return s;
  }
  const uint64_t blocks = int8_row_blocks(p.runs, p.num_runs, p.block_size);
  Int8EncodeArgs a;
  a.body = p.payload + kInt8HeaderBytes;
  a.sum = reinterpret_cast<unsigned long long*>(scratch);
  a.nonfinite = reinterpret_cast<unsigned long long*>(scratch + 1);
  a.run.block_log2 = log2_of(p.block_size);
  a.run.first_block = 0;
  a.run.row_offset = 0;
  const uint64_t codes_section = int8_align16(2 * blocks);
  const uint8_t* input = static_cast<const uint8_t*>(p.input);
  for (int r = 0; r < p.num_runs; ++r) {
    a.run.elements = input;
    a.run.numel = p.runs[r].numel;
    a.run.codes_at = codes_section + a.run.row_offset;
    const uint64_t run_blocks = math::int8_num_blocks(a.run.numel, p.block_size);
    // Blocks start at multiples of 16 elements, so the run's start decides the whole run.
    const bool aligned = int8_run_aligned16(input, a.run.row_offset);
    const uint64_t per_warp = blocks_per_warp(p.block_size, aligned);
    s.error =
        by_dtype<LaunchEncode>(p.runs[r].dtype, aligned,
                               dim3(grid_for((run_blocks + per_warp - 1) / per_warp)), stream, a);
    if (s.error != cudaSuccess) return s;
    input += static_cast<uint64_t>(a.run.numel) * math::dtype_bytes(p.runs[r].dtype);
    a.run.first_block += run_blocks;
    a.run.row_offset += static_cast<uint64_t>(a.run.numel);
  }
  s.error =
      launch_row_seal(p, int8_row_payload_bytes(p.runs, p.num_runs, p.block_size), a.run.row_offset,
                      kInt8PayloadMagic, kInt8PayloadVersion, scratch, stream);
  return s;
}

namespace int8 {

cudaError_t launch_row_seal(const Int8EncodeParams& p, uint64_t total, uint64_t codes_bytes,
                            uint32_t magic, uint16_t version, uint64_t* scratch,
                            cudaStream_t stream) {
  const uint64_t blocks = int8_row_blocks(p.runs, p.num_runs, p.block_size);
  Int8SealArgs seal;
  seal.payload = p.payload;
  seal.total = total;
  seal.magic = magic;
  seal.version = version;
  seal.block = p.block_size;
  seal.num_runs = static_cast<uint32_t>(p.num_runs);
  seal.numel = int8_row_numel(p.runs, p.num_runs);
  seal.codes_bytes = codes_bytes;
  seal.scales_end = 2 * blocks;
  seal.codes_at = int8_align16(2 * blocks);
  seal.sum = reinterpret_cast<unsigned long long*>(scratch);
  seal.nonfinite = reinterpret_cast<unsigned long long*>(scratch + 1);
  seal.nonfinite_at = reinterpret_cast<unsigned long long*>(p.nonfinite_at);
  const uint64_t vectors = (seal.total - kInt8HeaderBytes) / 16;
  int8_seal_v2_kernel<<<grid_for(vectors / 32 + 1), kThreadsPerBlock, 0, stream>>>(seal);
  return cudaGetLastError();
}

}  // namespace int8

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
