// Block-scaled int8 element math (quantized weight all-gathers): block sizes, scales, rounding.
#pragma once

#include "half.h"
#include "q4_math.h"

namespace gradcomp {
namespace math {

constexpr int kInt8MaxCode = 127;  // codes in [-127, 127]: symmetric, so -x decodes to -decode(x)
constexpr uint32_t kInt8MinBlock = 16, kInt8MaxBlock = 4096;

// A power of two in [16, 4096]: whole 16-byte code groups per block on the device.
GRADCOMP_HD bool int8_block_size_valid(uint32_t block) {
  return block >= kInt8MinBlock && block <= kInt8MaxBlock && (block & (block - 1)) == 0;
}

GRADCOMP_HD uint64_t int8_num_blocks(uint64_t numel, uint32_t block) {
  return (numel + block - 1) / block;
}

// bf16 bits of a finite x >= 0 rounded towards +infinity (a positive x never rounds to 0).
GRADCOMP_HD uint16_t bf16_bits_round_up(float x) {
  uint32_t b = float_bits(x);
  if ((b & 0xFFFFu) != 0) b += 0x10000u;  // carries into the exponent as the next bf16 up
  return (uint16_t)(b >> 16);
}

// The scale of a block from its largest |x| (finite; callers refuse non-finite blocks before):
// absmax / 127 in fp32, rounded up to bf16 so that absmax / scale stays within 127 and no code
// needs clamping. A block of zeros has scale 0; a tiny non-zero absmax whose quotient underflows
// to 0 gets the smallest bf16 subnormal instead, so its codes stay defined.
GRADCOMP_HD uint16_t int8_scale_bits(float absmax) {
  if (!(absmax > 0.0f)) return 0;
  const uint16_t s = bf16_bits_round_up(div_rn(absmax, (float)kInt8MaxCode));
  return s == 0 ? (uint16_t)1 : s;
}

// Code of x in a block of scale `scale` (bf16 value as float): x / scale rounded to nearest, ties
// to even (rintf under the default rounding mode on the host; rintf is round-half-even on the
// device). The clamp never fires for scales from int8_scale_bits; it keeps a foreign scale safe.
GRADCOMP_HD int int8_quantize(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float t = rintf(div_rn(x, scale));
  return t > 127.0f ? kInt8MaxCode : (t < -127.0f ? -kInt8MaxCode : (int)t);
}

// q * scale is exact in fp32 (8-bit code times an 8-bit-mantissa scale); the caller rounds it to
// the output dtype once (store_from_float).
GRADCOMP_HD float int8_dequantize(int q, float scale) {
  return mul_rn((float)q, scale);
}

// ---- The same rules without a division or a conversion per element (the v2 kernels) --------
// Each equals its counterpart above bit for bit (tests/math/test_int8_fast_math.cpp, over every
// code of the int8 range and its rounding turns).

// 1.5 * 2^23: adding it to a float in [-127, 127] leaves the value rounded to the nearest
// integer, ties to even, in the low mantissa bits (the ulp there is 1), as rintf does.
constexpr float kInt8RoundMagic = 12582912.0f;
constexpr uint32_t kInt8RoundMagicBits = 0x4B400000u;

// The code byte of int8_quantize(x, scale) from the quotient t0 = x / scale (div_rn's, or
// q4_fast_quotient's, whose -0 for +0 rounds alike): clamped first (the same codes, as rintf is
// monotone and the bounds are integers), then rounded by the magic addition; the low byte of the
// sum's bits is the code's two's complement. A block whose scale is not > 0 gets code 0.
GRADCOMP_HD uint8_t int8_code_byte(float t0, float scale) {
  const float t = fminf(fmaxf(t0, -127.0f), 127.0f);
  return scale > 0.0f ? (uint8_t)(float_bits(add_rn(t, kInt8RoundMagic)) & 0xFFu) : (uint8_t)0;
}

// int8_dequantize of a code byte: the code as a float from the bits of 1.5 * 2^23 + code, exact,
// times the scale.
GRADCOMP_HD float int8_dequantize_byte(uint8_t code, float scale) {
  const uint32_t sext = (uint32_t)(int32_t)(int8_t)code;
  return mul_rn(sub_rn(bits_float(kInt8RoundMagicBits + sext), kInt8RoundMagic), scale);
}

// Whether a block may take q4_fast_quotient: its scale and its smallest non-zero |x| in the
// domain proven there (scales from int8_scale_bits are > 0 for any block that is not all zeros).
GRADCOMP_HD bool int8_fast_block(float scale, uint32_t min_dividend_key) {
  return q4_fast_step(scale) && q4_fast_dividends(min_dividend_key);
}

}  // namespace math
}  // namespace gradcomp
