// The end-of-bucket kernels' launch shape, v1's (end_bucket_kernel.cu) and v2's
// (v2/end_bucket_v2_kernels.cu) alike: grid-stride loops over a bounded grid.
#pragma once

#include <cstdint>

#include "params.h"

namespace gradcomp {
namespace kernels {

constexpr int kEndBucketThreads = 256;
// Enough blocks to fill a GPU; a larger bucket is strided over.
constexpr uint64_t kEndBucketMaxBlocks = 1024;

// Blocks for one thread per item, between 1 and kEndBucketMaxBlocks.
inline unsigned end_bucket_blocks_for(uint64_t items) {
  const uint64_t blocks = (items + kEndBucketThreads - 1) / kEndBucketThreads;
  return static_cast<unsigned>(
      blocks < 1 ? 1 : (blocks > kEndBucketMaxBlocks ? kEndBucketMaxBlocks : blocks));
}

// Blocks for an end-of-bucket copy: one thread per 4-byte word of the largest pair.
inline unsigned end_bucket_blocks(const EndBucketParams& p) {
  uint64_t largest = 0;
  for (int i = 0; i < p.num_pairs; ++i)
    largest = p.pairs[i].bytes > largest ? p.pairs[i].bytes : largest;
  return end_bucket_blocks_for((largest + 3) / 4);
}

}  // namespace kernels
}  // namespace gradcomp
