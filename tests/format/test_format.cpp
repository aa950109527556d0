// Wire format v1: header layout, inspection, and decoders under random corruption.
#include <gtest/gtest.h>

#include <cstddef>

#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

TEST(Format, HeaderFieldOffsetsAreFixed) {
  static_assert(sizeof(format::PayloadHeader) == 64, "header is 64 bytes");
  EXPECT_EQ(offsetof(format::PayloadHeader, magic), 0u);
  EXPECT_EQ(offsetof(format::PayloadHeader, version), 4u);
  EXPECT_EQ(offsetof(format::PayloadHeader, codec), 6u);
  EXPECT_EQ(offsetof(format::PayloadHeader, dtype), 7u);
  EXPECT_EQ(offsetof(format::PayloadHeader, value_dtype), 8u);
  EXPECT_EQ(offsetof(format::PayloadHeader, flags), 9u);
  EXPECT_EQ(offsetof(format::PayloadHeader, param), 12u);
  EXPECT_EQ(offsetof(format::PayloadHeader, numel), 16u);
  EXPECT_EQ(offsetof(format::PayloadHeader, count), 24u);
  EXPECT_EQ(offsetof(format::PayloadHeader, section0_bytes), 32u);
  EXPECT_EQ(offsetof(format::PayloadHeader, section1_bytes), 40u);
  EXPECT_EQ(offsetof(format::PayloadHeader, body_checksum), 48u);
  EXPECT_EQ(offsetof(format::PayloadHeader, checksum), 60u);
}

TEST(Format, InspectReportsWhatWasEncoded) {
  HostTensor x = HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(1000, 1));
  auto q = testing::q4_encode_tensor(x, 128, true, {1, 0, 0, 0, 0});
  PayloadInfo info = inspect_payload(q.payload.data(), q.payload.size());
  EXPECT_EQ(info.codec, Codec::kQ4);
  EXPECT_EQ(info.dtype, DType::kBFloat16);
  EXPECT_EQ(info.numel, 1000);
  EXPECT_EQ(info.param, 128u);
  EXPECT_EQ(info.count, 8u);
  EXPECT_TRUE(info.stochastic);
  EXPECT_EQ(info.total_bytes, q.payload.size());
  EXPECT_EQ(q.payload.size(), 64u + 32u + 512u);
  // The first bytes spell the magic.
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(q.payload.data()), 4), "GCMP");

  auto t = testing::topk_encode_tensor(x, 10, 10, true, DType::kFloat16);
  info = inspect_payload(t.payload.data(), t.payload.size());
  EXPECT_EQ(info.codec, Codec::kTopK);
  EXPECT_EQ(info.value_dtype, DType::kFloat16);
  EXPECT_EQ(info.count, 10u);
  EXPECT_EQ(t.payload.size(), 64u + 48u + 32u);
}

TEST(Format, InspectRejectsShortAndForeignBuffers) {
  std::vector<uint8_t> junk(100, 0x11);
  EXPECT_THROW(inspect_payload(junk.data(), 10), Error);
  EXPECT_THROW(inspect_payload(junk.data(), junk.size()), Error);
}

// Random byte flips, truncations and garbage: decoders either throw or decode within bounds.
// AddressSanitizer (the sanitize CI job) turns any out-of-bounds access here into a failure.
// Format v2: a flipped bit anywhere (header, sections, padding) or a short payload is refused;
// only a payload whose flips cancelled out is accepted.
TEST(Format, DecodersRefuseEveryCorruption) {
  std::mt19937 gen(2024);
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(777, 3));
  auto q = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0});
  auto t = testing::topk_encode_tensor(x, 30, 30, true, DType::kFloat32);
  int rejected = 0, intact = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const bool use_q4 = trial % 2 == 0;
    const std::vector<uint8_t>& original = use_q4 ? q.payload : t.payload;
    std::vector<uint8_t> p = original;
    const int flips = 1 + static_cast<int>(gen() % 4);
    for (int f = 0; f < flips; ++f) p[gen() % p.size()] ^= static_cast<uint8_t>(1u << (gen() % 8));
    const uint64_t bytes = gen() % 4 == 0 ? gen() % p.size() : p.size();
    HostTensor out(DType::kFloat32, 777);
    Segment seg = out.segment();
    std::vector<const uint8_t*> ptrs = {p.data()};
    try {
      if (use_q4) {
        Q4DecodeParams d;
        d.payloads = ptrs.data();
        d.num_payloads = 1;
        d.payload_bytes = bytes;
        d.numel = 777;
        d.segments = &seg;
        d.num_segments = 1;
        cpu::q4_decode(d);
      } else {
        cpu::topk_decode(testing::topk_decode_params(ptrs, bytes, 777, 30, DType::kFloat32, &seg,
                                                     DType::kFloat32));
      }
      EXPECT_TRUE(p == original && bytes == p.size()) << "trial " << trial << " accepted";
      ++intact;
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 2500);
  EXPECT_LT(intact, 500);
}

}  // namespace
}  // namespace gradcomp
