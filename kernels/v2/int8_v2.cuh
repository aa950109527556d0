// What the int8 v2 kernels share (kernels/v2/int8_v2_encode_kernels.cu, int8_v2_kernels.cu): a
// run's arguments, a thread's place in the aligned layout, and the host's grid and dtype choice.
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
