// top-k codec on the CPU reference backend: exact selection, ties, approximate mode, hardening.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

// Sort-based reference: the k largest |x|, ties to the lower index, returned in index order.
std::vector<uint32_t> reference_topk(const std::vector<float>& acc, int64_t k) {
  std::vector<uint32_t> order(acc.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return math::topk_key(acc[a]) > math::topk_key(acc[b]);
  });
  order.resize(static_cast<size_t>(k));
  std::sort(order.begin(), order.end());
  return order;
}

TEST(TopK, KFollowsTheRule) {
  EXPECT_EQ(topk_k(0, 0.01), 0);
  EXPECT_EQ(topk_k(1, 0.01), 1);
  EXPECT_EQ(topk_k(13, 0.01), 1);
  EXPECT_EQ(topk_k(100, 0.01), 1);
  EXPECT_EQ(topk_k(101, 0.01), 2);
  EXPECT_EQ(topk_k(1000, 0.5), 500);
  EXPECT_EQ(topk_k(7, 1.0), 7);
  TopKOptions o;
  o.exact = false;
  EXPECT_EQ(topk_capacity(1000, o), 13);  // ceil(1.25 * 10)
}

TEST(TopK, ExactSelectsTheSameSetAsASort) {
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int64_t n : testing::edge_lengths()) {
      if (n == 0) continue;
      for (double ratio : {0.01, 0.1, 1.0}) {
        if (n > 100000 && ratio > 0.01) continue;
        HostTensor x =
            HostTensor::from_floats(dtype, testing::normal_floats(n, static_cast<uint32_t>(n)));
        std::vector<float> r = testing::normal_floats(n, 99, 0.05f);
        const int64_t k = topk_k(n, ratio);
        auto enc = testing::topk_encode_tensor(x, k, k, true, DType::kFloat32, r);
        std::vector<float> acc(n);
        for (int64_t i = 0; i < n; ++i) acc[i] = x.get(i) + r[i];
        ASSERT_EQ(enc.count, static_cast<uint64_t>(k));
        ASSERT_EQ(enc.indices(), reference_topk(acc, k)) << dtype_name(dtype) << " n=" << n;
        // Selected values plus residual reconstruct input + old residual exactly.
        HostTensor out(DType::kFloat32, n);
        Segment seg = out.segment();
        std::vector<const uint8_t*> ptrs = {enc.payload.data()};
        cpu::topk_decode(testing::topk_decode_params(ptrs, enc.payload.size(), n, k,
                                                     DType::kFloat32, &seg, DType::kFloat32));
        for (int64_t i = 0; i < n; ++i)
          ASSERT_TRUE(testing::same_bits(out.get(i) + enc.residual[i], acc[i])) << i;
      }
    }
  }
}

TEST(TopK, TiesGoToTheLowerIndex) {
  std::vector<float> v(1000, 1.0f);
  for (int i = 0; i < 1000; i += 3) v[i] = -1.0f;  // equal magnitudes, mixed signs
  v[500] = 2.0f;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  auto enc = testing::topk_encode_tensor(x, 10, 10, true, DType::kFloat32);
  std::vector<uint32_t> expect = {0, 1, 2, 3, 4, 5, 6, 7, 8, 500};
  EXPECT_EQ(enc.indices(), expect);
  HostTensor zeros(DType::kFloat32, 50);
  auto z = testing::topk_encode_tensor(zeros, 5, 5, true, DType::kFloat32);
  std::vector<uint32_t> first5 = {0, 1, 2, 3, 4};
  EXPECT_EQ(z.indices(), first5);
}

TEST(TopK, Fp16ValuesFoldTheirRoundingIntoTheResidual) {
  for (DType vd : {DType::kFloat16, DType::kBFloat16}) {
    auto v = testing::normal_floats(5000, 17);
    v[10] = 1e6f;  // beyond fp16: saturates, the excess stays in the residual
    HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
    auto enc = testing::topk_encode_tensor(x, 50, 50, true, vd);
    HostTensor out(DType::kFloat32, 5000);
    Segment seg = out.segment();
    std::vector<const uint8_t*> ptrs = {enc.payload.data()};
    cpu::topk_decode(
        testing::topk_decode_params(ptrs, enc.payload.size(), 5000, 50, vd, &seg, DType::kFloat32));
    for (int64_t i = 0; i < 5000; ++i) {
      ASSERT_TRUE(std::isfinite(out.get(i)));
      ASSERT_TRUE(testing::same_bits(out.get(i) + enc.residual[i], v[i])) << i;
    }
    EXPECT_EQ(enc.payload.size(), topk_payload_bytes(50, vd));
  }
}

