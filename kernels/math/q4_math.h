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

}  // namespace math
}  // namespace gradcomp
