// Element loads and stores of the host row codecs (int8, 4-bit weights), one dtype at a time, and
// the element-by-element decode both references share.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "int8_params.h"
#include "math/half.h"

namespace gradcomp {
namespace cpu {
namespace detail {

// A row of mixed dtypes need not keep its elements naturally aligned (a bf16 run of odd length
// before a float32 one, or rows of such a length side by side in FSDP's buffer): the host copies
// element bytes instead of dereferencing them as floats.
template <uint8_t kDtype>
inline float load_element(const uint8_t* at, int64_t i) {
  if (kDtype == math::kDtypeF32) {
    float v;
    std::memcpy(&v, at + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, at + 2 * i, 2);
  return kDtype == math::kDtypeF16 ? math::half_to_float(h) : math::bf16_to_float(h);
}

// v rounded once to the dtype (to nearest, ties to even) and stored.
template <uint8_t kDtype>
inline void store_element(uint8_t* at, int64_t i, float v) {
  if (kDtype == math::kDtypeF32) {
    std::memcpy(at + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = kDtype == math::kDtypeF16 ? math::float_to_half(v) : math::float_to_bf16(v);
  std::memcpy(at + 2 * i, &h, 2);
}

// The same with the dtype known only at run time (the element-by-element references).
inline float load_element(const uint8_t* at, int64_t i, uint8_t dtype) {
  if (dtype == math::kDtypeF32) return load_element<math::kDtypeF32>(at, i);
  if (dtype == math::kDtypeF16) return load_element<math::kDtypeF16>(at, i);
  return load_element<math::kDtypeBF16>(at, i);
}

inline void store_element(uint8_t* at, int64_t i, uint8_t dtype, float v) {
  if (dtype == math::kDtypeF32) return store_element<math::kDtypeF32>(at, i, v);
  if (dtype == math::kDtypeF16) return store_element<math::kDtypeF16>(at, i, v);
  store_element<math::kDtypeBF16>(at, i, v);
}

// A weight row's decode element by element (GCW8 and GCW4 lay out header, scales and codes alike
// and differ in how a code is stored): element k of the row, in block scale `scale`, is written
// as dequantize(codes, k, scale) rounded once to its run's dtype.
template <class Dequantize>
void decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                          uint32_t block_size, void* output, Dequantize dequantize) {
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const int64_t block = block_size;
  const uint8_t* scales = payload + kInt8HeaderBytes;
  const uint8_t* codes = scales + int8_align16(2 * blocks);
  auto* at = static_cast<uint8_t*>(output);
  uint64_t block_index = 0, k = 0;
  for (int r = 0; r < num_runs; ++r) {
    const uint8_t dt = runs[r].dtype;
    for (int64_t start = 0; start < runs[r].numel; start += block) {
      const int64_t end = std::min<int64_t>(start + block, runs[r].numel);
      uint16_t sbits;
      std::memcpy(&sbits, scales + 2 * block_index++, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i) store_element(at, i, dt, dequantize(codes, k++, scale));
    }
    at += runs[r].numel * math::dtype_bytes(dt);
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
