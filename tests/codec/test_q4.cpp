// q4 codec on the CPU reference backend: exactness, error bound, unbiasedness, edges, fusion.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "gradcomp/backend.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Values q * d with d = 2^e (1 + m / 8), every block holding a +-7 code, so each value is exact
// in every dtype and the encoder recovers d exactly.
HostTensor grid_tensor(DType dtype, int64_t n, int block, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> qd(-7, 7), md(0, 7), ed(-6, 4);
  HostTensor t(dtype, n);
  for (int64_t b = 0; b * block < n; ++b) {
    const float d = std::ldexp(1.0f + md(gen) / 8.0f, ed(gen));
    const int64_t start = b * block, end = std::min<int64_t>(n, start + block);
    const int64_t full = start + static_cast<int64_t>(gen() % (end - start));
    for (int64_t i = start; i < end; ++i)
      t.set(i, (i == full ? (gen() & 1 ? 7 : -7) : qd(gen)) * d);
  }
  return t;
}

TEST(Q4, GridValuesRoundTripBitExactly) {
  for (DType dtype : kDtypes) {
    for (int block : {16, 64, 256}) {
      for (int64_t n : testing::edge_lengths()) {
        if (n > 70000 && block != 64) continue;
        HostTensor x = grid_tensor(dtype, n, block, static_cast<uint32_t>(n + block));
        for (bool stochastic : {true, false}) {
          auto enc = testing::q4_encode_tensor(x, block, stochastic, {1, 2, 3, 0, 0});
          ASSERT_EQ(enc.payload.size(), q4_payload_bytes(n, block));
          HostTensor y = testing::q4_decode_payloads({&enc.payload}, n, block, dtype);
          ASSERT_EQ(y.bytes, x.bytes) << dtype_name(dtype) << " n=" << n << " block=" << block
                                      << " stochastic=" << stochastic;
        }
      }
    }
  }
}

TEST(Q4, EveryElementWithinTheDocumentedBound) {
  for (DType dtype : kDtypes) {
    for (int64_t n : {1, 13, 257, 4099, 100003}) {
      auto v = testing::normal_floats(n, 11, 3.0f);
      HostTensor x = HostTensor::from_floats(dtype, v);
      for (bool stochastic : {true, false}) {
        auto enc = testing::q4_encode_tensor(x, 64, stochastic, {9, 1, 0, 0, 0});
        HostTensor y = testing::q4_decode_payloads({&enc.payload}, n, 64, DType::kFloat32);
        for (int64_t i = 0; i < n; ++i) {
          const float step = testing::q4_step_of_block(enc.payload, i / 64);
          float absmax = 0;
          for (int64_t j = i / 64 * 64; j < std::min<int64_t>(n, i / 64 * 64 + 64); ++j)
            absmax = std::max(absmax, std::fabs(x.get(j)));
          ASSERT_LE(step, absmax / 7.0f * (1.0f + 1e-5f));
          const double err = std::fabs(static_cast<double>(y.get(i)) - x.get(i));
          ASSERT_LE(err, stochastic ? step : step / 2) << "element " << i;
        }
      }
    }
  }
}

TEST(Q4, StochasticRoundingIsUnbiased) {
  const int64_t n = 1024;
  const int trials = 10000;
  auto v = testing::normal_floats(n, 5);
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  std::vector<double> mean(n, 0.0);
  std::vector<float> step(n / 64);
  for (int t = 0; t < trials; ++t) {
    auto enc = testing::q4_encode_tensor(x, 64, true, {77, static_cast<uint32_t>(t), 0, 0, 0});
    HostTensor y = testing::q4_decode_payloads({&enc.payload}, n, 64, DType::kFloat32);
    for (int64_t i = 0; i < n; ++i) mean[i] += y.get(i);
    if (t == 0)
      for (int64_t b = 0; b < n / 64; ++b) step[b] = testing::q4_step_of_block(enc.payload, b);
  }
  double bias_sum = 0, sigma_sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    mean[i] /= trials;
    const double sigma = step[i / 64] / (2.0 * std::sqrt(static_cast<double>(trials)));
    ASSERT_LE(std::fabs(mean[i] - v[i]), 6 * sigma) << "element " << i;
    bias_sum += mean[i] - v[i];
    sigma_sum += sigma;
  }
  const double sigma_avg = sigma_sum / n;
  EXPECT_LE(std::fabs(bias_sum / n), 6 * sigma_avg / std::sqrt(static_cast<double>(n)));
}

