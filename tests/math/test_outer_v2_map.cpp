// DiLoCo's outer v2 kernels' index map: every element of a tensor taken by exactly one thread.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "v2/outer_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

// Replays the kernels' loops (groups, then the tail) for every thread of a grid and counts how
// often each element is touched; any element outside [0, n) fails at once.
std::vector<int> coverage(int64_t n, uint32_t blocks, uint32_t threads, bool aligned) {
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (uint32_t b = 0; b < blocks; ++b) {
    for (uint32_t t = 0; t < threads; ++t) {
      const OuterThreadMap m = outer_thread_map(b, threads, t, blocks, n, aligned);
      for (int64_t g = m.first_group; g < m.groups; g += m.stride) {
        for (int j = 0; j < kOuterVec; ++j) {
          const int64_t e = g * kOuterVec + j;
          EXPECT_LT(e, n);
          if (e < n) ++seen[static_cast<size_t>(e)];
        }
      }
      for (int64_t e = m.first_tail; e < n; e += m.stride) ++seen[static_cast<size_t>(e)];
    }
  }
  return seen;
}

TEST(OuterV2Map, EveryElementOnceAtOddSizesAndGrids) {
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 255, 256, 257, 1000, 4099, 100003}) {
    for (uint32_t blocks : {1u, 2u, 3u, 7u}) {
      for (uint32_t threads : {32u, 64u, 256u}) {
        for (bool aligned : {false, true}) {
          const std::vector<int> seen = coverage(n, blocks, threads, aligned);
          for (int64_t e = 0; e < n; ++e)
            ASSERT_EQ(seen[static_cast<size_t>(e)], 1)
                << "element " << e << " of " << n << ", " << blocks << " x " << threads
                << (aligned ? " aligned" : " unaligned");
        }
      }
    }
  }
}

TEST(OuterV2Map, AlignedTensorsGoInGroupsUnalignedOnesSingly) {
  const OuterThreadMap a = outer_thread_map(0, 256, 5, 4, 1003, true);
  EXPECT_EQ(a.groups, 125);
  EXPECT_EQ(a.first_tail, 1000 + 5);
  const OuterThreadMap u = outer_thread_map(0, 256, 5, 4, 1003, false);
  EXPECT_EQ(u.groups, 0);
  EXPECT_EQ(u.first_tail, 5);
}

}  // namespace
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
