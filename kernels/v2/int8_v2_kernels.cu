// int8 v2 kernels (the weight all-gather): encode a run's blocks with the body checksum summed in
// the pass, a seal writing the header (or zeroing a flagged body), a device check of W payloads,
// and their decode into FSDP's output. Bytes equal the CPU's (csrc/codec/cpu_int8.cpp).
#include "int8_params.h"
#include "v2/launchers_v2.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

constexpr int kInt8Warps = kThreadsPerBlock / 32;
constexpr uint64_t kInt8MaxCtas = 2048;  // ~15 blocks per SM of an H200, as the payload checks

// The hardware's reciprocal approximation (within 1 ulp for normal scales), which
// math::q4_refine_reciprocal turns into the scale's reciprocal.
__device__ __forceinline__ float approx_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The checksum term of one byte of the body at byte offset `at` (format::body_checksum_term is
// linear in the word, so each byte adds its own share).
__device__ __forceinline__ uint64_t byte_term(uint32_t byte, uint64_t at) {
  return format::body_checksum_term(byte << (8 * (at & 3)), at >> 2);
}

// One run of a row: where its elements, scales and codes are.
struct Int8RunArgs {
  const void* elements;  // encode: the run's input; decode: the run's bytes in row 0
  int64_t numel;
  uint32_t block_log2;
  uint64_t first_block;  // the run's first block in the row (its first scale)
  uint64_t codes_at;     // body offset of the run's first code: the codes section + row offset
  uint64_t row_offset;   // the run's first element in the row
};

struct Int8EncodeArgs {
  Int8RunArgs run;
  uint8_t* body;                  // the payload after its header
  unsigned long long* sum;        // the body checksum, summed by every block
  unsigned long long* nonfinite;  // max of ~(row offset of a non-finite element), 0: none
};

// A warp per int8 block: |x| reduced over the warp (its bits: the largest finite |x| has the
// largest bits, and NaN or infinity bits exceed all finite ones), then the block's codes from the
// scale's refined reciprocal (math::int8_fast_block) or, outside that domain, the division. A
// non-finite block writes nothing: the seal zeroes the whole body.
template <uint8_t D>
__global__ void __launch_bounds__(kThreadsPerBlock) int8_encode_v2_kernel(const Int8EncodeArgs a) {
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

struct Int8SealArgs {
  uint8_t* payload;  // 16-byte aligned
  uint64_t total;    // int8_row_payload_bytes: a multiple of 16
  uint32_t block;
  uint32_t num_runs;
  uint64_t numel;
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
    const uint64_t at =
        threadIdx.x < 16 ? a.scales_end + threadIdx.x : a.codes_at + a.numel + (threadIdx.x - 16);
    const uint64_t end = threadIdx.x < 16 ? a.codes_at : body_bytes;
    if (at < end) __stcs(body + at, static_cast<uint8_t>(0));
  }
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const unsigned long long sum = bad != 0 ? 0ull : __ldcg(a.sum);
  const uint32_t flags = bad != 0 ? kInt8FlagNonfinite : 0u;
  __stcs(reinterpret_cast<uint4*>(a.payload),
         make_uint4(kInt8PayloadMagic, kInt8PayloadVersion | (flags << 16), a.block, a.num_runs));
  __stcs(reinterpret_cast<uint4*>(a.payload) + 1,
         make_uint4(static_cast<uint32_t>(a.numel), static_cast<uint32_t>(a.numel >> 32),
                    static_cast<uint32_t>(sum), static_cast<uint32_t>(sum >> 32)));
  __stcs(a.nonfinite_at, bad != 0 ? ~bad + 1ull : 0ull);
}

struct Int8CheckArgs {
  const uint8_t* const* payloads;  // device array of 16-byte aligned payloads
  int n;
  uint64_t total;  // every payload's expected size
  uint32_t block, num_runs;
  uint64_t numel;
  unsigned long long* sums;  // n sums, then the finished-block count
  int32_t* verdicts;         // n verdicts, then whether any is not kInt8Ok
};

__device__ __forceinline__ const uint8_t* payload_at(const uint8_t* const* payloads, int w) {
  return reinterpret_cast<const uint8_t*>(
      __ldg(reinterpret_cast<const unsigned long long*>(payloads) + w));
}

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
    const uint32_t version = h0.y & 0xFFFFu, flags = (h0.y >> 16) & 0xFFu;
    int32_t v = kInt8Ok;
    if (h0.x != kInt8PayloadMagic) {
      v = kInt8BadMagic;
    } else if (version != kInt8PayloadVersion) {
      v = kInt8BadVersion;
    } else if (h0.z != a.block || h0.w != a.num_runs || numel != a.numel) {
      v = kInt8BadLayout;
    } else if ((flags & ~static_cast<uint32_t>(kInt8FlagNonfinite)) != 0) {
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

// blockIdx.y: the payload (and output row); a warp per int8 block of the run.
template <uint8_t D>
__global__ void __launch_bounds__(kThreadsPerBlock) int8_decode_v2_kernel(const Int8DecodeArgs a) {
  if (__ldcg(a.verdicts + a.n) != 0) return;
  const int w = blockIdx.y;
  const uint8_t* body = payload_at(a.payloads, w) + kInt8HeaderBytes;
  void* out = static_cast<uint8_t*>(const_cast<void*>(a.run.elements)) + a.row_bytes * w;
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

uint32_t log2_of(uint32_t pow2) {
  uint32_t l = 0;
  while ((1u << l) < pow2) ++l;
  return l;
}

unsigned grid_for(uint64_t blocks) {
  const uint64_t ctas = (blocks + kInt8Warps - 1) / kInt8Warps;
  return static_cast<unsigned>(ctas < 1 ? 1 : (ctas > kInt8MaxCtas ? kInt8MaxCtas : ctas));
}

template <template <uint8_t> class Launch, typename Args>
cudaError_t by_dtype(uint8_t dtype, dim3 grid, cudaStream_t stream, const Args& args) {
  switch (dtype) {
    case math::kDtypeF32:
      return Launch<math::kDtypeF32>::run(grid, stream, args);
    case math::kDtypeF16:
      return Launch<math::kDtypeF16>::run(grid, stream, args);
    default:
      return Launch<math::kDtypeBF16>::run(grid, stream, args);
  }
}

template <uint8_t D>
struct LaunchEncode {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int8EncodeArgs& a) {
    int8_encode_v2_kernel<D><<<grid, kThreadsPerBlock, 0, stream>>>(a);
    return cudaGetLastError();
  }
};

template <uint8_t D>
struct LaunchDecode {
  static cudaError_t run(dim3 grid, cudaStream_t stream, const Int8DecodeArgs& a) {
    int8_decode_v2_kernel<D><<<grid, kThreadsPerBlock, 0, stream>>>(a);
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
    s.error = by_dtype<LaunchEncode>(p.runs[r].dtype, dim3(grid_for(run_blocks)), stream, a);
    if (s.error != cudaSuccess) return s;
    input += static_cast<uint64_t>(a.run.numel) * math::dtype_bytes(p.runs[r].dtype);
    a.run.first_block += run_blocks;
    a.run.row_offset += static_cast<uint64_t>(a.run.numel);
  }
  Int8SealArgs seal;
  seal.payload = p.payload;
  seal.total = int8_row_payload_bytes(p.runs, p.num_runs, p.block_size);
  seal.block = p.block_size;
  seal.num_runs = static_cast<uint32_t>(p.num_runs);
  seal.numel = a.run.row_offset;
  seal.scales_end = 2 * blocks;
  seal.codes_at = codes_section;
  seal.sum = a.sum;
  seal.nonfinite = a.nonfinite;
  seal.nonfinite_at = reinterpret_cast<unsigned long long*>(p.nonfinite_at);
  const uint64_t vectors = (seal.total - kInt8HeaderBytes) / 16;
  int8_seal_v2_kernel<<<grid_for(vectors / 32 + 1), kThreadsPerBlock, 0, stream>>>(seal);
  s.error = cudaGetLastError();
  return s;
}

LaunchStatus run_int8_decode(const Int8DecodeParams& p, uint64_t* sums, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (sums == nullptr) {
    s.rejected = "no body-sum words";
    return s;
  }
  const uint64_t blocks = int8_row_blocks(p.runs, p.num_runs, p.block_size);
  const uint64_t total = int8_row_payload_bytes(p.runs, p.num_runs, p.block_size);
  Int8CheckArgs c;
  c.payloads = p.payloads;
  c.n = p.num_payloads;
  c.total = total;
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
  if ((s.error = cudaGetLastError()) != cudaSuccess) return s;
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
    const unsigned gx = grid_for(run_blocks * static_cast<uint64_t>(p.num_payloads)) /
                            static_cast<unsigned>(p.num_payloads) +
                        1;
    s.error = by_dtype<LaunchDecode>(p.runs[r].dtype,
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
