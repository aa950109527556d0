// The v2 kernels' division- and conversion-free int8 rules equal int8_math.h's reference rules.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "math/int8_math.h"

namespace gradcomp {
namespace {

using namespace math;

// The reference code byte: int8_quantize's integer as the byte the payload holds.
uint8_t reference_byte(float x, float scale) {
  return static_cast<uint8_t>(static_cast<int8_t>(int8_quantize(x, scale)));
}

// The kernels' code byte: the fast quotient from every reciprocal approximation the device may
// start from (rcp.approx is within 1 ulp; 2 tried) when the block is in the fast domain, else
// the division, then the magic rounding.
void expect_same(float x, float scale, uint32_t min_key, long* checked) {
  const uint8_t ref = reference_byte(x, scale);
  if (int8_fast_block(scale, min_key)) {
    const uint32_t rn = float_bits(div_rn(1.0f, scale));
    for (int k = -2; k <= 2; ++k) {
      const float y = q4_refine_reciprocal(scale, bits_float(rn + static_cast<uint32_t>(k)));
      ASSERT_EQ(int8_code_byte(q4_fast_quotient(x, scale, y), scale), ref)
          << "x=" << x << " scale=" << scale << " approx " << k;
    }
  }
  ASSERT_EQ(int8_code_byte(div_rn(x, scale), scale), ref) << "x=" << x << " scale=" << scale;
  ++*checked;
}

// Every bf16 scale int8_scale_bits can produce (every exponent, every mantissa), and for each
// every code of the int8 range: the value k * scale, the ties (k + 1/2) * scale, and their fp32
// neighbours, both signs; a mutation of the rounding (ties away, or truncation) or of the
// correction step of the quotient fails it.
TEST(Int8FastMath, CodeByteEqualsTheReferenceForEveryScaleAndEveryCode) {
  long checked = 0;
  std::mt19937 gen(3);
  for (uint32_t sbits = 1; sbits < 0x7F80u; sbits += (sbits < 0x0100u || sbits > 0x7E00u) ? 1 : 3) {
    const float scale = bf16_to_float(static_cast<uint16_t>(sbits));
    const float absmax = mul_rn(scale, 127.0f);
    for (int k = 0; k <= 127; k += (k < 4 || k > 120) ? 1 : 1 + static_cast<int>(gen() % 9)) {
      for (float base :
           {mul_rn(static_cast<float>(k), scale), mul_rn(static_cast<float>(k) + 0.5f, scale)}) {
        for (float x : {base, std::nextafter(base, 0.0f), std::nextafter(base, 1e38f)}) {
          if (!(x <= absmax) || !std::isfinite(x)) continue;
          const uint32_t key = q4_dividend_key(abs_bits(x));
          expect_same(x, scale, key, &checked);
          expect_same(-x, scale, key, &checked);
        }
      }
    }
  }
  EXPECT_GT(checked, 2000000);
}

// Rows as the encoder sees them: random blocks, the scale from their absmax, every element.
TEST(Int8FastMath, CodeByteEqualsTheReferenceOnRandomBlocks) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  long checked = 0;
  for (int b = 0; b < 20000; ++b) {
    const int e = static_cast<int>(gen() % 220) - 110;
    std::vector<float> xs(64);
    float absmax = 0.0f;
    uint32_t min_key = 0xFFFFFFFFu;
    for (float& x : xs) {
      x = std::ldexp(mant(gen), e - static_cast<int>(gen() % 30));
      absmax = std::fmax(absmax, std::fabs(x));
      min_key = std::min(min_key, q4_dividend_key(abs_bits(x)));
    }
    const float scale = bf16_to_float(int8_scale_bits(absmax));
    for (float x : xs) expect_same(x, scale, min_key, &checked);
  }
  EXPECT_GT(checked, 1000000);
}

TEST(Int8FastMath, TiesRoundToEvenAndZeroScalesGiveCodeZero) {
  const float s = bf16_to_float(0x3C02);
  EXPECT_EQ(int8_code_byte(2.5f, s), 2);
  EXPECT_EQ(int8_code_byte(3.5f, s), 4);
  EXPECT_EQ(int8_code_byte(-2.5f, s), 0xFE);
  EXPECT_EQ(int8_code_byte(-0.0f, s), 0);
  EXPECT_EQ(int8_code_byte(500.0f, s), 127);
  EXPECT_EQ(int8_code_byte(-500.0f, s), 0x81);
  EXPECT_EQ(int8_code_byte(3.0f, 0.0f), 0);
}

TEST(Int8FastMath, DequantizeByteEqualsTheReferenceForEveryCode) {
  for (uint32_t sbits = 0; sbits < 0x7F80u; sbits += 7) {
    const float scale = bf16_to_float(static_cast<uint16_t>(sbits));
    for (int c = -128; c <= 127; ++c) {
      const uint8_t byte = static_cast<uint8_t>(static_cast<int8_t>(c));
      ASSERT_EQ(float_bits(int8_dequantize_byte(byte, scale)),
                float_bits(int8_dequantize(c, scale)))
          << c << " " << scale;
    }
  }
}

}  // namespace
}  // namespace gradcomp
