// Block-scaled int8 (the weight all-gather's codec): element math and the row payload, byte exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradcomp/all_gather.h"
#include "gradcomp/backend.h"
#include "math/int8_math.h"
#include "small_weight_row.h"

namespace gradcomp {
namespace {

float bf16(uint16_t bits) {
  return math::bf16_to_float(bits);
}

TEST(Int8Math, ScaleIsAbsmaxOver127RoundedUpToBf16) {
  // 1 / 127 = 0x3C010204 in fp32: rounding down (or to nearest) would give 0x3C01.
  EXPECT_EQ(math::int8_scale_bits(1.0f), 0x3C02);
  EXPECT_EQ(math::int8_scale_bits(3.0f), 0x3CC2);
  EXPECT_EQ(math::int8_scale_bits(0.0f), 0);
  // 127 * 2^-7 / 127 = 2^-7 exactly: nothing to round.
  EXPECT_EQ(math::int8_scale_bits(127.0f / 128.0f), 0x3C00);
  // A quotient that underflows to 0 still gets a positive scale.
  EXPECT_EQ(math::int8_scale_bits(1e-45f), 1);
}

TEST(Int8Math, ScaleIsTheSmallestBf16AtLeastTheQuotientSoCodesNeverExceed127) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> exp(-40, 40);
  for (int i = 0; i < 20000; ++i) {
    const float absmax = std::ldexp(mant(rng), exp(rng));
    const uint16_t s = math::int8_scale_bits(absmax);
    const float q = absmax / 127.0f;
    ASSERT_GE(bf16(s), q) << absmax;
    ASSERT_LT(bf16(static_cast<uint16_t>(s - 1)), q) << absmax;
    ASSERT_EQ(math::int8_quantize(absmax, bf16(s)), std::lround(absmax / bf16(s)));
    ASSERT_LE(std::fabs(absmax / bf16(s)), 127.0f);
    ASSERT_EQ(math::int8_quantize(-absmax, bf16(s)), -math::int8_quantize(absmax, bf16(s)));
  }
}

TEST(Int8Math, RoundsToNearestTiesToEven) {
  const float s = bf16(0x3C02);
  EXPECT_EQ(math::int8_quantize(0.5f * s, s), 0);
  EXPECT_EQ(math::int8_quantize(1.5f * s, s), 2);
  EXPECT_EQ(math::int8_quantize(2.5f * s, s), 2);
  EXPECT_EQ(math::int8_quantize(-2.5f * s, s), -2);
  EXPECT_EQ(math::int8_quantize(3.5f * s, s), 4);
  EXPECT_EQ(math::int8_quantize(2.51f * s, s), 3);
  EXPECT_EQ(math::int8_quantize(1.0f, 0.0f), 0);
  EXPECT_EQ(math::int8_dequantize(-63, s), -63.0f * s);
}

TEST(Int8Math, BlockSizes) {
  EXPECT_TRUE(math::int8_block_size_valid(16));
  EXPECT_TRUE(math::int8_block_size_valid(64));
  EXPECT_TRUE(math::int8_block_size_valid(4096));
  EXPECT_FALSE(math::int8_block_size_valid(8));
  EXPECT_FALSE(math::int8_block_size_valid(48));
  EXPECT_FALSE(math::int8_block_size_valid(8192));
}

// small_weight_row_bytes' row, blocks of 16.
struct SmallRow {
  std::vector<uint8_t> bytes = small_weight_row_bytes(bf16(0x3C02));
  AllGatherRun runs[2] = {{DType::kFloat32, 20}, {DType::kBFloat16, 3}};
};

TEST(Int8Row, PayloadOfASmallRowHasTheseExactBytes) {
  SmallRow row;
  const std::vector<uint8_t> expected = {
      // header: "GCW8", version 1, flags 0, block 16, 2 runs, 23 elements, body checksum
      0x47, 0x43, 0x57, 0x38, 0x01, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00,
      0x00, 0x17, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x97, 0x1f, 0x67, 0x4d, 0x02, 0x00,
      0x00, 0x00,
      // scales (bf16): 1/127 up, a zero block, 3/127 up; padding
      0x02, 0x3c, 0x00, 0x00, 0xc2, 0x3c, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x00,
      // codes: 126 -63 32 2 -2 0 4 0 -126 95 0 0 16 2 0 38 | 0 0 0 0 | 127 -63 0; padding
      0x7e, 0xc1, 0x20, 0x02, 0xfe, 0x00, 0x04, 0x00, 0x82, 0x5f, 0x00, 0x00, 0x10, 0x02, 0x00,
      0x26, 0x00, 0x00, 0x00, 0x00, 0x7f, 0xc1, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
      0x00, 0x00};
  ASSERT_EQ(int8_payload_bytes(row.runs, 2, 16), expected.size());
  std::vector<uint8_t> payload(expected.size(), 0xAB);
  EXPECT_TRUE(int8_encode_row(row.bytes.data(), row.runs, 2, 16, payload.data()));
  EXPECT_EQ(payload, expected);

  std::vector<uint8_t> decoded(row.bytes.size());
  EXPECT_TRUE(int8_check_row(payload.data(), row.runs, 2, 16, 0));
  int8_decode_row(payload.data(), row.runs, 2, 16, decoded.data());
  const SmallWeightRowValues got(decoded);
  const float* f = got.f;
  const uint16_t* b = got.b;
  EXPECT_EQ(f[0], 126.0f * bf16(0x3C02));
  EXPECT_EQ(f[3], 2.0f * bf16(0x3C02));
  EXPECT_EQ(f[17], 0.0f);
  EXPECT_EQ(b[0], math::float_to_bf16(127.0f * bf16(0x3CC2)));
  EXPECT_EQ(b[1], math::float_to_bf16(-63.0f * bf16(0x3CC2)));
}

TEST(Int8Row, NonFiniteIsFlaggedNotQuantized) {
  SmallRow row;
  const float nan = NAN, inf = INFINITY;
  for (float bad : {nan, inf, -inf}) {
    std::vector<uint8_t> in = row.bytes;
    std::memcpy(in.data() + 4 * 17, &bad, 4);
    std::vector<uint8_t> payload(int8_payload_bytes(row.runs, 2, 16), 0xAB);
    EXPECT_FALSE(int8_encode_row(in.data(), row.runs, 2, 16, payload.data()));
    EXPECT_EQ(payload[6], kInt8FlagNonfinite);
    for (size_t i = kInt8HeaderBytes; i < payload.size(); ++i) ASSERT_EQ(payload[i], 0) << i;
    EXPECT_FALSE(int8_check_row(payload.data(), row.runs, 2, 16, 1));
  }
}

TEST(Int8Row, CorruptedOrForeignPayloadsAreRefusedNamingTheRank) {
  SmallRow row;
  std::vector<uint8_t> payload(int8_payload_bytes(row.runs, 2, 16));
  int8_encode_row(row.bytes.data(), row.runs, 2, 16, payload.data());
  // Byte 7 (reserved) is outside the body checksum: only the header check refuses it.
  for (size_t at : {size_t{0}, size_t{7}, size_t{8}, size_t{16}, size_t{40}, size_t{70}}) {
    std::vector<uint8_t> bad = payload;
    bad[at] ^= 0x10;
    try {
      int8_check_row(bad.data(), row.runs, 2, 16, 3);
      FAIL() << "byte " << at << " flipped passed";
    } catch (const PayloadError& e) {
      EXPECT_NE(std::string(e.what()).find("from rank 3"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(int8_check_row(payload.data(), row.runs, 2, 32, 0), PayloadError);
}

// The Backend operations over the same codec: encode equals int8_encode_row and reports the first
// non-finite element; decode checks every payload before it writes any row.
TEST(Int8Backend, CpuEncodeAndDecodeAreTheRowCodecAndWriteNothingForABadPayload) {
  SmallRow row;
  auto backend = make_cpu_backend();
  const Int8Run runs[2] = {{math::kDtypeF32, 20}, {math::kDtypeBF16, 3}};
  const uint64_t slot = int8_payload_bytes(row.runs, 2, 16);
  std::vector<uint8_t> expected(slot), payloads(3 * slot, 0xAB);
  int8_encode_row(row.bytes.data(), row.runs, 2, 16, expected.data());
  uint64_t nonfinite_at = 99;
  Int8EncodeParams e;
  e.input = row.bytes.data();
  e.runs = runs;
  e.num_runs = 2;
  e.block_size = 16;
  e.payload_bytes = slot;
  e.nonfinite_at = &nonfinite_at;
  for (int w = 0; w < 3; ++w) {
    e.payload = payloads.data() + slot * w;
    backend->int8_encode(e);
    EXPECT_EQ(nonfinite_at, 0u);
    EXPECT_TRUE(std::equal(expected.begin(), expected.end(), payloads.begin() + slot * w));
  }
  std::vector<uint8_t> in = row.bytes;
  const float nan = NAN;
  std::memcpy(in.data() + 4 * 13, &nan, 4);
  e.input = in.data();
  e.payload = payloads.data() + slot;  // rank 1's row holds a NaN at element 13
  backend->int8_encode(e);
  EXPECT_EQ(nonfinite_at, 14u);

  const uint64_t row_bytes = row.bytes.size();
  std::vector<uint8_t> out(3 * row_bytes, 0x5A);
  const uint8_t* ptrs[3] = {payloads.data(), payloads.data() + slot, payloads.data() + 2 * slot};
  int32_t verdicts[4] = {-1, -1, -1, -1};
  Int8DecodeParams d;
  d.payloads = ptrs;
  d.num_payloads = 3;
  d.payload_bytes = slot;
  d.runs = runs;
  d.num_runs = 2;
  d.block_size = 16;
  d.output = out.data();
  d.output_bytes = out.size();
  d.verdicts = verdicts;
  backend->int8_decode(d);
  EXPECT_EQ(verdicts[0], kInt8Ok);
  EXPECT_EQ(verdicts[1], kInt8Nonfinite);
  EXPECT_EQ(verdicts[2], kInt8Ok);
  EXPECT_EQ(verdicts[3], 1);
  for (uint8_t b : out) ASSERT_EQ(b, 0x5A);

  payloads[2 * slot + 40] ^= 1;  // a flipped scale bit in rank 2's row
  std::copy(expected.begin(), expected.end(), payloads.begin() + slot);
  backend->int8_decode(d);
  EXPECT_EQ(verdicts[1], kInt8Ok);
  EXPECT_EQ(verdicts[2], kInt8BadChecksum);
  EXPECT_EQ(verdicts[3], 1);
  for (uint8_t b : out) ASSERT_EQ(b, 0x5A);

  payloads[2 * slot + 40] ^= 1;
  backend->int8_decode(d);
  EXPECT_EQ(verdicts[3], 0);
  std::vector<uint8_t> one(row_bytes);
  int8_decode_row(expected.data(), row.runs, 2, 16, one.data());
  for (int w = 0; w < 3; ++w)
    EXPECT_TRUE(std::equal(one.begin(), one.end(), out.begin() + row_bytes * w)) << w;

  d.output_bytes = out.size() - 1;  // one byte short of three rows: refused, nothing written
  EXPECT_THROW(backend->int8_decode(d), Error);
}

// The rows above sit 86 bytes apart (20 float32 + 3 bfloat16): the CPU took them, byte-copied. The
// CUDA kernels access elements as their type, so the layout rule they are held to names what is
// off.
TEST(Int8Layout, UnalignedElementsAreNamedForTheDeviceAndAlignedOnesPass) {
  alignas(16) static uint8_t buffer[64];
  const Int8Run f32_then_bf16[2] = {{math::kDtypeF32, 20}, {math::kDtypeBF16, 3}};
  const Int8Run bf16_then_f32[2] = {{math::kDtypeBF16, 3}, {math::kDtypeF32, 4}};
  const Int8Run even[2] = {{math::kDtypeF32, 20}, {math::kDtypeBF16, 4}};
  EXPECT_EQ(int8_alignment_problem(f32_then_bf16, 2, buffer, false), nullptr);
  EXPECT_EQ(int8_alignment_problem(even, 2, buffer, true), nullptr);
  const char* rows = int8_alignment_problem(f32_then_bf16, 2, buffer, true);
  ASSERT_NE(rows, nullptr);
  EXPECT_NE(std::string(rows).find("next row is unaligned"), std::string::npos) << rows;
  const char* run = int8_alignment_problem(bf16_then_f32, 2, buffer, false);
  ASSERT_NE(run, nullptr);
  EXPECT_NE(std::string(run).find("byte offset"), std::string::npos) << run;
  const char* base = int8_alignment_problem(even, 2, buffer + 2, false);
  ASSERT_NE(base, nullptr);
  EXPECT_NE(std::string(base).find("address"), std::string::npos) << base;
}

}  // namespace
}  // namespace gradcomp
