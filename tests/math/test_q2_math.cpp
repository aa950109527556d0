// q2 element math: the step rule over many magnitudes, rounding on the code axis, exact bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

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

// ---- The v2 kernels' conversion-free rules (q2_math.h) equal the reference ----------------

TEST(Q2FastMath, CodeBitsAndValuesEqualTheConversionsForEveryCode) {
  for (uint32_t c = 0; c < 4; ++c) {
    EXPECT_EQ(float_bits(q2_code_value_of_bits(c)), float_bits(q2_code_value(c))) << c;
    EXPECT_EQ(q2_code_bits_of(static_cast<float>(c)), c);
    EXPECT_EQ(float_bits(q2_level_of(static_cast<float>(c))), float_bits(q2_code_value(c)));
  }
}

// One comparison: the float code, its bits and the residual it leaves equal the reference's (the
// residual's sign of zero included), from the quotient `t0` the kernel computed.
void expect_q2_same(float x, float step, float t0, uint32_t r16, bool sr, long* checked) {
  const uint32_t want = q2_quantize(x, step, r16, sr);
  const float c = q2_quantize_quotient(t0, step, r16, sr);
  ASSERT_EQ(float_bits(c), float_bits(static_cast<float>(want)))
      << "x=" << x << " step=" << step << " r16=" << r16 << " sr=" << sr;
  ASSERT_EQ(q2_code_bits_of(c), want);
  ASSERT_EQ(float_bits(sub_rn(x, mul_rn(q2_level_of(c), step))),
            float_bits(sub_rn(x, q2_dequantize(want, step))))
      << "x=" << x << " step=" << step;
  ++*checked;
}

// Blocks' steps (q2_step_from_absmax_bits, subnormal to the largest finite absmax) and x across
// each block's range where rounding turns: multiples of step / 2^16 and their neighbours, the
// levels and the midpoints between them, +-0, +-absmax, random bits below absmax.
std::vector<float> turning_values(float step, float absmax, std::mt19937& gen) {
  std::vector<float> xs = {0.0f, -0.0f, absmax, -absmax};
  for (int k = -3; k <= 3; ++k) xs.push_back(mul_rn(step, 0.5f * k));
  for (int i = 0; i < 200; ++i) {
    const float x = mul_rn(static_cast<float>(static_cast<int>(gen() % (3 * 65536)) - 98304),
                           mul_rn(step, 1.0f / 65536.0f));
    xs.push_back(x);
    xs.push_back(std::nextafter(x, 1e30f));
    xs.push_back(std::nextafter(x, -1e30f));
    xs.push_back(bits_float(gen() % (float_bits(absmax) + 1)) * ((i & 1) ? 1.0f : -1.0f));
  }
  std::vector<float> in;
  for (float x : xs)
    if (std::fabs(x) <= absmax) in.push_back(x);
  return in;
}

TEST(Q2FastMath, QuantizeFloatEqualsTheReferenceAcrossStepsAndValues) {
  std::mt19937 gen(5);
  std::vector<uint32_t> absmaxes = {1u,          3u,          0x10000u,        0x00400000u,
                                    0x00800000u, 0x3F800000u, 0x3F7FFFFFu,     0x7F7FFFFFu,
                                    0x7F000000u, 0x20000000u, float_bits(3.0f)};
  for (int i = 0; i < 400; ++i) absmaxes.push_back(gen() % 0x7F800000u);
  long checked = 0;
  for (uint32_t am : absmaxes) {
    const float absmax = bits_float(am);
    const float step = q2_step_from_absmax_bits(am);
    for (float x : turning_values(step, absmax, gen)) {
      expect_q2_same(x, step, div_rn(x, step), gen() & 0xFFFFu, true, &checked);
      expect_q2_same(x, step, div_rn(x, step), 0u, false, &checked);
      ASSERT_EQ(float_bits(q2_quantize_float(x, step, 7u, true)),
                float_bits(static_cast<float>(q2_quantize(x, step, 7u, true))));
    }
  }
  EXPECT_GT(checked, 300000);
}

TEST(Q2FastMath, QuantizeFloatEqualsTheReferenceForEvery16BitRandomWord) {
  long checked = 0;
  // Step 2: u = x / 2 + 1.5 across every code's interval, fractions where the bar turns.
  for (float x : {-2.9f, -2.0f, -1.5f, -0.5f, -1e-7f, 0.0f, 1e-7f, 0.3f, 1.0f, 1.7f, 2.999f})
    for (uint32_t r = 0; r < 65536; ++r)
      expect_q2_same(x, 2.0f, div_rn(x, 2.0f), r, true, &checked);
  EXPECT_EQ(checked, 11 * 65536);
}

TEST(Q2FastMath, ZeroAndNonFiniteStepsGiveTheFillCodeWhateverTheQuotient) {
  const float nan = bits_float(0x7FC00000u), inf = bits_float(0x7F800000u);
  for (float step : {0.0f, nan})
    for (float t0 : {0.0f, -0.0f, 1.0f, -5.0f, nan, inf, -inf})
      for (bool sr : {true, false})
        EXPECT_EQ(float_bits(q2_quantize_quotient(t0, step, 0xFFFFu, sr)),
                  float_bits(static_cast<float>(kQ2FillCode)));
}

// The encoder's division-free quotient (q4_math.h, a rule about the division) gives q2's codes and
// residuals from every reciprocal approximation the device may start from, over bf16 steps across
// the fast domain and the values where rounding turns.
TEST(Q2FastMath, FastQuotientGivesTheReferenceCodesAcrossTheDomain) {
  std::mt19937 gen(13);
  long checked = 0;
  for (int e = -100; e < 100; ++e) {
    for (uint32_t mant : {0u, 0x7F0000u, static_cast<uint32_t>(gen() & 0x7F0000u)}) {
      const float step = bits_float((static_cast<uint32_t>(e + 127) << 23) | mant);
      ASSERT_TRUE(q4_fast_step(step));
      const float absmax = mul_rn(step, 1.5f);
      const uint32_t rn = float_bits(div_rn(1.0f, step));
      for (float x : turning_values(step, absmax, gen)) {
        if (!q4_fast_dividends(q4_dividend_key(abs_bits(x)))) continue;
        const uint32_t r16 = gen() & 0xFFFFu;
        for (int k = -2; k <= 2; ++k) {
          const float y = q4_refine_reciprocal(step, bits_float(rn + static_cast<uint32_t>(k)));
          const float t0 = q4_fast_quotient(x, step, y);
          expect_q2_same(x, step, t0, r16, true, &checked);
          expect_q2_same(x, step, t0, 0u, false, &checked);
        }
      }
    }
  }
  EXPECT_GT(checked, 2000000);
}

}  // namespace
}  // namespace gradcomp
