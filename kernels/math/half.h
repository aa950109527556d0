// The dtype codes and 16-bit floats: fp16/bf16 conversions (round to nearest even), loads, stores.
#pragma once

#include "float_ops.h"

namespace gradcomp {
namespace math {

// dtype codes; gradcomp::DType has the same values (static_assert in types.h).
enum : uint8_t { kDtypeF32 = 0, kDtypeF16 = 1, kDtypeBF16 = 2 };

GRADCOMP_HD bool dtype_valid(uint8_t dtype) {
  return dtype <= kDtypeBF16;
}

GRADCOMP_HD uint32_t dtype_bytes(uint8_t dtype) {
  return dtype == kDtypeF32 ? 4u : 2u;
}

GRADCOMP_HD float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal half: value = man * 2^-24, exact in fp32.
    float v = mul_rn((float)man, 5.9604644775390625e-08f);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

GRADCOMP_HD uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) {  // Inf or NaN; NaN stays quiet NaN
    return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0u));
  }
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: overflow
  if (ax < 0x38800000u) {                                    // below the smallest normal half
    if (ax < 0x33000000u) return (uint16_t)sign;             // below half of smallest subnormal
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14..24 for this range
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return (uint16_t)(sign | r);
}

GRADCOMP_HD float bf16_to_float(uint16_t b) {
  return bits_float((uint32_t)b << 16);
}

GRADCOMP_HD uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  return (uint16_t)((x + 0x7FFFu + lsb) >> 16);
}

GRADCOMP_HD float load_as_float(const void* base, int64_t i, uint8_t dtype) {
  if (dtype == kDtypeF32) return static_cast<const float*>(base)[i];
  uint16_t v = static_cast<const uint16_t*>(base)[i];
  return dtype == kDtypeF16 ? half_to_float(v) : bf16_to_float(v);
}

// The exponent bits that are all set exactly in a NaN or an infinity of the dtype: a value is
// non-finite when (bits & mask) == mask, read as its own width (no conversion needed).
GRADCOMP_HD uint32_t nonfinite_exponent(uint8_t dtype) {
  return dtype == kDtypeF32 ? 0x7F800000u : (dtype == kDtypeF16 ? 0x7C00u : 0x7F80u);
}

GRADCOMP_HD bool element_finite(const void* base, int64_t i, uint8_t dtype) {
  const uint32_t mask = nonfinite_exponent(dtype);
  const uint32_t bits = dtype == kDtypeF32 ? static_cast<const uint32_t*>(base)[i]
                                           : static_cast<const uint16_t*>(base)[i];
  return (bits & mask) != mask;
}

GRADCOMP_HD void store_from_float(void* base, int64_t i, uint8_t dtype, float v) {
  if (dtype == kDtypeF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dtype == kDtypeF16 ? float_to_half(v) : float_to_bf16(v);
  }
}

// Rounds v to the given storage dtype and back, so callers can see what storing it keeps.
GRADCOMP_HD float round_to_dtype(float v, uint8_t dtype) {
  if (dtype == kDtypeF16) return half_to_float(float_to_half(v));
  if (dtype == kDtypeBF16) return bf16_to_float(float_to_bf16(v));
  return v;
}

}  // namespace math
}  // namespace gradcomp
