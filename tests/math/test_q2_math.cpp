// q2 element math: the step rule over many magnitudes, rounding on the code axis, exact bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "params.h"

namespace gradcomp {
namespace {

using namespace math;

TEST(Q2Math, StepIsTheSmallestBf16WhoseTopLevelCoversTheAbsmax) {
  std::mt19937 gen(3);
  std::uniform_int_distribution<uint32_t> bits(1, 0x7F7FFFFFu);
  for (int i = 0; i < 2000000; ++i) {
    // Every tenth draw is a bf16 value times 1.5 or its neighbour: where rounding A / 1.5 bites.
    uint32_t a = bits(gen);
    if (i % 10 == 0) a = float_bits(bits_float(a & 0xFFFF0000u) * 1.5f) + (i % 3) - 1;
    if (a == 0 || a >= 0x7F800000u) continue;
    const float absmax = bits_float(a);
    const float d = q2_step_from_absmax_bits(a);
    const uint32_t db = float_bits(d);
    ASSERT_EQ(db & 0xFFFFu, 0u) << "step of " << absmax << " is not a bf16 value";
    ASSERT_GT(d, 0.0f);
    // The top level is exact (8 significant bits times 1.5) unless it overflows.
    const double top = 1.5 * static_cast<double>(d);
    ASSERT_GE(top, static_cast<double>(absmax)) << "absmax bits " << a;
    if (db > 0x10000u) {
      const double below = 1.5 * static_cast<double>(bits_float(db - 0x10000u));
      ASSERT_LT(below, static_cast<double>(absmax)) << "absmax bits " << a << " step too large";
    }
  }
  EXPECT_EQ(q2_step_from_absmax_bits(0), 0.0f);
  EXPECT_TRUE(std::isnan(q2_step_from_absmax_bits(0x7F800000u)));
  EXPECT_TRUE(std::isnan(q2_step_from_absmax_bits(0x7FC00000u)));
  EXPECT_EQ(q2_step_from_absmax_bits(float_bits(3.0f)), 2.0f);
  EXPECT_EQ(float_bits(q2_step_from_absmax_bits(float_bits(1.0f))), 0x3F2B0000u);
  EXPECT_EQ(float_bits(q2_step_from_absmax_bits(1u)), 0x10000u);  // the smallest subnormal
}

TEST(Q2Math, NearestRoundsToTheClosestLevelAndTiesAwayFromZero) {
  // Step 2: levels -3, -1, 1, 3 (codes 0..3).
  const float x[] = {3.0f, -3.0f, 1.0f, -1.0f, 0.0f, 2.0f, -2.0f, 0.5f, -0.5f, 2.9f, 4.0f, -4.0f};
  const uint32_t want[] = {3, 0, 2, 1, 2, 3, 0, 2, 1, 3, 3, 0};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(q2_quantize(x[i], 2.0f, 0, false), want[i]) << x[i];
  // Mirrored codes for x and -x (x != 0).
  for (float v = 0.01f; v < 3.0f; v += 0.01f)
    ASSERT_EQ(q2_quantize(v, 2.0f, 0, false), 3u - q2_quantize(-v, 2.0f, 0, false)) << v;
  EXPECT_EQ(q2_quantize(1.0f, 0.0f, 0, true), kQ2FillCode);
  EXPECT_EQ(q2_quantize(1.0f, bits_float(0x7FC00000u), 0, false), kQ2FillCode);
  for (uint32_t c = 0; c < 4; ++c) EXPECT_EQ(q2_dequantize(c, 2.0f), 2.0f * c - 3.0f);
  EXPECT_EQ(float_bits(q2_dequantize(kQ2FillCode, 0.0f)), 0u);  // +0 in an all-zero block
}

TEST(Q2Math, StochasticRoundsUpWithProbabilityTheFraction) {
  // x = -0.5 with step 2: u = 1.25, so codes 1 and 2 with probabilities 3/4 and 1/4.
  int up = 0;
  for (uint32_t r = 0; r < 65536; ++r) {
    const uint32_t c = q2_quantize(-0.5f, 2.0f, r, true);
    ASSERT_TRUE(c == 1 || c == 2);
    up += c == 2;
  }
  EXPECT_EQ(up, 16384);
  // A value on a level never moves, whatever the bits.
  for (uint32_t r = 0; r < 65536; r += 257) EXPECT_EQ(q2_quantize(1.0f, 2.0f, r, true), 2u);
}

TEST(Q2Math, CodesPackFourPerByteLowBitsFirst) {
  const uint8_t codes[] = {0x63, 0x8E};
  const uint32_t want[] = {3, 0, 2, 1, 2, 3, 0, 2};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(q2_code_at(codes, i), want[i]);
}

}  // namespace
}  // namespace gradcomp
