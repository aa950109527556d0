// The v2 block kernels (kernels/v2/block_v2.cuh) replayed on the host lane by lane, shared by the
// q4 and q2 index-map tests: the span, lane, block-absmax and seal walk once, a codec's rules from
// its test's own replay of block_v2_codes.cuh's Q4Codes or Q2Codes.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "test_util.h"
#include "v2/q4_v2_map.h"

namespace gradcomp {
namespace testing {
namespace v2_replay {

using namespace kernels::v2;

struct Emulated {
  std::vector<uint8_t> payload;
  std::vector<int> writes;  // how many times each payload byte was written
  std::vector<float> residual;
  long lanes = 0, fast_lanes = 0;  // lanes that took the fast quotient
  void put(uint64_t at, uint8_t b) {
    payload[at] = b;
    ++writes[at];
  }
};

// A codec's rules as the replay needs them (each test writes its own, mirroring the kernel's):
//   static constexpr uint8_t kCodec; static constexpr int kCodeBits;
//   static BlockLayout layout(uint64_t numel, uint32_t block);
//   static float step_of_absmax(uint32_t absmax_bits);
//   static float code_of_quotient(float t0, float step, uint32_t r16, bool sr);
//   static float code_of(float x, float step, uint32_t r16, bool sr);
//   static uint32_t bits_of(float code);
//   static float level_of(float code);                       // the residual is x - level * step
//   static uint64_t put_codes(Emulated&, const BlockLayout&, uint64_t first, int n,
//                             uint32_t packed);              // returns the checksum term
//   static uint64_t put_scale(Emulated&, const BlockLayout&, uint64_t first, float step);
//   static float element_value(const std::vector<uint8_t>& payload, const BlockLayout&,
//                              int64_t i);                   // level * step, blocks of 64

// The encode kernel's work for each warp span: each lane's accumulated values, the block absmax
// reduced over the lanes that share a block (the kernel's xor shuffles), then each lane's codes
// (from the fast quotient or the division), scale, checksum terms and residual; the last block's
// seal writes the padding and the header.
template <class Codes>
Emulated emulate_encode(const std::vector<float>& x, const std::vector<float>& rin, bool ef,
                        int block, bool stochastic, const math::RngKey& key) {
  const int64_t numel = static_cast<int64_t>(x.size());
  const BlockLayout l = Codes::layout(static_cast<uint64_t>(numel), static_cast<uint32_t>(block));
  Emulated e;
  e.payload.assign(l.total, 0xCD);
  e.writes.assign(l.total, 0);
  if (ef) e.residual.assign(x.size(), 0.0f);
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
      const float step = Codes::step_of_absmax(m);
      const math::Philox4 r = math::random_group(key, first / 8);
      // The kernel's choice: the fast quotient (from the reciprocal; the device starts from its
      // approximation, which the math tests cover) or the division.
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
        const float c = fast
                            ? Codes::code_of_quotient(math::q4_fast_quotient(acc[lane][j], step, y),
                                                      step, r16, stochastic)
                            : Codes::code_of(acc[lane][j], step, r16, stochastic);
        packed |= Codes::bits_of(c) << (Codes::kCodeBits * j);
        if (ef && j < n) {
          const float ri = rin.empty() ? 0.0f : rin[first + j];
          e.residual[first + j] =
              math::is_finite_bits(m)
                  ? math::sub_rn(acc[lane][j], math::mul_rn(Codes::level_of(c), step))
                  : ri;
        }
      }
      sum += Codes::put_codes(e, l, first, n, packed);
      if (lane_writes_scale(l, first, n)) sum += Codes::put_scale(e, l, first, step);
    }
  }
  for (uint64_t i = scale_padding_at(l); i < l.codes_at; ++i) e.put(i, 0);
  for (uint64_t i = l.codes_end; i < l.total; ++i) e.put(i, 0);
  const format::PayloadHeader h = format::with_body_checksum(
      format::make_block_header(Codes::kCodec, static_cast<uint64_t>(numel),
                                static_cast<uint32_t>(block), math::kDtypeF32, stochastic),
      sum);
  uint8_t header[kPayloadHeaderBytes];
  std::memcpy(header, &h, sizeof header);
  for (uint64_t i = 0; i < kPayloadHeaderBytes; ++i) e.put(i, header[i]);
  return e;
}

