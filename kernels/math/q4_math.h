// q4 element math: the block-size rule, a block's step, stochastic or nearest rounding, decoding.
#pragma once

#include "float_ops.h"

namespace gradcomp {
namespace math {

constexpr int kQ4MaxCode = 7;  // codes q in [-7, 7], stored as nibble q + 8
constexpr uint8_t kQ4ZeroNibble = 8;
constexpr uint32_t kQ4MinBlock = 16, kQ4MaxBlock = 256;

// The one rule for q4 block sizes: a power of two in [16, 256] (whole random groups, and a block
// is at most one warp of 8-element lanes).
GRADCOMP_HD bool q4_block_size_valid(uint32_t block) {
  return block >= kQ4MinBlock && block <= kQ4MaxBlock && (block & (block - 1)) == 0;
}

GRADCOMP_HD uint64_t q4_num_blocks(uint64_t numel, uint32_t block) {
  return (numel + block - 1) / block;
}

// Step d of a block from the bit pattern of its largest |x| (integer max over abs bits orders
// finite values, then Inf, then NaN, so a non-finite element always wins). d has at most 21
// significant bits, so q * d is exact for every code and a value on the grid round-trips.
GRADCOMP_HD float q4_step_from_absmax_bits(uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return bits_float(0x7FC00000u);
  if (absmax_bits == 0) return 0.0f;
  uint32_t d = float_bits(div_rn(bits_float(absmax_bits), (float)kQ4MaxCode));
  d = (d == 0) ? 8u : ((d + 7u) & ~7u);
  return bits_float(d);
}

// Code in [-7, 7] for x in a block of step `step` > 0 (callers give 0 for other blocks).
// Stochastic rounding rounds up with probability frac(x / step) (to 2^-16), so E[q * step] = x.
// Written without short-circuit operators so the CPU loop vectorizes; floor uses a truncating
// conversion, exact for |t| <= 7.
GRADCOMP_HD int q4_quantize_positive_step(float x, float step, uint32_t rand16, bool stochastic) {
  const float t0 = div_rn(x, step);
  const float t = t0 > 7.0f ? 7.0f : (t0 < -7.0f ? -7.0f : t0);
  const float tr = (float)(int)t;
  const float fl = tr > t ? sub_rn(tr, 1.0f) : tr;
  const float frac = sub_rn(t, fl);
  const int q = (int)fl;
  const float bar =
      stochastic ? mul_rn((float)rand16, 1.0f / 65536.0f) : ((q & 1) ? 0x1.fffffep-2f : 0.5f);
  const int up = (int)(bar < frac);
  const int r = q + up;
  return r > kQ4MaxCode ? kQ4MaxCode : r;
}

GRADCOMP_HD int q4_quantize(float x, float step, uint32_t rand16, bool stochastic) {
  if (!(step > 0.0f)) return 0;  // all-zero block, or non-finite block (step is NaN)
  return q4_quantize_positive_step(x, step, rand16, stochastic);
}

GRADCOMP_HD float q4_dequantize(uint32_t nibble, float step) {
  return mul_rn((float)((int)nibble - 8), step);
}

// ---- The same rules without integer conversions (the v2 kernels) ---------------------------
// Each equals its counterpart above for every input (tests/math/test_q4_fast_math.cpp); they
// trade int<->float conversions, which run at a quarter of the float rate on the GPU, for exact
// float and bit operations.

// rand16 * 2^-16, exactly: the 16 bits become the top of a mantissa of 1.0.
GRADCOMP_HD float q4_random_unit(uint32_t rand16) {
  return sub_rn(bits_float(0x3F800000u | (rand16 << 7)), 1.0f);
}

// nibble - 8 as a float, exactly: 2^23 + nibble has the nibble in its low mantissa bits.
GRADCOMP_HD float q4_code_value(uint32_t nibble) {
  return sub_rn(bits_float(0x4B000000u | nibble), 8388616.0f);
}

// The nibble (code + 8) of a code held as a float in [-7, 7], from the bits of 2^23 + 8 + code.
GRADCOMP_HD uint32_t q4_nibble_of(float code) {
  return float_bits(add_rn(code, 8388616.0f)) & 0xFu;
}

// q4_quantize as a float code, from the quotient t0 = x / step: +0 for a block whose step is not
// > 0 (whatever t0 is), otherwise the code of x. floorf is exact; the clamp has no NaN to meet (x
// is finite and step > 0 here); the code is formed as floor + 0 or 1, so a code of zero is +0
// whatever the sign of t0, as (float)0 is.
GRADCOMP_HD float q4_quantize_quotient(float t0, float step, uint32_t rand16, bool stochastic) {
  const float t = fminf(fmaxf(t0, -7.0f), 7.0f);
  const float fl = floorf(t);
  const float frac = sub_rn(t, fl);
  const float odd_bar = (q4_nibble_of(fl) & 1u) ? 0x1.fffffep-2f : 0.5f;
  const float bar = stochastic ? q4_random_unit(rand16) : odd_bar;
  const float q = fminf(add_rn(fl, bar < frac ? 1.0f : 0.0f), 7.0f);
  return step > 0.0f ? q : 0.0f;
}

GRADCOMP_HD float q4_quantize_float(float x, float step, uint32_t rand16, bool stochastic) {
  return q4_quantize_quotient(div_rn(x, step), step, rand16, stochastic);
}

// ---- Division by a block's step without a division per element (the v2 encoder) -----------
// y is the step's reciprocal, refined once per block from an approximation within 2 ulps (the
// GPU's rcp.approx is within 1); then x / step takes three roundings: q = x y, the remainder
// x - q step exact in one fma, q + r y. In the domain below this equals div_rn(x, step) bit for
// bit except that x = -0 gives +0, which q4_quantize_quotient cannot tell apart: proven on the
// host over ~10^9 pairs and every approximation error (tests/math/test_q4_fast_math.cpp).
// Outside it (tiny or huge steps, dividends below 2^-100) the encoder divides.
constexpr uint32_t kQ4FastStepMinBits = 27u << 23;   // 2^-100
constexpr uint32_t kQ4FastStepMaxBits = 227u << 23;  // 2^100 (exclusive)
constexpr uint32_t kQ4FastDividendMinBits = 27u << 23;

// Whether a block may use the fast quotient: a step in [2^-100, 2^100), or a step that is not > 0
// (zero and non-finite blocks quantize to 0 whatever the quotient).
GRADCOMP_HD bool q4_fast_step(float step) {
  const uint32_t b = float_bits(step);
  return !(step > 0.0f) || (b >= kQ4FastStepMinBits && b < kQ4FastStepMaxBits);
}
// Whether a dividend |x| (as abs bits) may: zero, or at least 2^-100. Takes the minimum of
// abs_bits - 1 over a lane (unsigned: zero wraps to the top) and compares once.
GRADCOMP_HD uint32_t q4_dividend_key(uint32_t abs_bits) {
  return abs_bits - 1u;
}
GRADCOMP_HD bool q4_fast_dividends(uint32_t min_key) {
  return min_key >= kQ4FastDividendMinBits - 1u;
}

GRADCOMP_HD float q4_refine_reciprocal(float step, float approx) {
  return fma_rn(approx, fma_rn(-step, approx, 1.0f), approx);
}
GRADCOMP_HD float q4_fast_quotient(float x, float step, float y) {
  const float q = mul_rn(x, y);
  return fma_rn(fma_rn(-q, step, x), y, q);
}

}  // namespace math
}  // namespace gradcomp