TEST(Q4, NearestRoundingIsDeterministicAndIgnoresTheSeed) {
  auto v = testing::normal_floats(1000, 8);
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  auto a = testing::q4_encode_tensor(x, 64, false, {1, 0, 0, 0, 0});
  auto b = testing::q4_encode_tensor(x, 64, false, {2, 5, 6, 7, 0});
  EXPECT_EQ(a.payload, b.payload);
  auto c = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0});
  auto d = testing::q4_encode_tensor(x, 64, true, {2, 0, 0, 0, 0});
  EXPECT_NE(c.payload, d.payload);
}

TEST(Q4, AllZeroBucketDecodesToZeros) {
  for (DType dtype : kDtypes) {
    HostTensor x(dtype, 300);
    auto enc = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0}, {}, true);
    HostTensor y = testing::q4_decode_payloads({&enc.payload}, 300, 64, dtype);
    EXPECT_EQ(y.bytes, x.bytes);
    for (float r : enc.residual) EXPECT_TRUE(testing::same_bits(r, 0.0f));
  }
}

TEST(Q4, NonFiniteBlockDecodesNonFiniteAndKeepsItsResidual) {
  const float specials[] = {std::nanf(""), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (DType dtype : kDtypes) {
    for (float special : specials) {
      auto v = testing::normal_floats(256, 2);
      v[70] = special;  // block 1 of 4
      HostTensor x = HostTensor::from_floats(dtype, v);
      std::vector<float> r_in(256, 0.25f);
      auto enc = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0}, r_in, true);
      HostTensor y = testing::q4_decode_payloads({&enc.payload}, 256, 64, DType::kFloat32);
      for (int64_t i = 0; i < 256; ++i) {
        const bool in_bad_block = i / 64 == 1;
        EXPECT_EQ(std::isfinite(y.get(i)), !in_bad_block) << i;
        if (in_bad_block)
          EXPECT_EQ(enc.residual[i], 0.25f) << i;
        else
          EXPECT_TRUE(std::isfinite(enc.residual[i]));
      }
    }
  }
}

TEST(Q4, DenormalsAndExtremesStayWithinBound) {
  std::vector<float> v = {1e-45f, -3e-44f, 1e-40f, 0.0f, -1e-39f, 5e-42f, 1e-45f, 0.0f};
  std::vector<float> big = {3.3e38f, -3.4e38f, 1e38f, -2e37f, 0.0f, 65504.0f, -65504.0f, 1.0f};
  for (auto* data : {&v, &big}) {
    HostTensor x = HostTensor::from_floats(DType::kFloat32, *data);
    auto enc = testing::q4_encode_tensor(x, 16, false, {1, 0, 0, 0, 0});
    HostTensor y = testing::q4_decode_payloads({&enc.payload}, x.numel, 16, DType::kFloat32);
    const float step = testing::q4_step_of_block(enc.payload, 0);
    for (int64_t i = 0; i < x.numel; ++i) {
      EXPECT_TRUE(std::isfinite(y.get(i)));
      EXPECT_LE(std::fabs(static_cast<double>(y.get(i)) - x.get(i)), step / 2.0);
    }
  }
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const float top = dtype == DType::kFloat16 ? 65504.0f : 3.3895314e38f;
    HostTensor x = HostTensor::from_floats(dtype, {top, -top, top / 3, 6e-8f});
    auto enc = testing::q4_encode_tensor(x, 16, true, {1, 0, 0, 0, 0});
    HostTensor y = testing::q4_decode_payloads({&enc.payload}, 4, 16, dtype);
    EXPECT_EQ(y.get(0), top);
    EXPECT_EQ(y.get(1), -top);
    EXPECT_TRUE(std::isfinite(y.get(2)));
  }
}

TEST(Q4, ErrorFeedbackResidualIsWhatTheCodecDropped) {
  auto v = testing::normal_floats(4099, 21);
  auto r = testing::normal_floats(4099, 22, 0.1f);
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  auto enc = testing::q4_encode_tensor(x, 64, true, {4, 0, 0, 0, 0}, r, true);
  HostTensor y = testing::q4_decode_payloads({&enc.payload}, 4099, 64, DType::kFloat32);
  for (int64_t i = 0; i < 4099; ++i) {
    const float acc = v[i] + r[i];
    EXPECT_TRUE(testing::same_bits(enc.residual[i], acc - y.get(i))) << i;
    EXPECT_LE(std::fabs(enc.residual[i]), testing::q4_step_of_block(enc.payload, i / 64));
  }
}