// Normal values with a block of zeros, a subnormal block (the division path) and a non-finite
// block (its residual is kept, not advanced).
inline std::vector<float> values_with_edges(int64_t n, uint32_t seed) {
  std::vector<float> v = normal_floats(n, seed, 2.0f);
  for (int64_t i = 0; i < n; ++i) {
    if (i >= 64 && i < 128) v[i] = 0.0f;
    if (i >= 128 && i < 192) v[i] = std::ldexp(v[i], -140);
    if (i == 300) v[i] = std::numeric_limits<float>::infinity();
    if (i == 301) v[i] = std::numeric_limits<float>::quiet_NaN();
  }
  return v;
}

// The replayed encode at every block size and size (the large ones at block 64), both roundings,
// with and without error feedback: every payload byte written once, payload and residual equal to
// the CPU reference's; both quotient paths ran (the subnormal block divides, most lanes do not).
// Seeds: values n * value_seed + block, residuals n + residual_seed.
template <class Codes>
void check_encode_equals_reference(const std::vector<int64_t>& sizes, uint32_t value_seed,
                                   uint32_t residual_seed) {
  long lanes = 0, fast_lanes = 0;
  for (int block : {16, 32, 64, 128, 256}) {
    for (int64_t n : sizes) {
      if (n > 5000 && block != 64) continue;
      const std::vector<float> v =
          values_with_edges(n, static_cast<uint32_t>(n * value_seed + block));
      const std::vector<float> rin =
          normal_floats(n, static_cast<uint32_t>(n + residual_seed), 0.1f);
      for (bool stochastic : {true, false}) {
        for (bool ef : {false, true}) {
          const math::RngKey key{0x1234567890ULL, 5, 3, 1, 0};
          Emulated e =
              emulate_encode<Codes>(v, ef ? rin : std::vector<float>{}, ef, block, stochastic, key);
          lanes += e.lanes;
          fast_lanes += e.fast_lanes;
          for (size_t i = 0; i < e.writes.size(); ++i)
            ASSERT_EQ(e.writes[i], 1) << "byte " << i << " n=" << n << " block=" << block;
          HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
          auto ref = block_encode_tensor(Codes::kCodec, x, block, stochastic, key,
                                         ef ? rin : std::vector<float>{}, ef, 1);
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
  EXPECT_GT(fast_lanes, lanes / 2);
  EXPECT_LT(fast_lanes, lanes);
}

// The decode's arithmetic as the kernel runs it (each payload's element value level * step, the
// sum in payload order, then the division or the multiply by the exact inverse) equals the
// reference decode-and-mean, for W = 1..5 payloads of blocks of 64.
template <class Codes>
void check_decode_and_mean_equals_reference(const std::vector<int64_t>& sizes) {
  for (int w : {1, 2, 3, 4, 5}) {
    for (int64_t n : sizes) {
      std::vector<std::vector<uint8_t>> payloads;
      for (int r = 0; r < w; ++r) {
        HostTensor x = HostTensor::from_floats(
            DType::kFloat32, normal_floats(n, static_cast<uint32_t>(r + 10 * n), 1e-3f));
        payloads.push_back(
            block_encode_tensor(Codes::kCodec, x, 64, true, {7, 1, 0, uint32_t(r), 0}, {}, false, 1)
                .payload);
      }
      std::vector<const std::vector<uint8_t>*> ptrs;
      for (auto& p : payloads) ptrs.push_back(&p);
      const float divisor = static_cast<float>(w);
      HostTensor ref = block_decode_payloads(Codes::kCodec, ptrs, n, 64, DType::kFloat32, divisor);
      const BlockLayout l = Codes::layout(static_cast<uint64_t>(n), 64);
      float inverse = 0.0f;
      const bool pow2 = math::pow2_reciprocal(divisor, &inverse);
      for (int64_t i = 0; i < n; ++i) {
        float v = 0.0f;
        for (auto& p : payloads) v = math::add_rn(v, Codes::element_value(p, l, i));
        v = pow2 ? math::mul_rn(v, inverse) : math::div_rn(v, divisor);
        ASSERT_EQ(math::float_bits(v), math::float_bits(ref.get(i))) << "w=" << w << " i=" << i;
      }
    }
  }
}

}  // namespace v2_replay
}  // namespace testing
}  // namespace gradcomp
