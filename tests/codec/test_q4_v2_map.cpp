// The v2 q4 kernels' index map (kernels/v2/q4_v2_map.h) run on the host lane by lane as the
// kernels run it: every payload and output byte written exactly once, and the bytes equal to the
// CPU reference backend's, stochastic rounding and error feedback included.
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

const int64_t kSizes[] = {0, 1, 7, 8, 9, 255, 256, 257, 511, 1000, 4096, 4099, 70001};

struct Emulated {
  std::vector<uint8_t> payload;
  std::vector<int> writes;  // how many times each payload byte was written
  std::vector<float> residual;
  long lanes = 0, fast_lanes = 0;  // lanes that took the fast quotient
};

// The encode kernel's work for one lane group: each warp span's lanes, the block absmax reduced
// over the lanes_per_block lanes that share a block (the kernel's xor shuffles), then each lane's
// codes, scale, checksum terms and residual; the last block's seal writes padding and header.
Emulated emulate_encode(const std::vector<float>& x, const std::vector<float>& rin, bool ef,
                        int block, bool stochastic, const math::RngKey& key) {
  const int64_t numel = static_cast<int64_t>(x.size());
  const BlockLayout l = q4_layout(static_cast<uint64_t>(numel), static_cast<uint32_t>(block));
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
      const float step = math::q4_step_from_absmax_bits(m);
      const math::Philox4 r = math::random_group(key, (first) / 8);
      // The kernel's choice: the fast quotient (from the reciprocal; the device starts from its
      // approximation, which the math tests cover) or the division.
      uint32_t key = 0xFFFFFFFFu;
      for (int j = 0; j < kLaneElements; ++j)
        key = std::min(key, math::q4_dividend_key(math::abs_bits(acc[lane][j])));
      const bool fast = math::q4_fast_step(step) && math::q4_fast_dividends(key);
      e.fast_lanes += fast;
      ++e.lanes;
      const float y = math::q4_refine_reciprocal(step, math::div_rn(1.0f, step));
      uint32_t packed = 0;
      for (int j = 0; j < kLaneElements; ++j) {
        const uint32_t r16 = math::random16(r, j);
        const float q =
            fast ? math::q4_quantize_quotient(math::q4_fast_quotient(acc[lane][j], step, y), step,
                                              r16, stochastic)
                 : math::q4_quantize_float(acc[lane][j], step, r16, stochastic);
        packed |= math::q4_nibble_of(q) << (4 * j);
        if (ef && j < n) {
          const float ri = rin.empty() ? 0.0f : rin[first + j];
          e.residual[first + j] =
              math::is_finite_bits(m) ? math::sub_rn(acc[lane][j], math::mul_rn(q, step)) : ri;
        }
      }
      const int bytes = code_byte_count(n);
      const uint64_t code_at = code_bytes_at(l, first);
      for (int b = 0; b < bytes; ++b) put(code_at + b, static_cast<uint8_t>(packed >> (8 * b)));
      if (bytes < 4) packed &= (1u << (8 * bytes)) - 1u;
      if (n > 0) sum += format::body_checksum_term(packed, body_word_index(code_at));
      if (lane_writes_scale(l, first, n)) {
        const uint64_t s = scale_index(l, first);
        uint32_t bits = math::float_bits(step);
        for (int b = 0; b < 4; ++b)
          put(l.scales_at + 4 * s + b, static_cast<uint8_t>(bits >> (8 * b)));
        sum += format::body_checksum_term(bits, s);
      }
    }
  }
  for (uint64_t i = scale_padding_at(l); i < l.codes_at; ++i) put(i, 0);
  for (uint64_t i = l.codes_end; i < l.total; ++i) put(i, 0);
  const format::PayloadHeader h = format::with_body_checksum(
      format::make_q4_header(static_cast<uint64_t>(numel), static_cast<uint32_t>(block),
                             math::kDtypeF32, stochastic),
      sum);
  uint8_t header[kPayloadHeaderBytes];
  std::memcpy(header, &h, sizeof header);
  for (uint64_t i = 0; i < kPayloadHeaderBytes; ++i) put(i, header[i]);
  return e;
}

