// The int8 v2 kernels' aligned index map (kernels/v2/int8_v2_map.h) run on the host lane by lane
// as the kernels run it: every element of a run (and its code) taken exactly once, whole chunks at
// 16-element offsets (16-byte aligned elements and codes), a block's lanes inside one warp.
#include <gtest/gtest.h>

#include <vector>

#include "v2/int8_v2_map.h"

namespace gradcomp {
namespace {

using kernels::v2::int8::blocks_per_warp;
using kernels::v2::int8::ChunkMap;
using kernels::v2::int8::kChunk;

struct Coverage {
  std::vector<int> taken;       // per element: how many lanes took it
  std::vector<int> block_warp;  // per int8 block: the warp whose lanes took it (-1: none yet)
  bool ok = true;
};

// One lane's share of block b, as encode_aligned and decode_aligned walk it.
void take_block(const ChunkMap& m, uint64_t b, uint64_t warp, uint32_t block_log2, int64_t numel,
                Coverage* c) {
  const int64_t start = static_cast<int64_t>(b << block_log2);
  const int64_t rest = numel - start;
  const uint32_t n = rest < (1 << block_log2) ? static_cast<uint32_t>(rest) : 1u << block_log2;
  if (c->block_warp[b] < 0) c->block_warp[b] = static_cast<int>(warp);
  if (c->block_warp[b] != static_cast<int>(warp)) c->ok = false;
  for (uint32_t s = 0; s < m.steps; ++s) {
    const uint32_t e = m.chunk(s);
    if (e + kChunk <= n) {
      if ((start + e) % kChunk != 0) c->ok = false;  // a 16-byte load or store would be unaligned
      for (uint32_t j = 0; j < kChunk; ++j) ++c->taken[start + e + j];
    } else {
      for (uint32_t i = e; i < n; ++i) ++c->taken[start + i];
    }
  }
}

TEST(Int8V2Map, EveryElementOnceInWholeAlignedChunksWithEachBlockInOneWarp) {
  for (uint32_t log2 = 4; log2 <= 12; ++log2) {
    const uint32_t block = 1u << log2;
    for (int64_t numel : {1, 15, 16, 17, 511, 1000, 4097, 70001}) {
      const uint64_t blocks = (static_cast<uint64_t>(numel) + block - 1) / block;
      const uint64_t per_warp = blocks_per_warp(block, true);
      // The launchers' grid (in warps) and smaller grids that must loop.
      for (uint64_t warps : {(blocks + per_warp - 1) / per_warp, uint64_t{1}, uint64_t{3}}) {
        SCOPED_TRACE(::testing::Message()
                     << "block " << block << " numel " << numel << " warps " << warps);
        Coverage enc{std::vector<int>(numel, 0), std::vector<int>(blocks, -1)};
        Coverage dec = enc;
        for (uint64_t warp = 0; warp < warps; ++warp) {
          for (uint32_t lane = 0; lane < 32; ++lane) {
            const ChunkMap m(log2, lane, warp, warps);
            EXPECT_EQ((m.steps << m.group_log2) * kChunk, block);
            // Encode: rounds bounded by the warp's first block, so all lanes shuffle alike.
            for (uint64_t first = m.warp_first; first < blocks; first += m.stride) {
              if (first + m.group < blocks) take_block(m, first + m.group, warp, log2, numel, &enc);
            }
            for (uint64_t b = m.warp_first + m.group; b < blocks; b += m.stride)
              take_block(m, b, warp, log2, numel, &dec);
          }
        }
        EXPECT_TRUE(enc.ok && dec.ok);
        for (int64_t i = 0; i < numel; ++i) {
          ASSERT_EQ(enc.taken[i], 1) << "encode, element " << i;
          ASSERT_EQ(dec.taken[i], 1) << "decode, element " << i;
        }
      }
    }
  }
}

// The lanes sharing a block are a power-of-two group at an aligned lane offset, so the kernels'
// xor shuffles with offsets below the group size never leave it.
TEST(Int8V2Map, ABlocksLanesAreAnAlignedGroupOfThePowerOfTwoTheShufflesSpan) {
  for (uint32_t log2 = 4; log2 <= 12; ++log2) {
    for (uint32_t lane = 0; lane < 32; ++lane) {
      const ChunkMap m(log2, lane, 0, 1);
      const uint32_t size = 1u << m.group_log2;
      EXPECT_EQ(size, (1u << log2) / kChunk < 32 ? (1u << log2) / kChunk : 32u);
      for (uint32_t offset = size / 2; offset > 0; offset /= 2)
        EXPECT_EQ(ChunkMap(log2, lane ^ offset, 0, 1).group, m.group);
      EXPECT_EQ(m.sub + m.group * size, lane);
    }
  }
}

}  // namespace
}  // namespace gradcomp
