// q2 element math: the block-size rule, a block's bf16 step, stochastic or nearest rounding to
// four levels, packing four codes per byte, decoding.
#pragma once

#include "float_ops.h"

namespace gradcomp {
namespace math {

// Codes c in {0, 1, 2, 3} stand for the levels (c - 1.5) * d: {-1.5, -0.5, 0.5, 1.5} * d, four
// symmetric levels with no zero (docs/algorithms.md says why not ternary).
constexpr int kQ2MaxCode = 3;
constexpr float kQ2Offset = 1.5f;
// The code of blocks whose step is not > 0 (all zeros, or non-finite): level +d/2, which is +0
// in an all-zero block, as q4's zero code decodes.
constexpr uint32_t kQ2FillCode = 2;
constexpr uint32_t kQ2MinBlock = 16, kQ2MaxBlock = 256;

// The one rule for q2 block sizes: a power of two in [16, 256], as q4's (whole random groups,
// whole code bytes per block).
GRADCOMP_HD bool q2_block_size_valid(uint32_t block) {
  return block >= kQ2MinBlock && block <= kQ2MaxBlock && (block & (block - 1)) == 0;
}

GRADCOMP_HD uint64_t q2_num_blocks(uint64_t numel, uint32_t block) {
  return (numel + block - 1) / block;
}

GRADCOMP_HD uint64_t q2_code_bytes(uint64_t numel) {
  return (numel + 3) / 4;
}

// The step d of a block from the bit pattern of its largest |x| A: the smallest bfloat16 value
// with 1.5 d >= A (A / 1.5 rounded up to 8 significant bits), so the top level covers A and the
// scale travels in 16 bits without rounding. d has 8 significant bits, so (c - 1.5) d is exact
// for every code. Rounding A / 1.5 first cannot lose a bf16 value g below A / 1.5: 1.5 g is a
// float, so A > 1.5 g means A - 1.5 g >= ulp(g) and A / 1.5 lies over half an ulp above g
// (tests/math/test_q2_math.cpp checks the rule on 2 million magnitudes). A non-finite block gets
// NaN (every rank's decode then flags it), an all-zero block 0.
GRADCOMP_HD float q2_step_from_absmax_bits(uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return bits_float(0x7FC00000u);
  if (absmax_bits == 0) return 0.0f;
  return bits_float((float_bits(div_rn(bits_float(absmax_bits), kQ2Offset)) + 0xFFFFu) &
                    0xFFFF0000u);
}

// The 16 bits a step travels as (its top half: the step is a bfloat16 value), and back.
GRADCOMP_HD uint16_t q2_scale_bits(float step) {
  return (uint16_t)(float_bits(step) >> 16);
}
GRADCOMP_HD float q2_step_of_scale(uint16_t scale) {
  return bits_float((uint32_t)scale << 16);
}

// Code in {0, 1, 2, 3} for x in a block of step `step` > 0. u = x / step + 1.5 places x on the
// code axis; stochastic rounding rounds up with probability frac(u) (to 2^-16), so
// E[(c - 1.5) step] = x. Nearest rounding sends ties away from zero (c = 2 for x = 0), so x and
// -x get mirrored codes. floor uses a truncating conversion, exact for u in [0, 3].
GRADCOMP_HD uint32_t q2_quantize_positive_step(float x, float step, uint32_t rand16,
                                               bool stochastic) {
  const float u0 = add_rn(div_rn(x, step), kQ2Offset);
  const float u = u0 > 3.0f ? 3.0f : (u0 < 0.0f ? 0.0f : u0);
  const float fl = (float)(int)u;
  const float frac = sub_rn(u, fl);
  const int c = (int)fl;
  const float bar =
      stochastic ? mul_rn((float)rand16, 1.0f / 65536.0f) : (c >= 1 ? 0x1.fffffep-2f : 0.5f);
  const int r = c + (int)(bar < frac);
  return (uint32_t)(r > kQ2MaxCode ? kQ2MaxCode : r);
}

GRADCOMP_HD uint32_t q2_quantize(float x, float step, uint32_t rand16, bool stochastic) {
  if (!(step > 0.0f)) return kQ2FillCode;
  return q2_quantize_positive_step(x, step, rand16, stochastic);
}

// (c - 1.5) as a float, exactly.
GRADCOMP_HD float q2_code_value(uint32_t code) {
  return sub_rn((float)code, kQ2Offset);
}

GRADCOMP_HD float q2_dequantize(uint32_t code, float step) {
  return mul_rn(q2_code_value(code), step);
}

// Element i of a packed run sits in byte i / 4, bits 2 (i % 4) and up.
GRADCOMP_HD uint32_t q2_code_at(const uint8_t* codes, uint64_t i) {
  return (uint32_t)(codes[i >> 2] >> (2 * (i & 3))) & 3u;
}

}  // namespace math
}  // namespace gradcomp
