// q2 codec on the CPU reference backend: exact bytes, bounds, unbiasedness, error feedback,
// payload checks, size.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "gradcomp/backend.h"
#include "test_util.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

using Encoded = testing::Q4Encoded;

Encoded encode(HostTensor& x, int block, bool stochastic, math::RngKey key,
               const std::vector<float>& residual_in = {}, bool ef = false, int threads = 1) {
  return testing::q2_encode_tensor(x, block, stochastic, key, residual_in, ef, threads);
}

Q4DecodeParams decode_params(const std::vector<const uint8_t*>& ptrs, uint64_t bytes, int64_t numel,
                             int block, HostTensor& out, Segment* seg) {
  *seg = out.segment();
  Q4DecodeParams d;
  d.codec = format::kCodecQ2;
  d.payloads = ptrs.data();
  d.num_payloads = static_cast<int>(ptrs.size());
  d.payload_bytes = bytes;
  d.numel = numel;
  d.block_size = static_cast<uint32_t>(block);
  d.segments = seg;
  d.num_segments = 1;
  d.dtype = testing::code(out.dtype);
  return d;
}

HostTensor decode(const std::vector<const std::vector<uint8_t>*>& payloads, int64_t numel,
                  int block, DType dtype = DType::kFloat32, float divisor = 1.0f) {
  return testing::q2_decode_payloads(payloads, numel, block, dtype, divisor);
}

float step_of_block(const std::vector<uint8_t>& payload, int64_t b) {
  uint16_t s;
  std::memcpy(&s, payload.data() + kPayloadHeaderBytes + 2 * b, 2);
  return math::q2_step_of_scale(s);
}

TEST(Q2, SmallVectorEncodesToTheseBytes) {
  // Absmax 3 gives step 2 (levels -3, -1, 1, 3); nearest rounding, ties away from zero.
  std::vector<float> v = {3, -3, 1, -1, 0, 2, -2, 0.5f, 0, 0, 0, 0, 0, 0, 0, 0};
  HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
  Encoded e = encode(x, 16, false, {0, 0, 0, 0, 0});
  ASSERT_EQ(e.payload.size(), 96u);  // header, 2 scale bytes padded to 16, 4 code bytes to 16
  const format::PayloadHeader h = format::read_header(e.payload.data());
  EXPECT_EQ(h.codec, format::kCodecQ2);
  EXPECT_EQ(h.value_dtype, math::kDtypeBF16);
  EXPECT_EQ(h.count, 1u);
  EXPECT_EQ(h.section0_bytes, 2u);
  EXPECT_EQ(h.section1_bytes, 4u);
  std::vector<uint8_t> body(e.payload.begin() + 64, e.payload.end());
  std::vector<uint8_t> want(32, 0);
  want[0] = 0x00;
  want[1] = 0x40;   // bf16 2.0
  want[16] = 0x63;  // codes 3 0 2 1
  want[17] = 0x8E;  // codes 2 3 0 2
  want[18] = 0xAA;  // zeros: code 2 (+1: nearest ties away from zero)
  want[19] = 0xAA;
  EXPECT_EQ(body, want);
  HostTensor y = decode({&e.payload}, 16, 16);
  const std::vector<float> back = {3, -3, 1, -1, 1, 3, -3, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(y.floats(), back);
}

TEST(Q2, EveryElementWithinOneStepAndHalfAStepNearest) {
  for (DType dtype : kDtypes) {
    for (int block : {16, 64, 256}) {
      for (int64_t n : {1, 13, 257, 4099, 100003}) {
        HostTensor x = HostTensor::from_floats(dtype, testing::normal_floats(n, 11, 3.0f));
        for (bool stochastic : {true, false}) {
          Encoded e = encode(x, block, stochastic, {9, 1, 0, 0, 0});
          HostTensor y = decode({&e.payload}, n, block);
          for (int64_t i = 0; i < n; ++i) {
            const float step = step_of_block(e.payload, i / block);
            const double err = std::fabs(static_cast<double>(y.get(i)) - x.get(i));
            ASSERT_LE(err, stochastic ? step : step / 2) << "element " << i << " n " << n;
          }
        }
      }
    }
  }
}

TEST(Q2, StochasticRoundingIsUnbiased) {
  // Each decode of element i is x_i plus a zero-mean error of variance <= step^2 / 4, so the
  // mean over T = 4000 seeds has standard deviation <= step / (2 sqrt(T)) = step / 126.5; the
  // test allows 5 of those per element (deterministic seeds, so it cannot flake), and for the
  // mean error over all 1024 elements 5 / sqrt(1024) of them. The 2^-16 resolution of the
  // random bits adds at most step / 65536.
  const int64_t n = 1024;
  const int trials = 4000;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 5));
  std::vector<double> mean(n, 0.0);
  std::vector<float> step(n / 64);
  for (int t = 0; t < trials; ++t) {
    Encoded e = encode(x, 64, true, {77, static_cast<uint32_t>(t), 0, 0, 0});
    HostTensor y = decode({&e.payload}, n, 64);
    for (int64_t i = 0; i < n; ++i) mean[i] += y.get(i);
    if (t == 0)
      for (int64_t b = 0; b < n / 64; ++b) step[b] = step_of_block(e.payload, b);
  }
  const double sigma = 1.0 / (2.0 * std::sqrt(static_cast<double>(trials)));
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = (mean[i] / trials - x.get(i)) / step[i / 64];
    ASSERT_LE(std::fabs(err), 5 * sigma + 1.0 / 65536) << "element " << i;
    total += err;
  }
  EXPECT_LE(std::fabs(total / n), 5 * sigma / std::sqrt(static_cast<double>(n)) + 1.0 / 65536);
}

