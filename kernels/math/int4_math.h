// Block-scaled 4-bit element math (quantized weight all-gathers): scales, rounding, nibbles.
#pragma once

#include "half.h"
#include "int8_math.h"

namespace gradcomp {
namespace math {

// Codes in [-7, 7] (symmetric, so -x decodes to -decode(x)), stored as the nibble code + 8 as q4's
// are, two per byte, the even element in the low nibble.
constexpr int kInt4MaxCode = 7;

// The int8 rule: a power of two in [16, 4096], so every block but a run's last holds whole bytes.
GRADCOMP_HD bool int4_block_size_valid(uint32_t block) {
  return int8_block_size_valid(block);
}

// The scale of a block from its largest |x| (finite): absmax / 7 in fp32, rounded up to bf16 so
// that absmax / scale stays within 7 and no code needs clamping; 0 for a block of zeros, the
// smallest bf16 subnormal for a non-zero absmax whose quotient underflows (int8_scale_bits' rule).
GRADCOMP_HD uint16_t int4_scale_bits(float absmax) {
  if (!(absmax > 0.0f)) return 0;
  const uint16_t s = bf16_bits_round_up(div_rn(absmax, (float)kInt4MaxCode));
  return s == 0 ? (uint16_t)1 : s;
}

// Code of x in a block of scale `scale`: x / scale rounded to nearest, ties to even. The clamp
// never fires for scales from int4_scale_bits; it keeps a foreign scale safe.
GRADCOMP_HD int int4_quantize(float x, float scale) {
  if (!(scale > 0.0f)) return 0;
  const float t = rintf(div_rn(x, scale));
  return t > 7.0f ? kInt4MaxCode : (t < -7.0f ? -kInt4MaxCode : (int)t);
}

GRADCOMP_HD uint8_t int4_nibble(int code) {
  return (uint8_t)(code + 8);
}

// A nibble's code. Encoders never write nibble 0 (code -8); a decoder given one still writes a
// finite -8 * scale, inside its output.
GRADCOMP_HD int int4_code(uint32_t nibble) {
  return (int)(nibble & 0xFu) - 8;
}

// q * scale is exact in fp32 (a 4-bit code times an 8-bit-mantissa scale); the caller rounds it to
// the output dtype once (store_from_float).
GRADCOMP_HD float int4_dequantize(int code, float scale) {
  return mul_rn((float)code, scale);
}

// ---- The same rules without a division or a conversion per element (the v2 kernels) --------
// Each equals its counterpart above bit for bit (tests/codec/test_int4_v2_map.cpp, over every
// scale and code and their rounding turns).

// The nibble of int4_quantize(x, scale) from the quotient t0 = x / scale (div_rn's, or
// q4_fast_quotient's, whose -0 for +0 rounds alike): clamped first (the same codes, as rintf is
// monotone and the bounds are integers), then rounded by int8's magic addition, whose low four
// bits are the code's two's complement; xor 8 adds the bias. A block whose scale is not > 0 gets
// code 0.
GRADCOMP_HD uint32_t int4_nibble_of_quotient(float t0, float scale) {
  const float t = fminf(fmaxf(t0, -7.0f), 7.0f);
  const uint32_t low = (float_bits(add_rn(t, kInt8RoundMagic)) & 0xFu) ^ 8u;
  return scale > 0.0f ? low : 8u;
}

// int4_dequantize(int4_code(nibble), scale): the code as a float from the bits of
// 1.5 * 2^23 + nibble, exact, less the magic and the bias, times the scale.
GRADCOMP_HD float int4_dequantize_nibble(uint32_t nibble, float scale) {
  return mul_rn(sub_rn(bits_float(kInt8RoundMagicBits + (nibble & 0xFu)), kInt8RoundMagic + 8.0f),
                scale);
}

}  // namespace math
}  // namespace gradcomp
