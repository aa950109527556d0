// The v2 q2 kernels' index map and arithmetic (kernels/v2/q4_v2_map.h with q2's layout, the q2
// rules of block_v2_codes.cuh) run on the host lane by lane as the kernels run them: every payload
// byte written exactly once, payload, residual and decode-and-mean equal to the CPU reference's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "test_util.h"
#include "v2/q4_v2_map.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;
using testing::HostTensor;

const int64_t kSizes[] = {0, 1, 3, 5, 7, 8, 9, 255, 256, 257, 511, 1000, 4096, 4099, 70001};

struct Emulated {
  std::vector<uint8_t> payload;
  std::vector<int> writes;  // how many times each payload byte was written
  std::vector<float> residual;
  long lanes = 0, fast_lanes = 0;
};

// The encode kernel's work (block_v2.cuh's encode_lane with Q2Codes): the block absmax over the
// lanes that share it, each lane's codes (q2_quantize_quotient from the fast quotient or the
// division), its 16-bit code half-word padded with zero bits past the end, the bf16 scale written
// by the block's first lane, the checksum terms of those half-words, the residuals; then the seal.
Emulated emulate_encode(const std::vector<float>& x, const std::vector<float>& rin, bool ef,
                        int block, bool stochastic, const math::RngKey& key) {
  const int64_t numel = static_cast<int64_t>(x.size());
  const BlockLayout l = q2_layout(static_cast<uint64_t>(numel), static_cast<uint32_t>(block));
  Emulated e;
  e.payload.assign(l.total, 0xCD);
  e.writes.assign(l.total, 0);
  if (ef) e.residual.assign(x.size(), 0.0f);
  auto put = [&](uint64_t at, uint8_t b) {
    e.payload[at] = b;
    ++e.writes[at];
  };
  const int lanes_per_block = 1 << (l.log2_block - 3);
  uint64_t sum = 0;
  for (uint64_t span = 0; span < num_spans(static_cast<uint64_t>(numel)); ++span) {
    float acc[kWarpLanes][kLaneElements];
    uint32_t absmax[kWarpLanes];
    for (int lane = 0; lane < kWarpLanes; ++lane) {
      const uint64_t first = lane_first(span, lane);
      const int n = lane_count(static_cast<uint64_t>(numel), first);
      absmax[lane] = 0;
      for (int j = 0; j < kLaneElements; ++j) {
        const float xi = j < n ? x[first + j] : 0.0f;
        const float ri = j < n && !rin.empty() ? rin[first + j] : 0.0f;
        acc[lane][j] = math::add_rn(xi, ri);
        if (j < n) absmax[lane] = std::max(absmax[lane], math::abs_bits(acc[lane][j]));
      }
    }
    for (int lane = 0; lane < kWarpLanes; ++lane) {
      const uint64_t first = lane_first(span, lane);
      const int n = lane_count(static_cast<uint64_t>(numel), first);
      uint32_t m = 0;
      const int group = lane & ~(lanes_per_block - 1);
      for (int o = group; o < group + std::min(lanes_per_block, kWarpLanes); ++o)
        m = std::max(m, absmax[o]);
      const float step = math::q2_step_from_absmax_bits(m);
      const math::Philox4 r = math::random_group(key, first / 8);
      uint32_t dkey = 0xFFFFFFFFu;
      for (int j = 0; j < kLaneElements; ++j)
        dkey = std::min(dkey, math::q4_dividend_key(math::abs_bits(acc[lane][j])));
      const bool fast = math::q4_fast_step(step) && math::q4_fast_dividends(dkey);
      e.fast_lanes += fast;
      ++e.lanes;
      const float y = math::q4_refine_reciprocal(step, math::div_rn(1.0f, step));
      uint32_t packed = 0;
      for (int j = 0; j < kLaneElements; ++j) {
        const uint32_t r16 = math::random16(r, j);
        const float c =
            fast ? math::q2_quantize_quotient(math::q4_fast_quotient(acc[lane][j], step, y), step,
                                              r16, stochastic)
                 : math::q2_quantize_float(acc[lane][j], step, r16, stochastic);
        packed |= math::q2_code_bits_of(c) << (2 * j);
        if (ef && j < n) {
          const float ri = rin.empty() ? 0.0f : rin[first + j];
          e.residual[first + j] =
              math::is_finite_bits(m)
                  ? math::sub_rn(acc[lane][j], math::mul_rn(math::q2_level_of(c), step))
                  : ri;
        }
      }
      if (n < kLaneElements) packed &= (1u << (2 * n)) - 1u;  // Q2Codes::pad
      const int bytes = code_byte_count(l, n);
      EXPECT_LE(bytes, 2);
      const uint64_t code_at = code_bytes_at(l, first);
      for (int b = 0; b < bytes; ++b) put(code_at + b, static_cast<uint8_t>(packed >> (8 * b)));
      sum += body_term_at(packed, code_at);
      if (lane_writes_scale(l, first, n)) {
        const uint64_t at = l.scales_at + l.scale_bytes * scale_index(l, first);
        const uint16_t bits = math::q2_scale_bits(step);
        put(at, static_cast<uint8_t>(bits));
        put(at + 1, static_cast<uint8_t>(bits >> 8));
        sum += body_term_at(bits, at);
      }
    }
  }
  for (uint64_t i = scale_padding_at(l); i < l.codes_at; ++i) put(i, 0);
  for (uint64_t i = l.codes_end; i < l.total; ++i) put(i, 0);
  const format::PayloadHeader h = format::with_body_checksum(
      format::make_q2_header(static_cast<uint64_t>(numel), static_cast<uint32_t>(block),
                             math::kDtypeF32, stochastic),
      sum);
  uint8_t header[kPayloadHeaderBytes];
  std::memcpy(header, &h, sizeof header);
  for (uint64_t i = 0; i < kPayloadHeaderBytes; ++i) put(i, header[i]);
  return e;
}