std::vector<float> values_with_edges(int64_t n, uint32_t seed) {
  std::vector<float> v = testing::normal_floats(n, seed, 2.0f);
  // A block of zeros, a subnormal block, a non-finite block (its residual is kept, not advanced).
  for (int64_t i = 0; i < n; ++i) {
    if (i >= 64 && i < 128) v[i] = 0.0f;
    if (i >= 128 && i < 192) v[i] = std::ldexp(v[i], -140);
    if (i == 300) v[i] = std::numeric_limits<float>::infinity();
    if (i == 301) v[i] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

TEST(Q4V2Map, EncodeWritesEveryPayloadByteOnceAndEqualsTheReference) {
  long lanes = 0, fast_lanes = 0;
  for (int block : {16, 32, 64, 128, 256}) {
    for (int64_t n : kSizes) {
      if (n > 5000 && block != 64) continue;
      const std::vector<float> v = values_with_edges(n, static_cast<uint32_t>(n * 7 + block));
      const std::vector<float> rin = testing::normal_floats(n, static_cast<uint32_t>(n + 1), 0.1f);
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
          auto ref = testing::q4_encode_tensor(x, block, stochastic, key,
                                               ef ? rin : std::vector<float>{}, ef);
          ASSERT_EQ(e.payload, ref.payload)
              << "n=" << n << " block=" << block << " stochastic=" << stochastic << " ef=" << ef;
          if (ef && !v.empty()) {  // memcmp takes no null pointer, even for 0 bytes
            ASSERT_EQ(0, std::memcmp(e.residual.data(), ref.residual.data(), 4 * v.size()))
                << "residual n=" << n << " block=" << block;
          }
        }
      }
    }
  }
  // Both quotient paths ran: the subnormal block divides, the others take the fast quotient.
  EXPECT_GT(fast_lanes, lanes / 2);
  EXPECT_LT(fast_lanes, lanes);
}

// A mutation the map must catch: the block's lanes reduced over one lane too few.
TEST(Q4V2Map, LanesOfABlockCoverExactlyTheBlock) {
  for (int block : {16, 32, 64, 128, 256}) {
    const BlockLayout l = q4_layout(4096, static_cast<uint32_t>(block));
    const int lanes_per_block = 1 << (l.log2_block - 3);
    EXPECT_EQ(lanes_per_block * kLaneElements, block);
    for (int lane = 0; lane < kWarpLanes; ++lane) {
      const uint64_t first = lane_first(3, lane);
      const int group = lane & ~(lanes_per_block - 1);
      EXPECT_EQ(scale_index(l, lane_first(3, group)), scale_index(l, first));
      EXPECT_EQ(lane_writes_scale(l, first, kLaneElements), lane == group);
    }
  }
}

// The decoders' fp32 stores: two rounds of 16 bytes a lane cover a span's 256 elements once,
// and each round's 32 stores are 512 contiguous bytes.
TEST(Q4V2Map, DecodeStoresCoverEverySpanElementOnce) {
  for (uint64_t span : {0ull, 1ull, 977ull}) {
    std::vector<int> seen(kSpanElements, 0);
    for (int round = 0; round < 2; ++round) {
      for (int lane = 0; lane < kWarpLanes; ++lane) {
        const uint64_t first = fp32_store_first(span, lane, round);
        EXPECT_EQ(first, fp32_store_first(span, 0, round) + 4 * lane);
        for (int j = 0; j < 4; ++j) ++seen[first + j - span * kSpanElements];
      }
    }
    for (int s : seen) EXPECT_EQ(s, 1);
  }
}

// The decode's arithmetic as the kernel runs it (sum in payload order, then the division or the
// multiply by the exact inverse) equals the reference decode-and-mean.
TEST(Q4V2Map, DecodeAndMeanEqualsTheReference) {
  for (int w : {1, 2, 3, 4, 5}) {
    for (int64_t n : {1, 257, 4099}) {
      std::vector<std::vector<uint8_t>> payloads;
      for (int r = 0; r < w; ++r) {
        HostTensor x = HostTensor::from_floats(
            DType::kFloat32, testing::normal_floats(n, static_cast<uint32_t>(r + 10 * n), 1e-3f));
        payloads.push_back(
            testing::q4_encode_tensor(x, 64, true, {7, 1, 0, uint32_t(r), 0}).payload);
      }
      std::vector<const std::vector<uint8_t>*> ptrs;
      for (auto& p : payloads) ptrs.push_back(&p);
      const float divisor = static_cast<float>(w);
      HostTensor ref = testing::q4_decode_payloads(ptrs, n, 64, DType::kFloat32, divisor);
      const BlockLayout l = q4_layout(static_cast<uint64_t>(n), 64);
      float inverse = 0.0f;
      const bool pow2 = math::pow2_reciprocal(divisor, &inverse);
      for (int64_t i = 0; i < n; ++i) {
        float v = 0.0f;
        for (auto& p : payloads) {
          const float step = testing::q4_step_of_block(p, i / 64);
          const uint32_t nibble =
              (p[code_bytes_at(l, static_cast<uint64_t>(i))] >> (4 * (i & 1))) & 0xFu;
          v = math::add_rn(v, math::mul_rn(math::q4_code_value(nibble), step));
        }
        v = pow2 ? math::mul_rn(v, inverse) : math::div_rn(v, divisor);
        ASSERT_EQ(math::float_bits(v), math::float_bits(ref.get(i))) << "w=" << w << " i=" << i;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
