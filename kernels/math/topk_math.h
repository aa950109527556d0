// top-k element math: magnitude keys, the 11/11/9-bit radix passes, value rounding, sampling.
#pragma once

#include "float_ops.h"
#include "half.h"

namespace gradcomp {
namespace math {

// Largest bucket top-k accepts: indices are 32-bit within a bucket.
constexpr int64_t kTopKMaxNumel = (int64_t{1} << 31) - 1;

// Key monotone in |x| for every float; NaN orders above Inf so non-finite values are selected.
GRADCOMP_HD uint32_t topk_key(float x) {
  return abs_bits(x);
}

// Digits of the 31 key bits, most significant first: 11 + 11 + 9 bits.
constexpr int kTopKPasses = 3;
constexpr int kTopKMaxBins = 2048;
GRADCOMP_HD int topk_pass_shift(int pass) {
  return pass == 0 ? 20 : (pass == 1 ? 9 : 0);
}
GRADCOMP_HD int topk_pass_bins(int pass) {
  return pass == 2 ? 512 : kTopKMaxBins;
}
GRADCOMP_HD uint32_t topk_pass_mask_above(int pass) {
  // Bits of the key already fixed before `pass`.
  return pass == 0 ? 0u : (pass == 1 ? 0x7FF00000u : 0x7FFFFE00u);
}
GRADCOMP_HD uint32_t topk_digit(uint32_t key, int pass) {
  return (key >> topk_pass_shift(pass)) & (uint32_t)(topk_pass_bins(pass) - 1);
}

// Given a pass's histogram of candidate digits, picks the digit holding the remaining-th largest
// key. Returns the digit; *above receives how many candidates have a larger digit.
GRADCOMP_HD uint32_t topk_choose_digit(const uint32_t* hist, int bins, uint64_t remaining,
                                       uint64_t* above) {
  uint64_t acc = 0;
  for (int d = bins - 1; d >= 0; --d) {
    if (acc + hist[d] >= remaining) {
      *above = acc;
      return (uint32_t)d;
    }
    acc += hist[d];
  }
  *above = acc;
  return 0;
}

// Value stored for a selected element; fp16 saturates at its largest finite value so the excess
// stays in the residual instead of becoming Inf.
GRADCOMP_HD float topk_value_round(float acc, uint8_t value_dtype) {
  if (value_dtype == kDtypeF16 && is_finite_bits(float_bits(acc))) {
    acc = acc > 65504.0f ? 65504.0f : (acc < -65504.0f ? -65504.0f : acc);
  }
  return round_to_dtype(acc, value_dtype);
}

// Approximate mode: the threshold is the m-th largest key of an evenly strided sample.
constexpr int64_t kTopKSampleMax = 4096;
GRADCOMP_HD int64_t topk_sample_size(int64_t n) {
  return n < kTopKSampleMax ? n : kTopKSampleMax;
}
GRADCOMP_HD int64_t topk_sample_index(int64_t j, int64_t n, int64_t samples) {
  return j * n / samples;
}
GRADCOMP_HD int64_t topk_sample_rank(int64_t k, int64_t n, int64_t samples) {
  int64_t m = (k * samples + n - 1) / n;
  return m < 1 ? 1 : (m > samples ? samples : m);
}

// ---- DGC's remedies (docs/algorithms.md) ----------------------------------------------------

// Momentum correction: the velocity u = m * u + g, each step rounded on its own.
GRADCOMP_HD float topk_momentum(float u, float g, float m) {
  return add_rn(mul_rn(m, u), g);
}

// What an element of the accumulate step writes: the gradient scaled by the clip factor (when
// it is not 1), then with momentum > 0 the velocity m * u + g (u = 0 without a velocity).
GRADCOMP_HD float topk_accumulate_element(float g, float clip_factor, float momentum,
                                          const float* velocity_in, int64_t i) {
  const float x = clip_factor == 1.0f ? g : mul_rn(g, clip_factor);
  if (momentum == 0.0f) return x;
  return topk_momentum(velocity_in != nullptr ? velocity_in[i] : 0.0f, x, momentum);
}

// Local clipping sums squares in chunks of kTopKClipChunk elements, each chunk in index order,
// then the chunk sums in chunk order: an order a GPU can follow with one thread per chunk.
constexpr int64_t kTopKClipChunk = 4096;
GRADCOMP_HD int64_t topk_clip_chunks(int64_t numel) {
  return (numel + kTopKClipChunk - 1) / kTopKClipChunk;
}
GRADCOMP_HD float topk_clip_sum(float sum, float x) {
  return add_rn(sum, mul_rn(x, x));
}
// The factor a gradient of squared norm `sumsq` is multiplied by: min(1, threshold / norm).
GRADCOMP_HD float topk_clip_scale(float sumsq, float threshold) {
  const float norm = sqrt_rn(sumsq);
  return norm > threshold ? div_rn(threshold, norm) : 1.0f;
}

}  // namespace math
}  // namespace gradcomp