std::vector<float> values_with_edges(int64_t n, uint32_t seed) {
  std::vector<float> v = testing::normal_floats(n, seed, 2.0f);
  // A block of zeros, a subnormal block (the division path), a non-finite block.
  for (int64_t i = 0; i < n; ++i) {
    if (i >= 64 && i < 128) v[i] = 0.0f;
    if (i >= 128 && i < 192) v[i] = std::ldexp(v[i], -140);
    if (i == 300) v[i] = std::numeric_limits<float>::infinity();
    if (i == 301) v[i] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

TEST(Q2V2Map, EncodeWritesEveryPayloadByteOnceAndEqualsTheReference) {
  long lanes = 0, fast_lanes = 0;
  for (int block : {16, 32, 64, 128, 256}) {
    for (int64_t n : kSizes) {
      if (n > 5000 && block != 64) continue;
      const std::vector<float> v = values_with_edges(n, static_cast<uint32_t>(n * 5 + block));
      const std::vector<float> rin = testing::normal_floats(n, static_cast<uint32_t>(n + 3), 0.1f);
      for (bool stochastic : {true, false}) {
        for (bool ef : {false, true}) {
          const math::RngKey key{0x1234567890ULL, 5, 3, 1, 0};
          Emulated e =
              emulate_encode(v, ef ? rin : std::vector<float>{}, ef, block, stochastic, key);
          lanes += e.lanes;
          fast_lanes += e.fast_lanes;
          for (size_t i = 0; i < e.writes.size(); ++i)
            ASSERT_EQ(e.writes[i], 1) << "byte " << i << " n=" << n << " block=" << block;
          HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
          auto ref = testing::q2_encode_tensor(x, block, stochastic, key,
                                               ef ? rin : std::vector<float>{}, ef);
          ASSERT_EQ(e.payload, ref.payload)
              << "n=" << n << " block=" << block << " stochastic=" << stochastic << " ef=" << ef;
          if (ef && !v.empty()) {
            ASSERT_EQ(0, std::memcmp(e.residual.data(), ref.residual.data(), 4 * v.size()))
                << "residual n=" << n << " block=" << block;
          }
        }
      }
    }
  }
  EXPECT_GT(fast_lanes, lanes / 2);
  EXPECT_LT(fast_lanes, lanes);
}

TEST(Q2V2Map, LayoutIsTheQ2Header) {
  for (int64_t n : kSizes) {
    const BlockLayout l = q2_layout(static_cast<uint64_t>(n), 64);
    const format::PayloadHeader h = format::make_q2_header(static_cast<uint64_t>(n), 64, 0, false);
    EXPECT_EQ(l.total, q2_payload_bytes(n, 64));
    EXPECT_EQ(l.codes_at, format::section1_offset(h));
    EXPECT_EQ(l.codes_end - l.codes_at, static_cast<uint64_t>((n + 3) / 4));
    EXPECT_EQ(scale_padding_at(l), kPayloadHeaderBytes + 2 * h.count);
    // A full lane's codes are one aligned half-word, inside one body word.
    for (int lane = 0; lane < kWarpLanes; ++lane)
      EXPECT_EQ(code_bytes_at(l, lane_first(1, lane)) % 2, 0u);
  }
}

// The decode's arithmetic as the kernel runs it (block_v2.cuh's decode_lane with Q2Codes: codes
// to levels by q2_code_value_of_bits, sum in payload order, then the division or the exact
// inverse) equals the reference decode-and-mean.
TEST(Q2V2Map, DecodeAndMeanEqualsTheReference) {
  for (int w : {1, 2, 3, 4, 5}) {
    for (int64_t n : {1, 7, 257, 4099}) {
      std::vector<std::vector<uint8_t>> payloads;
      for (int r = 0; r < w; ++r) {
        HostTensor x = HostTensor::from_floats(
            DType::kFloat32, testing::normal_floats(n, static_cast<uint32_t>(r + 10 * n), 1e-3f));
        payloads.push_back(
            testing::q2_encode_tensor(x, 64, true, {7, 1, 0, uint32_t(r), 0}).payload);
      }
      std::vector<const std::vector<uint8_t>*> ptrs;
      for (auto& p : payloads) ptrs.push_back(&p);
      const float divisor = static_cast<float>(w);
      HostTensor ref = testing::q2_decode_payloads(ptrs, n, 64, DType::kFloat32, divisor);
      const BlockLayout l = q2_layout(static_cast<uint64_t>(n), 64);
      float inverse = 0.0f;
      const bool pow2 = math::pow2_reciprocal(divisor, &inverse);
      for (int64_t i = 0; i < n; ++i) {
        float v = 0.0f;
        for (auto& p : payloads) {
          uint16_t scale;
          std::memcpy(&scale, p.data() + l.scales_at + 2 * (i / 64), 2);
          const uint32_t code =
              (p[code_bytes_at(l, static_cast<uint64_t>(i))] >> (2 * (i & 3))) & 3u;
          v = math::add_rn(
              v, math::mul_rn(math::q2_code_value_of_bits(code), math::q2_step_of_scale(scale)));
        }
        v = pow2 ? math::mul_rn(v, inverse) : math::div_rn(v, divisor);
        ASSERT_EQ(math::float_bits(v), math::float_bits(ref.get(i))) << "w=" << w << " i=" << i;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
