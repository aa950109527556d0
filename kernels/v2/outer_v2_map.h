// DiLoCo's outer v2 kernels' index map: which elements of a tensor each thread of the grid takes.
#pragma once

#include <stdint.h>

#include "math/float_ops.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// Elements a thread takes per 16-byte group (two float4 of fp32 state, one uint4 of 16-bit
// parameters).
constexpr int kOuterVec = 8;

// Thread g of the grid (stride threads in all) takes groups g, g + stride, ... below `groups`
// (elements [8 * group, 8 * group + 8)), then single elements first_tail, first_tail + stride, ...
// below n. Unaligned tensors have no groups: every element goes singly.
struct OuterThreadMap {
  int64_t first_group, groups, first_tail, stride;
};

GRADCOMP_HD OuterThreadMap outer_thread_map(uint32_t block, uint32_t block_threads, uint32_t thread,
                                            uint32_t blocks, int64_t n, bool aligned) {
  OuterThreadMap m;
  m.stride = static_cast<int64_t>(blocks) * block_threads;
  m.first_group = static_cast<int64_t>(block) * block_threads + thread;
  m.groups = aligned ? n / kOuterVec : 0;
  m.first_tail = m.groups * kOuterVec + m.first_group;
  return m;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
