// q2 element math: the block-size rule, a block's bf16 step, stochastic or nearest rounding to
// four levels, packing four codes per byte, decoding.
#pragma once

#include "float_ops.h"
#include "q4_math.h"

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

// ---- The same rules without integer conversions or a division per element (the v2 kernels) --
// Each equals its counterpart above for every input (tests/math/test_q2_math.cpp), as q4's do:
// floorf and bit tricks instead of int<->float conversions, which run at a quarter of the float
// rate on the GPU. The quotient x / step comes from the caller: div_rn, or q4_fast_quotient
// where q4_fast_step and q4_fast_dividends allow (a rule about the division, not about q4).

// The code as a float in {0, 1, 2, 3} from the quotient t0 = x / step: kQ2FillCode for a block
// whose step is not > 0 (whatever t0 is), otherwise q2_quantize_positive_step's code. u >= 0, so
// floorf is the truncation the reference takes; -0 and +0 quotients give the same u.
GRADCOMP_HD float q2_quantize_quotient(float t0, float step, uint32_t rand16, bool stochastic) {
  const float u = fminf(fmaxf(add_rn(t0, kQ2Offset), 0.0f), 3.0f);
  const float fl = floorf(u);
  const float frac = sub_rn(u, fl);
  const float bar = stochastic ? q4_random_unit(rand16) : (fl >= 1.0f ? 0x1.fffffep-2f : 0.5f);
  const float c = fminf(add_rn(fl, bar < frac ? 1.0f : 0.0f), 3.0f);
  return step > 0.0f ? c : (float)kQ2FillCode;
}

GRADCOMP_HD float q2_quantize_float(float x, float step, uint32_t rand16, bool stochastic) {
  return q2_quantize_quotient(div_rn(x, step), step, rand16, stochastic);
}

// The 2 code bits of a code held as a float in {0, 1, 2, 3}: the low bits of 2^23 + code.
GRADCOMP_HD uint32_t q2_code_bits_of(float code) {
  return float_bits(add_rn(code, 8388608.0f)) & 3u;
}

// (code - 1.5), exactly, for a code held as a float (the encoder's residual).
GRADCOMP_HD float q2_level_of(float code) {
  return sub_rn(code, kQ2Offset);
}

// q2_code_value without a conversion: 2^22 has ulp 1/2, so 2^22 + code is its bits plus 2 code,
// and subtracting 2^22 + 1.5 leaves code - 1.5 exactly.
GRADCOMP_HD float q2_code_value_of_bits(uint32_t code) {
  return sub_rn(bits_float(0x4A800000u | (code << 1)), 4194305.5f);
}

// Element i of a packed run sits in byte i / 4, bits 2 (i % 4) and up.
GRADCOMP_HD uint32_t q2_code_at(const uint8_t* codes, uint64_t i) {
  return (uint32_t)(codes[i >> 2] >> (2 * (i & 3))) & 3u;
}

}  // namespace math
}  // namespace gradcomp
