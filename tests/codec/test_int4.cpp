// Block-scaled 4-bit weights (GCW4): element math and the row payload, byte exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gradcomp/cpu.h"
#include "int4_params.h"
#include "math/int4_math.h"
#include "small_weight_row.h"

namespace gradcomp {
namespace {

float bf16(uint16_t bits) {
  return math::bf16_to_float(bits);
}

TEST(Int4Math, ScaleIsAbsmaxOver7RoundedUpToBf16) {
  // 1 / 7 = 0x3E124925 in fp32: rounding down (or to nearest) would give 0x3E12.
  EXPECT_EQ(math::int4_scale_bits(1.0f), 0x3E13);
  EXPECT_EQ(math::int4_scale_bits(3.0f), 0x3EDC);
  EXPECT_EQ(math::int4_scale_bits(0.0f), 0);
  EXPECT_EQ(math::int4_scale_bits(7.0f), 0x3F80);  // exactly 1: nothing to round
  EXPECT_EQ(math::int4_scale_bits(1e-45f), 1);     // the quotient underflows: smallest subnormal
}

TEST(Int4Math, CodesStayWithin7AndRoundToNearestTiesToEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-40, 40);
  for (int i = 0; i < 20000; ++i) {
    const float absmax = std::ldexp(mant(rng), exp(rng));
    const float s = bf16(math::int4_scale_bits(absmax));
    ASSERT_GE(s, absmax / 7.0f) << absmax;
    ASSERT_LT(bf16(static_cast<uint16_t>(math::int4_scale_bits(absmax) - 1)), absmax / 7.0f);
    ASSERT_EQ(math::int4_quantize(absmax, s), std::lround(absmax / s)) << absmax;
    ASSERT_EQ(math::int4_quantize(-absmax, s), -math::int4_quantize(absmax, s));
  }
  const float s = bf16(0x3E13);
  EXPECT_EQ(math::int4_quantize(0.5f * s, s), 0);
  EXPECT_EQ(math::int4_quantize(1.5f * s, s), 2);
  EXPECT_EQ(math::int4_quantize(2.5f * s, s), 2);
  EXPECT_EQ(math::int4_quantize(-2.5f * s, s), -2);
  EXPECT_EQ(math::int4_quantize(3.5f * s, s), 4);
  EXPECT_EQ(math::int4_quantize(100.0f, s), 7);  // a foreign scale: clamped
  EXPECT_EQ(math::int4_quantize(1.0f, 0.0f), 0);
  EXPECT_EQ(math::int4_nibble(-7), 1);
  EXPECT_EQ(math::int4_code(15), 7);
  EXPECT_EQ(math::int4_dequantize(-3, s), -3.0f * s);
}

// small_weight_row_bytes' row, blocks of 16.
struct SmallRow {
  std::vector<uint8_t> bytes = small_weight_row_bytes(bf16(0x3E13));
  Int8Run runs[2] = {{math::kDtypeF32, 20}, {math::kDtypeBF16, 3}};
};

TEST(Int4Row, PayloadOfASmallRowHasTheseExactBytes) {
  SmallRow row;
  const std::vector<uint8_t> expected = {
      // header: "GCW4", version 1, flags 0, block 16, 2 runs, 23 elements, body checksum
      0x47, 0x43, 0x57, 0x34, 0x01, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00,
      0x00, 0x17, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe1, 0xc7, 0xdf, 0x9c, 0x0c, 0x00,
      0x00, 0x00,
      // scales (bf16): 1/7 up, a zero block, 3/7 up; padding
      0x13, 0x3e, 0x00, 0x00, 0xdc, 0x3e, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x00,
      // nibbles (code + 8, even element low): 7 -3 2 2 -2 0 4 0 -7 5 0 0 1 2 0 2 | 0 0 0 0 |
      // 7 -3 0; padding
      0x5f, 0xaa, 0x86, 0x8c, 0xd1, 0x88, 0xa9, 0xa8, 0x88, 0x88, 0x5f, 0x08, 0x00, 0x00, 0x00,
      0x00};
  ASSERT_EQ(int4_row_payload_bytes(row.runs, 2, 16), expected.size());
  std::vector<uint8_t> payload(expected.size(), 0xAB);
  EXPECT_EQ(cpu::int4_encode_row(row.bytes.data(), row.runs, 2, 16, payload.data()), 0u);
  EXPECT_EQ(payload, expected);

  EXPECT_EQ(cpu::int4_row_verdict(payload.data(), row.runs, 2, 16), kInt8Ok);
  std::vector<uint8_t> decoded(row.bytes.size());
  cpu::int4_decode_row(payload.data(), row.runs, 2, 16, decoded.data());
  const SmallWeightRowValues got(decoded);
  const float* f = got.f;
  const uint16_t* b = got.b;
  const float s = bf16(0x3E13);
  EXPECT_EQ(f[0], 7.0f * s);
  EXPECT_EQ(f[1], -3.0f * s);
  EXPECT_EQ(f[3], 2.0f * s);
  EXPECT_EQ(f[6], 4.0f * s);
  EXPECT_EQ(std::signbit(f[11]), false);  // code 0 decodes to +0
  EXPECT_EQ(f[17], 0.0f);
  EXPECT_EQ(b[0], math::float_to_bf16(7.0f * bf16(0x3EDC)));
  EXPECT_EQ(b[1], math::float_to_bf16(-3.0f * bf16(0x3EDC)));
  EXPECT_EQ(b[2], 0);
}

TEST(Int4Row, NonFiniteIsFlaggedNotQuantized) {
  SmallRow row;
  const float nan = std::nanf("");
  std::memcpy(row.bytes.data() + 4 * 18, &nan, 4);
  std::vector<uint8_t> payload(int4_row_payload_bytes(row.runs, 2, 16), 0xAB);
  EXPECT_EQ(cpu::int4_encode_row(row.bytes.data(), row.runs, 2, 16, payload.data()), 19u);
  EXPECT_EQ(payload[6], kInt8FlagNonfinite);
  for (size_t i = kInt8HeaderBytes; i < payload.size(); ++i) ASSERT_EQ(payload[i], 0) << i;
  EXPECT_EQ(cpu::int4_row_verdict(payload.data(), row.runs, 2, 16), kInt8Nonfinite);
}

TEST(Int4Row, ForeignOrCorruptedPayloadsAreRefusedBeforeAnyRowIsWritten) {
  SmallRow row;
  const uint64_t bytes = int4_row_payload_bytes(row.runs, 2, 16);
  std::vector<uint8_t> good(bytes);
  cpu::int4_encode_row(row.bytes.data(), row.runs, 2, 16, good.data());
  auto verdict_of = [&](std::vector<uint8_t> p) {
    return cpu::int4_row_verdict(p.data(), row.runs, 2, 16);
  };
  std::vector<uint8_t> p = good;
  p[3] = '8';  // a GCW8 payload is not a GCW4 one
  EXPECT_EQ(verdict_of(p), kInt8BadMagic);
  p = good;
  p[4] = 2;
  EXPECT_EQ(verdict_of(p), kInt8BadVersion);
  p = good;
  p[8] = 32;
  EXPECT_EQ(verdict_of(p), kInt8BadLayout);
  p = good;
  p[7] = 1;
  EXPECT_EQ(verdict_of(p), kInt8BadFlags);
  p = good;
  p[bytes - 20] ^= 0x10;  // one nibble
  EXPECT_EQ(verdict_of(p), kInt8BadChecksum);

  // Through the backend operation: two rows, the second corrupted; the output stays untouched.
  std::vector<uint8_t> bad = good;
  bad[40] ^= 1;
  const uint8_t* payloads[2] = {good.data(), bad.data()};
  std::vector<uint8_t> out(2 * row.bytes.size(), 0xCD);
  int32_t verdicts[3] = {-1, -1, -1};
  Int8DecodeParams d;
  d.payloads = payloads;
  d.num_payloads = 2;
  d.payload_bytes = bytes;
  d.runs = row.runs;
  d.num_runs = 2;
  d.block_size = 16;
  d.output = out.data();
  d.output_bytes = out.size();
  d.verdicts = verdicts;
  cpu::int4_decode(d);
  EXPECT_EQ(verdicts[0], kInt8Ok);
  EXPECT_EQ(verdicts[1], kInt8BadChecksum);
  EXPECT_EQ(verdicts[2], 1);
  for (uint8_t v : out) ASSERT_EQ(v, 0xCD);
  d.payload_bytes = bytes - 16;
  EXPECT_THROW(cpu::int4_decode(d), Error);
}

TEST(Int4Row, RoundTripErrorIsAtMostHalfAScaleOnOddLengthsAndEveryBlockSize) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (uint32_t block : {16u, 32u, 64u, 4096u}) {
    for (int64_t n : {1, 31, 33, 1001}) {
      std::vector<float> x(n);
      for (float& v : x) v = normal(rng);
      const Int8Run run{math::kDtypeF32, n};
      std::vector<uint8_t> payload(int4_row_payload_bytes(&run, 1, block));
      ASSERT_EQ(cpu::int4_encode_row(x.data(), &run, 1, block, payload.data()), 0u);
      ASSERT_EQ(cpu::int4_row_verdict(payload.data(), &run, 1, block), kInt8Ok);
      std::vector<float> y(n);
      cpu::int4_decode_row(payload.data(), &run, 1, block, y.data());
      for (int64_t b = 0; b < n; b += block) {
        float absmax = 0.0f;
        for (int64_t i = b; i < std::min<int64_t>(b + block, n); ++i)
          absmax = std::max(absmax, std::fabs(x[i]));
        const float s = bf16(math::int4_scale_bits(absmax));
        for (int64_t i = b; i < std::min<int64_t>(b + block, n); ++i)
          ASSERT_LE(std::fabs(y[i] - x[i]), 0.5f * s) << block << " " << n << " " << i;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
