// Element math: Philox known answers, 16-bit conversions, q4 step and rounding rules.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_util.h"

namespace gradcomp {
namespace {

using namespace math;

TEST(Philox, MatchesRandom123KnownAnswers) {
  Philox4 a = philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(a.v[0], 0x6627e8d5u);
  EXPECT_EQ(a.v[1], 0xe169c58du);
  EXPECT_EQ(a.v[2], 0xbc57ac4cu);
  EXPECT_EQ(a.v[3], 0x9b00dbd8u);
  Philox4 b = philox4x32_10(~0u, ~0u, ~0u, ~0u, ~0u, ~0u);
  EXPECT_EQ(b.v[0], 0x408f276du);
  EXPECT_EQ(b.v[1], 0x41c83b0eu);
  EXPECT_EQ(b.v[2], 0xa20bc7c6u);
  EXPECT_EQ(b.v[3], 0x6d5451fdu);
  Philox4 c =
      philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(c.v[0], 0xd16cfe09u);
  EXPECT_EQ(c.v[1], 0x94fdccebu);
  EXPECT_EQ(c.v[2], 0x5001e420u);
  EXPECT_EQ(c.v[3], 0x24126ea1u);
}

TEST(Philox, KeyFieldsChangeTheStream) {
  RngKey base{42, 3, 7, 1, 0};
  Philox4 r0 = random_group(base, 5);
  for (int field = 0; field < 5; ++field) {
    RngKey k = base;
    if (field == 0) k.seed ^= 1ull << 40;
    if (field == 1) k.step += 1;
    if (field == 2) k.bucket += 1;
    if (field == 3) k.rank += 1;
    if (field == 4) k.phase += 1;
    Philox4 r = random_group(k, 5);
    EXPECT_NE(std::memcmp(&r, &r0, sizeof r), 0) << "field " << field;
  }
  Philox4 other = random_group(base, 6);
  EXPECT_NE(std::memcmp(&other, &r0, sizeof r0), 0);
}

TEST(HalfConversion, AllHalvesRoundTripThroughFloat) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = half_to_float(static_cast<uint16_t>(h));
    const bool nan = ((h >> 10) & 0x1F) == 0x1F && (h & 0x3FF) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f))));
    } else {
      EXPECT_EQ(float_to_half(f), h) << std::hex << h;
      EXPECT_EQ(static_cast<float>(static_cast<_Float16>(f)), f);
    }
  }
}

TEST(HalfConversion, RoundsToNearestEvenLikeTheCompiler) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = bits(gen);
    float f = bits_float(u);
    if (std::isnan(f)) continue;
    _Float16 ref = static_cast<_Float16>(f);
    uint16_t ref_bits;
    std::memcpy(&ref_bits, &ref, 2);
    ASSERT_EQ(float_to_half(f), ref_bits) << std::hexfloat << f;
  }
}

TEST(BFloat16Conversion, RoundsToNearestEvenAndKeepsNaN) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808000u)), 0x3F80);  // tie to even (down)
  EXPECT_EQ(float_to_bf16(bits_float(0x3F818000u)), 0x3F82);  // tie to even (up)
  EXPECT_EQ(float_to_bf16(bits_float(0x3F808001u)), 0x3F81);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to Inf
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_TRUE(
      std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));  // NaN never becomes Inf
  EXPECT_EQ(float_to_bf16(bits_float(0x00000001u)), 0x0000);
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = bf16_to_float(static_cast<uint16_t>(b));
    if (!std::isnan(f)) EXPECT_EQ(float_to_bf16(f), b);
  }
}

TEST(Q4Step, HasFewSignificantBitsAndCoversTheBlock) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<uint32_t> bits(1, 0x7F7FFFFFu);
  for (int i = 0; i < 100000; ++i) {
    uint32_t absmax = bits(gen);
    float step = q4_step_from_absmax_bits(absmax);
    ASSERT_GT(step, 0.0f);
    ASSERT_EQ(float_bits(step) & 7u, 0u);
    // 7 * step is exact and covers the block up to rounding of the division.
    double covered = 7.0 * static_cast<double>(step);
    double s = static_cast<double>(bits_float(absmax));
    ASSERT_GE(covered, s * (1.0 - 1e-6) - 1e-44);
    ASSERT_LE(covered, s * (1.0 + 1e-5) + 1e-43);  // denormal steps round up by up to 8 units
    for (int q = -7; q <= 7; ++q) {
      ASSERT_EQ(static_cast<double>(q4_dequantize(q + 8, step)), q * static_cast<double>(step));
    }
  }
  EXPECT_EQ(q4_step_from_absmax_bits(0), 0.0f);
  EXPECT_TRUE(std::isnan(q4_step_from_absmax_bits(0x7F800000u)));
  EXPECT_TRUE(std::isnan(q4_step_from_absmax_bits(0x7FC00000u)));
  EXPECT_GT(q4_step_from_absmax_bits(1u), 0.0f);  // smallest denormal still gets a step
}

TEST(Q4Quantize, NearestAndStochasticRules) {
  const float d = 0.5f;
  EXPECT_EQ(q4_quantize(1.0f, d, 0, false), 2);
  EXPECT_EQ(q4_quantize(0.25f, d, 0, false), 0);  // tie to even
  EXPECT_EQ(q4_quantize(0.75f, d, 0, false), 2);  // tie to even
  EXPECT_EQ(q4_quantize(-3.5f, d, 0, false), -7);
  EXPECT_EQ(q4_quantize(10.0f, d, 0, false), 7);  // clamped
  // Stochastic: t = 0.25 rounds up iff u < 0.25.
  EXPECT_EQ(q4_quantize(0.125f, d, 16383, true), 1);
  EXPECT_EQ(q4_quantize(0.125f, d, 16384, true), 0);
  EXPECT_EQ(q4_quantize(-0.125f, d, 49151, true), 0);  // t = -0.25: floor -1, frac 0.75
  EXPECT_EQ(q4_quantize(-0.125f, d, 49152, true), -1);
  EXPECT_EQ(q4_quantize(1.0f, d, 0, true), 2);  // on the grid: never moves
  EXPECT_EQ(q4_quantize(1.0f, d, 65535, true), 2);
  EXPECT_EQ(q4_quantize(1.0f, 0.0f, 0, true), 0);
}

TEST(TopKDigits, PassesCoverAllKeyBits) {
  uint32_t covered = 0;
  for (int pass = 0; pass < kTopKPasses; ++pass) {
    uint32_t mask = static_cast<uint32_t>(topk_pass_bins(pass) - 1) << topk_pass_shift(pass);
    EXPECT_EQ(covered & mask, 0u);
    covered |= mask;
    EXPECT_EQ(topk_pass_mask_above(pass), covered & ~mask);
  }
  EXPECT_EQ(covered, 0x7FFFFFFFu);
  EXPECT_GT(topk_key(std::nanf("")), topk_key(std::numeric_limits<float>::infinity()));
  EXPECT_EQ(topk_key(-2.0f), topk_key(2.0f));
  EXPECT_GT(topk_key(-3.0f), topk_key(2.5f));
}

}  // namespace
}  // namespace gradcomp