TEST(TopK, ApproximateSelectsAboveASampledThresholdInIndexOrder) {
  for (int64_t n : {13, 4099, 100000, (1 << 20) + 3}) {
    auto v = testing::normal_floats(n, 23);
    HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
    TopKOptions o;
    o.exact = false;
    const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
    auto enc = testing::topk_encode_tensor(x, k, cap, false, DType::kFloat32);
    ASSERT_GE(enc.count, 1u);
    ASSERT_LE(enc.count, static_cast<uint64_t>(cap));
    if (n >= 100000) EXPECT_GE(enc.count, static_cast<uint64_t>(k / 2)) << n;
    auto idx = enc.indices();
    uint32_t min_key = ~0u;
    for (uint32_t i : idx) min_key = std::min(min_key, math::topk_key(v[i]));
    ASSERT_TRUE(std::is_sorted(idx.begin(), idx.end()));
    // Every element before the last selected one with a key at or above the threshold is selected.
    size_t at = 0;
    for (uint32_t i = 0; i <= idx.back(); ++i) {
      const bool sel = at < idx.size() && idx[at] == i;
      if (sel)
        ++at;
      else
        ASSERT_LT(math::topk_key(v[i]), min_key) << i;
      ASSERT_TRUE(testing::same_bits(enc.residual[i], sel ? 0.0f : v[i]));
    }
  }
}

TEST(TopK, NaNIsSelectedAndKeepsItsResidual) {
  auto v = testing::normal_floats(1000, 29);
  v[321] = std::nanf("");
  v[9] = -std::numeric_limits<float>::infinity();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  std::vector<float> r(1000, 0.5f);
  auto enc = testing::topk_encode_tensor(x, 10, 10, true, DType::kFloat32, r);
  auto idx = enc.indices();
  EXPECT_TRUE(std::find(idx.begin(), idx.end(), 321u) != idx.end());
  EXPECT_TRUE(std::find(idx.begin(), idx.end(), 9u) != idx.end());
  EXPECT_EQ(enc.residual[321], 0.5f);
  EXPECT_EQ(enc.residual[9], 0.5f);
}

// A whole bucket of non-finite values, more of them than k, and residuals that alias: every
// non-finite element keeps its old residual, every selected one loses its value, all others keep
// input + residual; and the residual written in place equals the one written to a new buffer.
TEST(TopK, ManyNonFiniteValuesAndAliasedResiduals) {
  for (bool exact : {true, false}) {
    for (DType rdtype : {DType::kFloat32, DType::kBFloat16}) {
      auto v = testing::normal_floats(5000, 31);
      for (int i = 0; i < 200; ++i) v[i * 25] = (i % 3 == 0) ? std::nanf("") : INFINITY;
      v[7] = -0.0f;
      HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
      HostTensor r0 = HostTensor::from_floats(rdtype, testing::normal_floats(5000, 32, 0.1f));
      const int64_t k = 50, cap = exact ? k : 80;
      auto run = [&](HostTensor& residual_in, void* residual_out) {
        std::vector<uint8_t> payload(topk_payload_bytes(cap, DType::kFloat32));
        Segment seg = x.segment();
        TopKEncodeParams p;
        p.segments = &seg;
        p.num_segments = 1;
        p.numel = x.numel;
        p.k = k;
        p.capacity = static_cast<uint32_t>(cap);
        p.exact = exact;
        p.residual_in = residual_in.data();
        p.residual_out = residual_out;
        p.residual_dtype = testing::code(rdtype);
        p.payload = payload.data();
        cpu::topk_encode(p);
        return payload;
      };
      HostTensor separate(rdtype, x.numel);
      const auto payload = run(r0, separate.data());
      HostTensor in_place = r0;
      EXPECT_EQ(run(in_place, in_place.data()), payload);
      EXPECT_EQ(in_place.bytes, separate.bytes);
      const uint32_t* idx = reinterpret_cast<const uint32_t*>(payload.data() + kPayloadHeaderBytes);
      std::vector<bool> selected(x.numel, false);
      format::PayloadHeader h;
      std::memcpy(&h, payload.data(), sizeof h);
      for (uint64_t e = 0; e < h.count; ++e) selected[idx[e]] = true;
      for (int64_t i = 0; i < x.numel; ++i) {
        const float acc = v[i] + r0.get(i);
        const float want = !std::isfinite(acc) ? r0.get(i) : (selected[i] ? 0.0f : acc);
        ASSERT_TRUE(
            testing::same_bits(separate.get(i), math::round_to_dtype(want, testing::code(rdtype))))
            << "exact=" << exact << " residual " << dtype_name(rdtype) << " element " << i;
      }
    }
  }
}