TEST(Q4, BFloat16ResidualStorage) {
  auto v = testing::normal_floats(500, 31);
  HostTensor x = HostTensor::from_floats(DType::kBFloat16, v);
  std::vector<uint16_t> r_in(500, 0), r_out(500, 0);
  for (int i = 0; i < 500; ++i) r_in[i] = math::float_to_bf16(0.01f * (i % 7));
  std::vector<uint8_t> payload(q4_payload_bytes(500, 64));
  Segment seg = x.segment();
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = math::kDtypeBF16;
  p.numel = 500;
  p.residual_in = r_in.data();
  p.residual_out = r_out.data();
  p.residual_dtype = math::kDtypeBF16;
  p.payload = payload.data();
  cpu::q4_encode(p);
  HostTensor y = testing::q4_decode_payloads({&payload}, 500, 64, DType::kFloat32);
  for (int i = 0; i < 500; ++i) {
    const float acc = x.get(i) + math::bf16_to_float(r_in[i]);
    EXPECT_EQ(r_out[i], math::float_to_bf16(acc - y.get(i)));
  }
}

TEST(Q4, ThreadsDoNotChangeTheBytes) {
  auto v = testing::normal_floats(300001, 4);
  HostTensor x = HostTensor::from_floats(DType::kBFloat16, v);
  auto one = testing::q4_encode_tensor(x, 64, true, {5, 6, 7, 8, 0}, {}, true, 1);
  auto two = testing::q4_encode_tensor(x, 64, true, {5, 6, 7, 8, 0}, {}, true, 2);
  EXPECT_EQ(one.payload, two.payload);
  EXPECT_EQ(one.residual, two.residual);
}

TEST(Q4, FusedSegmentsEqualFlattenThenEncode) {
  std::mt19937 gen(12);
  for (DType dtype : kDtypes) {
    std::vector<HostTensor> tensors;
    std::vector<float> flat;
    for (int t = 0; t < 100; ++t) {
      const int64_t n = gen() % 700;
      auto v = testing::normal_floats(n, 100 + t);
      tensors.push_back(HostTensor::from_floats(dtype, v));
      for (int64_t i = 0; i < n; ++i) flat.push_back(tensors.back().get(i));
    }
    std::vector<Segment> segs;
    int64_t off = 0;
    for (auto& t : tensors) {
      segs.push_back(Segment{t.data(), off, t.numel});
      off += t.numel;
    }
    HostTensor whole = HostTensor::from_floats(dtype, flat);
    auto ref = testing::q4_encode_tensor(whole, 64, true, {3, 1, 4, 1, 0});
    std::vector<uint8_t> fused(ref.payload.size());
    Q4EncodeParams p;
    p.segments = segs.data();
    p.num_segments = static_cast<int>(segs.size());
    p.dtype = testing::code(dtype);
    p.numel = off;
    p.rng = {3, 1, 4, 1, 0};
    p.payload = fused.data();
    cpu::q4_encode(p);
    for (size_t i = 0; i < fused.size(); ++i)
      ASSERT_EQ(fused[i], ref.payload[i]) << dtype_name(dtype) << " byte " << i;

    // Decoding into the tensor list equals decoding into the flat buffer.
    std::vector<HostTensor> outs;
    std::vector<Segment> out_segs;
    for (auto& t : tensors) outs.emplace_back(dtype, t.numel);
    off = 0;
    for (auto& o : outs) {
      out_segs.push_back(Segment{o.data(), off, o.numel});
      off += o.numel;
    }
    const uint8_t* ptr = fused.data();
    Q4DecodeParams d;
    d.payloads = &ptr;
    d.num_payloads = 1;
    d.payload_bytes = fused.size();
    d.numel = off;
    d.segments = out_segs.data();
    d.num_segments = static_cast<int>(out_segs.size());
    d.dtype = testing::code(dtype);
    cpu::q4_decode(d);
    HostTensor flat_out = testing::q4_decode_payloads({&ref.payload}, off, 64, dtype);
    int64_t at = 0;
    for (auto& o : outs)
      for (int64_t i = 0; i < o.numel; ++i, ++at)
        ASSERT_TRUE(testing::same_bits(o.get(i), flat_out.get(at)));
  }
}

TEST(Q4, DecodeSumsPayloadsInFp32AndDivides) {
  const int64_t n = 1000;
  std::vector<std::vector<uint8_t>> payloads;
  std::vector<HostTensor> inputs;
  for (int w = 0; w < 3; ++w) {
    inputs.push_back(HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(n, 40 + w)));
    payloads.push_back(
        testing::q4_encode_tensor(inputs.back(), 64, true, {1, 0, 0, static_cast<uint32_t>(w), 0})
            .payload);
  }
  HostTensor sum = testing::q4_decode_payloads({&payloads[0], &payloads[1], &payloads[2]}, n, 64,
                                               DType::kBFloat16, 3.0f);
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0;
    for (int w = 0; w < 3; ++w) {
      HostTensor one = testing::q4_decode_payloads({&payloads[w]}, n, 64, DType::kFloat32);
      acc += one.get(i);
    }
    ASSERT_EQ(sum.get(i), math::round_to_dtype(acc / 3.0f, math::kDtypeBF16)) << i;
  }
}