TEST(Q2, ErrorFeedbackCarriesTheResidual) {
  const int64_t n = 1000;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 8));
  std::vector<float> r = testing::normal_floats(n, 9, 0.1f);
  Encoded e = encode(x, 64, true, {1, 2, 3, 4, 0}, r, true);
  HostTensor y = decode({&e.payload}, n, 64);
  for (int64_t i = 0; i < n; ++i) {
    const float acc = x.get(i) + r[i];
    ASSERT_EQ(e.residual[i], acc - y.get(i)) << "element " << i;
  }
  // Over T rounds of the same input, what was sent sums to T x minus the last residual, whose
  // size stays within one step: nothing is lost.
  std::vector<float> residual(n, 0.0f);
  std::vector<double> sent(n, 0.0);
  const int rounds = 50;
  for (int t = 0; t < rounds; ++t) {
    Encoded et = encode(x, 64, true, {1, static_cast<uint32_t>(t), 0, 0, 0}, residual, true);
    HostTensor yt = decode({&et.payload}, n, 64);
    for (int64_t i = 0; i < n; ++i) sent[i] += yt.get(i);
    residual = et.residual;
  }
  for (int64_t i = 0; i < n; ++i)
    ASSERT_NEAR(sent[i] + residual[i], rounds * static_cast<double>(x.get(i)), 1e-3) << i;
  // A non-finite block sends NaN and keeps its old residual.
  x.set(70, std::nanf(""));
  Encoded bad = encode(x, 64, true, {1, 2, 3, 4, 0}, r, true);
  EXPECT_TRUE(std::isnan(step_of_block(bad.payload, 1)));
  for (int64_t i = 64; i < 128; ++i) ASSERT_EQ(bad.residual[i], r[i]);
  HostTensor ybad = decode({&bad.payload}, n, 64);
  for (int64_t i = 64; i < 128; ++i) ASSERT_TRUE(std::isnan(ybad.get(i)));
  EXPECT_FALSE(std::isnan(ybad.get(0)));
}

TEST(Q2, DecodeSumsPayloadsAndThreadsWriteTheSameBytes) {
  const int64_t n = 70001;
  HostTensor a = HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(n, 1));
  HostTensor b = HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(n, 2));
  std::vector<float> r = testing::normal_floats(n, 3, 0.05f);
  Encoded ea = encode(a, 64, true, {4, 0, 0, 0, 0}, r, true);
  Encoded ea2 = encode(a, 64, true, {4, 0, 0, 0, 0}, r, true, 2);
  EXPECT_EQ(ea.payload, ea2.payload);
  EXPECT_EQ(ea.residual, ea2.residual);
  Encoded eb = encode(b, 64, true, {4, 0, 0, 1, 0});
  HostTensor mean = decode({&ea.payload, &eb.payload}, n, 64, DType::kFloat32, 2.0f);
  HostTensor ya = decode({&ea.payload}, n, 64), yb = decode({&eb.payload}, n, 64);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(mean.get(i), (ya.get(i) + yb.get(i)) / 2.0f) << i;
}

