// What the weight v2 kernels share (int8_v2_*.cu, and int4_v2_*.cu for GCW4): a run's arguments,
// a thread's place in the aligned layout, the row seal and check, the host's grid and dtype choice.
#pragma once

#include "int8_params.h"
#include "v2/int8_v2_map.h"
#include "v2/launchers_v2.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace int8 {

inline constexpr int kInt8Warps = kThreadsPerBlock / 32;
// ~15 blocks per SM of an H200, as the payload checks.
inline constexpr uint64_t kInt8MaxCtas = 2048;

// One run of a row: where its elements, scales and codes are.
struct Int8RunArgs {
  const void* elements;  // encode: the run's input; decode: the run's bytes in row 0
  int64_t numel;
  uint32_t block_log2;
  uint64_t first_block;  // the run's first block in the row (its first scale)
  uint64_t codes_at;     // body offset of the run's first code: the codes section + row offset
  uint64_t row_offset;   // the run's first element in the row
};

// This thread's place in the aligned layout (int8_v2_map.h).
__device__ __forceinline__ ChunkMap chunk_map(uint32_t block_log2) {
  return ChunkMap(block_log2, threadIdx.x & 31,
                  static_cast<uint64_t>(blockIdx.x) * kInt8Warps + (threadIdx.x >> 5),
                  static_cast<uint64_t>(gridDim.x) * kInt8Warps);
}

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

// The row launches GCW8 and GCW4 share (they differ in magic, version and the codes section's
// size). The seal, after every run's encode: the header (or a flagged row's zeroed body), the
// sections' padding and the caller's report word; `scratch`: the encode's 2 words.
cudaError_t launch_row_seal(const Int8EncodeParams& p, uint64_t total, uint64_t codes_bytes,
                            uint32_t magic, uint16_t version, uint64_t* scratch,
                            cudaStream_t stream);
// The device check of p.num_payloads payloads of `total` bytes into p.verdicts, before any decode
// launch; `sums`: num_payloads + 1 zeroed words.
cudaError_t launch_row_check(const Int8DecodeParams& p, uint64_t total, uint32_t magic,
                             uint16_t version, uint64_t* sums, cudaStream_t stream);

__device__ __forceinline__ const uint8_t* payload_at(const uint8_t* const* payloads, int w) {
  return reinterpret_cast<const uint8_t*>(
      __ldg(reinterpret_cast<const unsigned long long*>(payloads) + w));
}

inline uint32_t log2_of(uint32_t pow2) {
  uint32_t l = 0;
  while ((1u << l) < pow2) ++l;
  return l;
}

// Whether a run takes the aligned kernels: its elements 16-byte aligned and its codes too (the
// codes section is; the run's codes start row_offset bytes into it, payloads are 16-byte aligned).
inline bool int8_run_aligned16(const void* elements, uint64_t row_offset) {
  return aligned16(elements) && row_offset % 16 == 0;
}

inline unsigned grid_for(uint64_t blocks) {
  const uint64_t ctas = (blocks + kInt8Warps - 1) / kInt8Warps;
  return static_cast<unsigned>(ctas < 1 ? 1 : (ctas > kInt8MaxCtas ? kInt8MaxCtas : ctas));
}

template <template <uint8_t, bool> class Launch, typename Args>
cudaError_t by_dtype(uint8_t dtype, bool aligned, dim3 grid, cudaStream_t stream,
                     const Args& args) {
  switch (dtype) {
    case math::kDtypeF32:
      return aligned ? Launch<math::kDtypeF32, true>::run(grid, stream, args)
                     : Launch<math::kDtypeF32, false>::run(grid, stream, args);
    case math::kDtypeF16:
      return aligned ? Launch<math::kDtypeF16, true>::run(grid, stream, args)
                     : Launch<math::kDtypeF16, false>::run(grid, stream, args);
    default:
      return aligned ? Launch<math::kDtypeBF16, true>::run(grid, stream, args)
                     : Launch<math::kDtypeBF16, false>::run(grid, stream, args);
  }
}

}  // namespace int8
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