TEST(Q4, RejectsBadParameters) {
  HostTensor x(DType::kFloat32, 100);
  EXPECT_THROW(testing::q4_encode_tensor(x, 48, true, {}), Error);
  EXPECT_THROW(testing::q4_encode_tensor(x, 512, true, {}), Error);
  std::vector<uint8_t> payload(q4_payload_bytes(100, 64));
  Segment seg = x.segment();
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = 101;  // past the segment
  p.payload = payload.data();
  EXPECT_THROW(cpu::q4_encode(p), Error);
  p.numel = 50;
  p.begin = 10;  // not block aligned
  EXPECT_THROW(cpu::q4_encode(p), Error);
  try {
    p.begin = 0;
    p.numel = 101;
    cpu::q4_encode(p);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the segments"), std::string::npos) << e.what();
  }
}

TEST(Q4, SizeArithmeticBeyondTwoToThe31) {
  const int64_t n = (int64_t{1} << 31) + 3;
  const uint64_t blocks = (n + 63) / 64;
  const uint64_t expect = 64 + format::align_up(blocks * 4, 16) + format::align_up((n + 1) / 2, 16);
  EXPECT_EQ(q4_payload_bytes(n, 64), expect);
  auto h = format::make_q4_header(n, 64, 0, true);
  std::vector<uint8_t> bytes(64);
  std::memcpy(bytes.data(), &h, 64);
  EXPECT_THROW(inspect_payload(bytes.data(), bytes.size()), Error);  // truncated: sections missing
  EXPECT_EQ(h.count, blocks);
  EXPECT_EQ(h.section1_bytes, static_cast<uint64_t>((n + 1) / 2));
}

// Q4EncodeParams::nan_head (the reduce-scatter's device poison flag): a set flag reads element
// `begin` as NaN, exactly as a table whose element `begin` holds NaN; a clear flag changes nothing.
// Split tables and a range that starts inside the tensor, for q4 and q2, with error feedback.
TEST(Q4, NanHeadFlagReadsTheFirstElementAsNaN) {
  auto backend = make_cpu_backend();
  const int64_t n = 700, begin = 64, numel = 500;
  for (uint8_t codec : {format::kCodecQ4, format::kCodecQ2}) {
    for (DType dtype : kDtypes) {
      for (uint32_t flag : {0u, 1u}) {
        const std::vector<float> v = testing::normal_floats(n, 5);
        HostTensor x = HostTensor::from_floats(dtype, v);
        std::vector<float> poisoned_values = v;
        if (flag != 0) poisoned_values[begin] = std::nanf("");
        HostTensor expected_input = HostTensor::from_floats(dtype, poisoned_values);
        const std::vector<float> r_in(numel, 0.125f);
        const size_t bytes =
            codec == format::kCodecQ2 ? q2_payload_bytes(numel, 64) : q4_payload_bytes(numel, 64);
        auto encode = [&](Segment* segs, int count, const uint32_t* nan_head) {
          std::vector<uint8_t> payload(bytes, 0xAB);
          std::vector<float> r_out(numel, -1.0f);
          Q4EncodeParams p;
          p.codec = codec;
          p.segments = segs;
          p.num_segments = count;
          p.dtype = static_cast<uint8_t>(dtype);
          p.begin = begin;
          p.numel = numel;
          p.block_size = 64;
          p.rng = {7, 1, 2, 3, 4};
          p.residual_in = r_in.data();
          p.residual_out = r_out.data();
          p.payload = payload.data();
          p.nan_head = nan_head;
          backend->q4_encode(p);
          return std::make_pair(payload, r_out);
        };
        const size_t esize = dtype_size(dtype);
        Segment split[2] = {{x.bytes.data(), 0, 100}, {x.bytes.data() + 100 * esize, 100, n - 100}};
        const auto got = encode(split, 2, &flag);
        Segment whole = expected_input.segment();
        const auto want = encode(&whole, 1, nullptr);
        EXPECT_EQ(got.first, want.first) << int(codec) << " " << dtype_name(dtype) << " " << flag;
        EXPECT_EQ(0, std::memcmp(got.second.data(), want.second.data(), numel * sizeof(float)))
            << int(codec) << " " << dtype_name(dtype) << " " << flag;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
