// The v2 q2 kernels' index map and arithmetic (kernels/v2/q4_v2_map.h with q2's layout, the q2
// rules of block_v2_codes.cuh) run on the host lane by lane as the kernels run them: every payload
// byte written exactly once, payload, residual and decode-and-mean equal to the CPU reference's.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "test_util.h"
#include "v2/q4_v2_map.h"
#include "v2_block_replay.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;
using testing::v2_replay::Emulated;

const std::vector<int64_t> kSizes = {0,   1,   3,   5,    7,    8,    9,    255,
                                     256, 257, 511, 1000, 4096, 4099, 70001};

// Q2Codes (block_v2_codes.cuh) on the host: q2_quantize_quotient from the fast quotient or the
// division, a lane's 16-bit code half-word padded with zero bits past the end, the bf16 scale
// written by the block's first lane, the checksum terms of those half-words.
struct Q2Rules {
  static constexpr uint8_t kCodec = format::kCodecQ2;
  static constexpr int kCodeBits = 2;
  static BlockLayout layout(uint64_t numel, uint32_t block) { return q2_layout(numel, block); }
  static float step_of_absmax(uint32_t m) { return math::q2_step_from_absmax_bits(m); }
  static float code_of_quotient(float t0, float step, uint32_t r16, bool sr) {
    return math::q2_quantize_quotient(t0, step, r16, sr);
  }
  static float code_of(float x, float step, uint32_t r16, bool sr) {
    return math::q2_quantize_float(x, step, r16, sr);
  }
  static uint32_t bits_of(float code) { return math::q2_code_bits_of(code); }
  static float level_of(float code) { return math::q2_level_of(code); }
  static uint64_t put_codes(Emulated& e, const BlockLayout& l, uint64_t first, int n,
                            uint32_t packed) {
    if (n < kLaneElements) packed &= (1u << (2 * n)) - 1u;  // Q2Codes::pad
    const int bytes = code_byte_count(l, n);
    EXPECT_LE(bytes, 2);
    const uint64_t code_at = code_bytes_at(l, first);
    for (int b = 0; b < bytes; ++b) e.put(code_at + b, static_cast<uint8_t>(packed >> (8 * b)));
    return body_term_at(packed, code_at);
  }
  static uint64_t put_scale(Emulated& e, const BlockLayout& l, uint64_t first, float step) {
    const uint64_t at = l.scales_at + l.scale_bytes * scale_index(l, first);
    const uint16_t bits = math::q2_scale_bits(step);
    e.put(at, static_cast<uint8_t>(bits));
    e.put(at + 1, static_cast<uint8_t>(bits >> 8));
    return body_term_at(bits, at);
  }
  // Codes to levels by q2_code_value_of_bits, times the block's bf16 step.
  static float element_value(const std::vector<uint8_t>& p, const BlockLayout& l, int64_t i) {
    uint16_t scale;
    std::memcpy(&scale, p.data() + l.scales_at + 2 * (i / 64), 2);
    const uint32_t code = (p[code_bytes_at(l, static_cast<uint64_t>(i))] >> (2 * (i & 3))) & 3u;
    return math::mul_rn(math::q2_code_value_of_bits(code), math::q2_step_of_scale(scale));
  }
};

TEST(Q2V2Map, EncodeWritesEveryPayloadByteOnceAndEqualsTheReference) {
  testing::v2_replay::check_encode_equals_reference<Q2Rules>(kSizes, 5, 3);
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
  testing::v2_replay::check_decode_and_mean_equals_reference<Q2Rules>({1, 7, 257, 4099});
}

}  // namespace
}  // namespace gradcomp
