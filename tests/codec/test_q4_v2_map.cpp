// The v2 q4 kernels' index map (kernels/v2/q4_v2_map.h) run on the host lane by lane as the
// kernels run it: every payload and output byte written exactly once, and the bytes equal to the
// CPU reference backend's, stochastic rounding and error feedback included.
#include <gtest/gtest.h>

#include <vector>

#include "test_util.h"
#include "v2/q4_v2_map.h"
#include "v2_block_replay.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;
using testing::v2_replay::Emulated;

const std::vector<int64_t> kSizes = {0, 1, 7, 8, 9, 255, 256, 257, 511, 1000, 4096, 4099, 70001};

// Q4Codes (block_v2_codes.cuh) on the host: fp32 steps, a lane's 8 nibbles in one 32-bit word.
struct Q4Rules {
  static constexpr uint8_t kCodec = format::kCodecQ4;
  static constexpr int kCodeBits = 4;
  static BlockLayout layout(uint64_t numel, uint32_t block) { return q4_layout(numel, block); }
  static float step_of_absmax(uint32_t m) { return math::q4_step_from_absmax_bits(m); }
  static float code_of_quotient(float t0, float step, uint32_t r16, bool sr) {
    return math::q4_quantize_quotient(t0, step, r16, sr);
  }
  static float code_of(float x, float step, uint32_t r16, bool sr) {
    return math::q4_quantize_float(x, step, r16, sr);
  }
  static uint32_t bits_of(float code) { return math::q4_nibble_of(code); }
  static float level_of(float code) { return code; }
  // The lane's code bytes; the checksum term counts only the bytes written.
  static uint64_t put_codes(Emulated& e, const BlockLayout& l, uint64_t first, int n,
                            uint32_t packed) {
    const int bytes = code_byte_count(n);
    const uint64_t code_at = code_bytes_at(l, first);
    for (int b = 0; b < bytes; ++b) e.put(code_at + b, static_cast<uint8_t>(packed >> (8 * b)));
    if (bytes < 4) packed &= (1u << (8 * bytes)) - 1u;
    return n > 0 ? format::body_checksum_term(packed, body_word_index(code_at)) : 0;
  }
  static uint64_t put_scale(Emulated& e, const BlockLayout& l, uint64_t first, float step) {
    const uint64_t s = scale_index(l, first);
    const uint32_t bits = math::float_bits(step);
    for (int b = 0; b < 4; ++b)
      e.put(l.scales_at + 4 * s + b, static_cast<uint8_t>(bits >> (8 * b)));
    return format::body_checksum_term(bits, s);
  }
  static float element_value(const std::vector<uint8_t>& p, const BlockLayout& l, int64_t i) {
    const float step = testing::q4_step_of_block(p, i / 64);
    const uint32_t nibble = (p[code_bytes_at(l, static_cast<uint64_t>(i))] >> (4 * (i & 1))) & 0xFu;
    return math::mul_rn(math::q4_code_value(nibble), step);
  }
};

TEST(Q4V2Map, EncodeWritesEveryPayloadByteOnceAndEqualsTheReference) {
  testing::v2_replay::check_encode_equals_reference<Q4Rules>(kSizes, 7, 1);
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
  testing::v2_replay::check_decode_and_mean_equals_reference<Q4Rules>({1, 257, 4099});
}

}  // namespace
}  // namespace gradcomp
