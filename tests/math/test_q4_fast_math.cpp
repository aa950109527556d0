// The v2 kernels' conversion-free q4 rules equal the reference rules for every input tried.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "test_util.h"

namespace gradcomp {
namespace {

using namespace math;

uint32_t bits_of(float f) {
  return float_bits(f);
}

TEST(Q4FastMath, RandomUnitEqualsTheConversionForEvery16BitValue) {
  for (uint32_t r = 0; r < 65536; ++r)
    ASSERT_EQ(bits_of(q4_random_unit(r)), bits_of(mul_rn((float)r, 1.0f / 65536.0f))) << r;
}

TEST(Q4FastMath, CodeValueAndNibbleEqualTheConversionsForEveryNibble) {
  for (uint32_t nib = 0; nib < 16; ++nib) {
    EXPECT_EQ(bits_of(q4_code_value(nib)), bits_of((float)((int)nib - 8))) << nib;
    const float step = 0.375f;
    EXPECT_EQ(bits_of(mul_rn(q4_code_value(nib), step)), bits_of(q4_dequantize(nib, step)));
  }
  for (int q = -7; q <= 7; ++q) EXPECT_EQ(q4_nibble_of((float)q), (uint32_t)(q + 8)) << q;
  EXPECT_EQ(q4_nibble_of(-0.0f), 8u);
}

// One comparison: the float code, its nibble and the residual it leaves all equal the
// reference's (the residual's sign of zero included).
void expect_same(float x, float step, uint32_t r16, bool stochastic) {
  const int q = q4_quantize(x, step, r16, stochastic);
  const float qf = q4_quantize_float(x, step, r16, stochastic);
  ASSERT_EQ(bits_of(qf), bits_of((float)q))
      << "x=" << x << " step=" << step << " r16=" << r16 << " sr=" << stochastic;
  ASSERT_EQ(q4_nibble_of(qf), (uint32_t)(q + 8));
  if (step > 0.0f) {
    ASSERT_EQ(bits_of(sub_rn(x, mul_rn(qf, step))), bits_of(sub_rn(x, mul_rn((float)q, step))))
        << "x=" << x << " step=" << step;
  }
}

// Steps as blocks produce them (q4_step_from_absmax_bits), from the smallest subnormal to the
// largest finite absmax, and x drawn across each block's range with the values where rounding
// turns: multiples of step / 2^16 and their neighbours, +-0, +-absmax.
TEST(Q4FastMath, QuantizeFloatEqualsTheReferenceAcrossStepsAndValues) {
  std::mt19937 gen(7);
  std::vector<uint32_t> absmaxes = {1u,          7u,          8u,          100u,
                                    0x00400000u, 0x00800000u, 0x3F800000u, 0x3F7FFFFFu,
                                    0x7F7FFFFFu, 0x7F000000u, 0x20000000u};
  for (int i = 0; i < 400; ++i) absmaxes.push_back(gen() % 0x7F800000u);
  long checked = 0;
  for (uint32_t am : absmaxes) {
    const float absmax = bits_float(am);
    const float step = q4_step_from_absmax_bits(am);
    ASSERT_GT(step, 0.0f);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float> xs = {0.0f, -0.0f, absmax, -absmax, step, -step};
    for (int i = 0; i < 600; ++i) xs.push_back(mul_rn(u(gen), absmax));
    for (int k = -7 * 65536; k <= 7 * 65536; k += 997) {
      const float x = mul_rn((float)k, mul_rn(step, 1.0f / 65536.0f));
      xs.push_back(x);
      xs.push_back(std::nextafter(x, std::numeric_limits<float>::infinity()));
      xs.push_back(std::nextafter(x, -std::numeric_limits<float>::infinity()));
    }
    for (float x : xs) {
      if (!(std::fabs(x) <= absmax)) continue;  // a block's values never exceed its absmax
      for (bool sr : {true, false}) {
        expect_same(x, step, gen() & 0xFFFFu, sr);
        expect_same(x, step, 0u, sr);
        expect_same(x, step, 0xFFFFu, sr);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000000);
}

// The rounding threshold itself: for every 16-bit bar, the values of t whose fraction sits just
// below, at and above it.
TEST(Q4FastMath, QuantizeFloatEqualsTheReferenceAtEveryStochasticThreshold) {
  const float step = 1.0f;  // t == x
  for (uint32_t r = 0; r < 65536; ++r) {
    const float bar = mul_rn((float)r, 1.0f / 65536.0f);
    for (float base : {-7.0f, -3.0f, -1.0f, 0.0f, 2.0f, 6.0f}) {
      const float t = add_rn(base, bar);
      for (float x : {t, std::nextafter(t, 8.0f), std::nextafter(t, -8.0f)})
        if (std::fabs(x) <= 7.0f) expect_same(x, step, r, true);
    }
  }
}

TEST(Q4FastMath, ZeroAndNonFiniteStepsGiveCodeZero) {
  for (float step : {0.0f, std::nanf("")}) {
    for (float x : {0.0f, -0.0f, 1.0f, -3.5f}) {
      EXPECT_EQ(bits_of(q4_quantize_float(x, step, 12345, true)), bits_of(0.0f));
      EXPECT_EQ(bits_of(q4_quantize_float(x, step, 0, false)), bits_of(0.0f));
    }
  }
}

}  // namespace
}  // namespace gradcomp