TEST(Q2, PayloadIsAtMost2Point5BitsPerElementWithScalesAndHeader) {
  for (int64_t n : {int64_t{100000}, int64_t{1} << 20, int64_t{25000000}}) {
    const double bits = 8.0 * static_cast<double>(q2_payload_bytes(n, 64)) / n;
    EXPECT_LE(bits, 2.5) << n << " elements";
    if (n == 100000) {
      HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 4));
      Encoded e = encode(x, 64, true, {1, 0, 0, 0, 0});
      EXPECT_EQ(e.payload.size(), q2_payload_bytes(n, 64));
      EXPECT_LE(8.0 * e.payload.size() / n, 2.5);
    }
  }
  // 2 bits of code plus 16 of scale per 64 elements, plus the 64-byte header and padding.
  EXPECT_EQ(q2_payload_bytes(1 << 20, 64), 64u + 2 * 16384 + (1 << 18));
}

TEST(Q2, MalformedPayloadsAreRefusedByNameAndNothingIsWritten) {
  const int64_t n = 1000;
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 6));
  Encoded e = encode(x, 64, true, {1, 0, 0, 0, 0});
  auto refused = [&](std::vector<uint8_t> payload, uint64_t bytes, int64_t numel, int block,
                     const char* why) {
    HostTensor out = HostTensor::from_floats(DType::kFloat32, std::vector<float>(n, 7.0f));
    std::vector<const uint8_t*> ptrs = {payload.data()};
    Segment seg;
    Q4DecodeParams d = decode_params(ptrs, bytes, numel, block, out, &seg);
    try {
      cpu::q2_decode(d);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const PayloadError& err) {
      EXPECT_NE(std::string(err.what()).find(why), std::string::npos) << err.what();
    }
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out.get(i), 7.0f);
  };
  const uint64_t size = e.payload.size();
  refused(e.payload, size - 16, n, 64, "shorter than its header says");
  refused(e.payload, size, n - 1, 64, "element count, block size");
  refused(e.payload, size, n, 32, "element count, block size");
  std::vector<uint8_t> flipped = e.payload;
  flipped[100] ^= 4;
  refused(flipped, size, n, 64, "body checksum mismatch");
  std::vector<uint8_t> header = e.payload;
  header[20] ^= 1;
  refused(header, size, n, 64, "header checksum mismatch");
  // A q4 payload of the same elements is not a q2 payload.
  HostTensor x4 = x;
  auto q4 = testing::q4_encode_tensor(x4, 64, true, {1, 0, 0, 0, 0});
  q4.payload.resize(std::max<size_t>(q4.payload.size(), size));
  refused(q4.payload, size, n, 64, "codec differs");
  // A forged header with q4's scale dtype and a valid checksum.
  std::vector<uint8_t> forged = e.payload;
  format::PayloadHeader h = format::read_header(forged.data());
  h.value_dtype = math::kDtypeF32;
  h.checksum = format::header_checksum(h);
  std::memcpy(forged.data(), &h, sizeof h);
  refused(forged, size, n, 64, "dtype");
  // The header reader names q2 payloads.
  const PayloadInfo info = inspect_payload(e.payload.data(), size);
  EXPECT_EQ(info.codec, Codec::kQ2);
  EXPECT_EQ(info.param, 64u);
  EXPECT_EQ(info.count, 16u);
}

TEST(Q2, BackendsDispatchByCodecAndBadParamsAreNamed) {
  auto backend = make_cpu_backend();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(300, 2));
  Encoded direct = encode(x, 64, true, {3, 0, 0, 0, 0});
  std::vector<uint8_t> via(direct.payload.size());
  Segment seg = x.segment();
  Q4EncodeParams p;
  p.codec = format::kCodecQ2;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = 300;
  p.rng = {3, 0, 0, 0, 0};
  p.payload = via.data();
  backend->q4_encode(p);
  EXPECT_EQ(via, direct.payload);
  p.block_size = 48;
  EXPECT_THROW(
      {
        try {
          backend->q4_encode(p);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("power of two in [16, 256]"), std::string::npos);
          throw;
        }
      },
      Error);
  p.block_size = 64;
  p.codec = 9;
  EXPECT_THROW(backend->q4_encode(p), Error);
}

}  // namespace
}  // namespace gradcomp
