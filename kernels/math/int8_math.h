// Block-scaled int8 element math (quantized weight all-gathers): block sizes, scales, rounding.
#pragma once

#include "half.h"

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

}  // namespace math
}  // namespace gradcomp
