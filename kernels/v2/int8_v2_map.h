// The int8 v2 kernels' index map in the aligned layout: which int8 blocks and 16-element chunks
// each warp and lane take. Host and device share it, so host tests prove every element and code
// is covered exactly once, at 16-byte aligned chunks, with each block's lanes inside one warp.
#pragma once

#include "math/philox.h"  // kRandomGroup, which q4_v2_map.h does not include itself
#include "v2/q4_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace int8 {

// A lane's elements in the aligned layout: 16 codes, one 16-byte store.
constexpr uint32_t kChunk = 2 * kLaneElements;

// int8 blocks cut in 16-element chunks, block / 16 lanes per block up to a warp (a larger block is
// one warp's, each lane taking several chunks), so a warp covers whole blocks and every shuffle
// stays inside one block's lanes. Encode runs rounds from warp_first while it is below the run's
// block count (all 32 lanes in every round); decode runs each lane from its own block.
struct ChunkMap {
  uint32_t group_log2;  // lanes per int8 block: 1 << group_log2
  uint32_t steps;       // chunks per lane per block
  uint32_t sub;         // the lane's rank among its block's lanes
  uint32_t group;       // the lane's block among the warp's
  uint64_t warp_first;  // the warp's first block
  uint64_t stride;      // blocks per round of the grid
  GRADCOMP_HD ChunkMap(uint32_t block_log2, uint32_t lane, uint64_t warp, uint64_t warps) {
    group_log2 = block_log2 - 4 < 5 ? block_log2 - 4 : 5;
    steps = 1u << (block_log2 - 4 - group_log2);
    sub = lane & ((1u << group_log2) - 1);
    group = lane >> group_log2;
    const uint32_t per_warp_log2 = 5 - group_log2;
    warp_first = warp << per_warp_log2;
    stride = warps << per_warp_log2;
  }
  // Element offset in the block of step s's chunk.
  GRADCOMP_HD uint32_t chunk(uint32_t s) const { return ((s << group_log2) + sub) * kChunk; }
};

// Int8 blocks a warp covers per round: one in the unaligned layout (a warp per block) or a block
// of 512 elements or more; else 32 / (block / 16).
GRADCOMP_HD uint64_t blocks_per_warp(uint32_t block, bool aligned) {
  return aligned && block < 32 * kChunk ? 32 * kChunk / block : 1;
}

}  // namespace int8
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
