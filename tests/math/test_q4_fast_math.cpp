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

// ---- The fast quotient (q4_fast_quotient) ----------------------------------------------------

// The reciprocal approximations the device may start from: the correctly rounded 1 / step and its
// neighbours up to 2 ulps away (rcp.approx is within 1).
std::vector<float> approximations(float step) {
  const uint32_t rn = float_bits(div_rn(1.0f, step));
  std::vector<float> v;
  for (int k = -2; k <= 2; ++k) v.push_back(bits_float(rn + static_cast<uint32_t>(k)));
  return v;
}

// For a pair in the fast domain: the quotient equals div_rn's (a zero's sign aside) and the code
// and residual q4_quantize_quotient forms from it equal the reference's, from every approximation.
void expect_fast_same(float x, float step, uint32_t r16, bool sr, long* checked) {
  ASSERT_TRUE(q4_fast_step(step));
  ASSERT_TRUE(q4_fast_dividends(q4_dividend_key(abs_bits(x))));
  const float exact = div_rn(x, step);
  const float ref = q4_quantize_float(x, step, r16, sr);
  for (float approx : approximations(step)) {
    const float t0 = q4_fast_quotient(x, step, q4_refine_reciprocal(step, approx));
    if (x == 0.0f)
      ASSERT_EQ(t0, 0.0f);
    else
      ASSERT_EQ(bits_of(t0), bits_of(exact)) << "x=" << x << " step=" << step;
    ASSERT_EQ(bits_of(q4_quantize_quotient(t0, step, r16, sr)), bits_of(ref))
        << "x=" << x << " step=" << step;
    ++*checked;
  }
}

// Steps as blocks produce them across the fast domain (every exponent from 2^-100 to 2^100, the
// mantissas at both ends and random ones), x across the block's range, at the rounding turns
// (multiples of step / 2^16 and their neighbours), with quotients down into the subnormals, and
// the domain's edges; a mutation of the correction (dropping the remainder term) fails it.
TEST(Q4FastMath, FastQuotientEqualsTheDivisionAcrossTheDomain) {
  std::mt19937 gen(11);
  long checked = 0;
  for (int e = -100; e < 100; ++e) {
    for (int m = 0; m < 24; ++m) {
      uint32_t mant = (gen() & 0x7FFFFFu) & ~7u;
      if (m == 0) mant = 0;
      if (m == 1) mant = 0x7FFFF8u;
      const float step = bits_float((static_cast<uint32_t>(e + 127) << 23) | mant);
      const float absmax = mul_rn(step, 7.0f);
      std::vector<float> xs = {0.0f, -0.0f, step, -step, absmax, -absmax};
      for (int i = 0; i < 60; ++i) {
        const uint32_t lo = kQ4FastDividendMinBits, hi = float_bits(absmax);
        xs.push_back(bits_float(lo + gen() % (hi - lo + 1)));
        const float x =
            mul_rn((float)((int)(gen() % (14 * 65536)) - 7 * 65536), mul_rn(step, 1.0f / 65536.0f));
        xs.push_back(x);
        xs.push_back(std::nextafter(x, 1e30f));
        xs.push_back(std::nextafter(x, -1e30f));
        // a quotient of 2^-100 .. 2^-159: subnormal and underflowing results
        const float tiny =
            std::ldexp(1.0f + (gen() & 0x7FFFFF) / 8388608.0f, -100 - static_cast<int>(gen() % 60));
        xs.push_back(mul_rn(tiny, step));
      }
      for (float x : xs) {
        if (!(std::fabs(x) <= absmax) || !q4_fast_dividends(q4_dividend_key(abs_bits(x)))) continue;
        for (float sx : {x, -x}) {
          expect_fast_same(sx, step, gen() & 0xFFFFu, true, &checked);
          expect_fast_same(sx, step, 0u, false, &checked);
        }
      }
    }
  }
  EXPECT_GT(checked, 5000000);
}

TEST(Q4FastMath, FastDomainEdges) {
  EXPECT_TRUE(q4_fast_step(0.0f));
  EXPECT_TRUE(q4_fast_step(std::nanf("")));
  EXPECT_TRUE(q4_fast_step(std::ldexp(1.0f, -100)));
  EXPECT_FALSE(q4_fast_step(std::nextafter(std::ldexp(1.0f, -100), 0.0f)));
  EXPECT_FALSE(q4_fast_step(std::ldexp(1.0f, 100)));
  EXPECT_TRUE(q4_fast_step(std::nextafter(std::ldexp(1.0f, 100), 0.0f)));
  EXPECT_TRUE(q4_fast_dividends(q4_dividend_key(0u)));
  EXPECT_TRUE(q4_fast_dividends(q4_dividend_key(kQ4FastDividendMinBits)));
  EXPECT_FALSE(q4_fast_dividends(q4_dividend_key(kQ4FastDividendMinBits - 1)));
  EXPECT_FALSE(q4_fast_dividends(q4_dividend_key(1u)));
  // Outside the domain the fast quotient does differ: the reason it has one.
  const float step = std::ldexp(1.5f, -126), x = std::ldexp(-1.7f, -127);
  bool differs = false;
  for (float approx : approximations(step))
    differs |= float_bits(q4_fast_quotient(x, step, q4_refine_reciprocal(step, approx))) !=
               float_bits(div_rn(x, step));
  EXPECT_TRUE(differs);
}

}  // namespace
}  // namespace gradcomp
