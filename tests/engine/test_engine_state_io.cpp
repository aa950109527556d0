// EngineState bytes: an exact round trip, and every damaged record refused as a whole.
#include <gtest/gtest.h>

#include "gradcomp/engine.h"

namespace gradcomp {
namespace {

EngineState sample_state() {
  EngineState s;
  s.compression.seed = 0x1234567890ull;
  s.compression.step = 41;
  s.started = true;
  s.world_size = 4;
  s.local_world_size = 2;
  s.compression.residuals[7] = {1, 2, 3, 4, 5};
  s.compression.residuals[99] = std::vector<uint8_t>(300, 0xAB);
  s.compression.chunk_residuals[7] = {9, 8};
  s.layouts[7] = BucketLayout{0, DType::kBFloat16, {{3, 100}, {2, 50}}};
  s.layouts[99] = BucketLayout{1, DType::kFloat32, {{0, 75}}};
  return s;
}

void expect_equal(const EngineState& a, const EngineState& b) {
  EXPECT_EQ(a.compression.seed, b.compression.seed);
  EXPECT_EQ(a.compression.step, b.compression.step);
  EXPECT_EQ(a.started, b.started);
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.local_world_size, b.local_world_size);
  EXPECT_EQ(a.compression.residuals, b.compression.residuals);
  EXPECT_EQ(a.compression.chunk_residuals, b.compression.chunk_residuals);
  ASSERT_EQ(a.layouts.size(), b.layouts.size());
  for (const auto& [id, layout] : a.layouts) {
    const BucketLayout& other = b.layouts.at(id);
    EXPECT_EQ(layout.index, other.index);
    EXPECT_EQ(layout.dtype, other.dtype);
    EXPECT_EQ(layout.params, other.params);
  }
}

TEST(EngineStateIo, RoundTripsExactly) {
  const std::vector<uint8_t> bytes = serialize_engine_state(sample_state());
  expect_equal(parse_engine_state(bytes.data(), bytes.size()), sample_state());
  const std::vector<uint8_t> empty = serialize_engine_state(EngineState{});
  expect_equal(parse_engine_state(empty.data(), empty.size()), EngineState{});
}

TEST(EngineStateIo, EveryTruncationIsRefused) {
  const std::vector<uint8_t> bytes = serialize_engine_state(sample_state());
  for (size_t n = 0; n < bytes.size(); ++n)
    EXPECT_THROW(parse_engine_state(bytes.data(), n), Error) << n << " bytes";
}

TEST(EngineStateIo, EveryFlippedBitIsRefused) {
  const std::vector<uint8_t> bytes = serialize_engine_state(sample_state());
  for (size_t i = 0; i < bytes.size(); ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> bad = bytes;
      bad[i] ^= static_cast<uint8_t>(1u << bit);
      EXPECT_THROW(parse_engine_state(bad.data(), bad.size()), Error) << "byte " << i;
    }
  }
}

TEST(EngineStateIo, MessagesSayWhatIsWrong) {
  std::vector<uint8_t> bytes = serialize_engine_state(sample_state());
  auto message = [](const std::vector<uint8_t>& b) -> std::string {
    try {
      parse_engine_state(b.data(), b.size());
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::vector<uint8_t> magic = bytes;
  magic[0] ^= 1;
  EXPECT_NE(message(magic).find("bad magic"), std::string::npos);
  std::vector<uint8_t> version = bytes;
  version[4] = 4;
  EXPECT_NE(message(version).find("version 4"), std::string::npos);
  std::vector<uint8_t> body = bytes;
  body[20] ^= 1;
  EXPECT_NE(message(body).find("checksum"), std::string::npos);
  bytes.resize(bytes.size() - 1);
  EXPECT_NE(message(bytes).find("checksum"), std::string::npos);
}

}  // namespace
}  // namespace gradcomp