class TopKCorruption : public ::testing::Test {
 protected:
  void SetUp() override {
    x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 5));
    enc = testing::topk_encode_tensor(x, k, k, true, DType::kFloat32);
    out = HostTensor::from_floats(DType::kFloat32, std::vector<float>(n, 42.0f));
  }
  void expect_rejected(std::vector<uint8_t> payload, uint64_t bytes, const char* needle) {
    Segment seg = out.segment();
    std::vector<const uint8_t*> ptrs = {enc.payload.data(), payload.data()};
    try {
      cpu::topk_decode(
          testing::topk_decode_params(ptrs, bytes, n, k, DType::kFloat32, &seg, DType::kFloat32));
      ADD_FAILURE() << "corrupted payload accepted";
    } catch (const PayloadError& e) {  // counted as a rejected payload, and names the sender
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(from rank "), std::string::npos) << e.what();
    } catch (const Error& e) {
      ADD_FAILURE() << "a bad payload raised a plain Error, not PayloadError: " << e.what();
    }
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(out.get(i), 42.0f) << "output written before validation";
  }
  // Recomputes the checksums, so that the decoder's deeper checks see the damage.
  void reseal(std::vector<uint8_t>& p) {
    format::PayloadHeader h;
    std::memcpy(&h, p.data(), 64);
    h = format::with_body_checksum(h, format::body_checksum(p.data(), p.size()));
    std::memcpy(p.data(), &h, 64);
  }
  const int64_t n = 2000, k = 20;
  HostTensor x, out;
  testing::TopKEncoded enc;
};

TEST_F(TopKCorruption, IndexOutOfRange) {
  auto p = enc.payload;
  reinterpret_cast<uint32_t*>(p.data() + 64)[5] = 2000;
  expect_rejected(p, p.size(), "body checksum");
  reseal(p);
  expect_rejected(p, p.size(), "outside [0, 2000)");
}

TEST_F(TopKCorruption, IndicesOutOfOrder) {
  auto p = enc.payload;
  auto* idx = reinterpret_cast<uint32_t*>(p.data() + 64);
  std::swap(idx[3], idx[4]);
  expect_rejected(p, p.size(), "body checksum");
  reseal(p);
  expect_rejected(p, p.size(), "strictly increasing");
}

TEST_F(TopKCorruption, AFlippedValueBitIsRefused) {
  auto p = enc.payload;
  p.at(p.size() - 20) ^= 0x08;  // inside the values section
  expect_rejected(p, p.size(), "body checksum");
}

TEST_F(TopKCorruption, CountBeyondCapacity) {
  auto p = enc.payload;
  format::PayloadHeader h;
  std::memcpy(&h, p.data(), 64);
  h.count = k + 1;
  std::memcpy(p.data(), &h, 64);
  reseal(p);
  expect_rejected(p, p.size(), "count out of range");
}

TEST_F(TopKCorruption, TruncatedAndFlippedHeader) {
  expect_rejected(enc.payload, enc.payload.size() - 16, "shorter");
  auto p = enc.payload;
  p[20] ^= 0x40;
  expect_rejected(p, p.size(), "checksum");
  auto q = enc.payload;
  q[0] = 'X';
  expect_rejected(q, q.size(), "magic");
}

TEST(TopK, RefusesBucketsOf2To31ElementsWithoutAllocating) {
  const int64_t n = int64_t{1} << 31;
  float dummy = 0;
  Segment seg{&dummy, 0, n};
  std::vector<uint8_t> payload(64);
  TopKEncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = n;
  p.k = 1;
  p.capacity = 1;
  p.payload = payload.data();
  try {
    cpu::topk_encode(p);
    ADD_FAILURE() << "accepted a 2^31-element bucket";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2^31"), std::string::npos) << e.what();
  }
  EXPECT_THROW(topk_payload_bytes(n, DType::kFloat32), Error);
  EXPECT_EQ(topk_payload_bytes(n - 1, DType::kFloat32),
            64 + format::align_up(4ull * (n - 1), 16) + format::align_up(4ull * (n - 1), 16));
}

}  // namespace
}  // namespace gradcomp
