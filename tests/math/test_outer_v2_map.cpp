// DiLoCo's outer v2 kernels' index maps: every element of a fragment taken by exactly one thread.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
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

// ---- the table of a fragment's tensors ----

// A fragment's tensor as a test writes it: dtype, size, and how many bytes its data sits past a
// 16-byte boundary (the addresses are never dereferenced).
struct TestTensor {
  uint8_t dtype;
  int64_t numel;
  int skew_bytes;
};

struct Table {
  std::vector<OuterTensor> tensors;
  std::vector<OuterTableEntry> entries;
  OuterTableRun runs[kOuterDtypes];
};

Table make_table(const std::vector<TestTensor>& spec) {
  Table t;
  int64_t offset = 0;
  for (size_t i = 0; i < spec.size(); ++i) {
    OuterTensor x;
    x.data = reinterpret_cast<void*>(static_cast<uintptr_t>((i + 1) << 24) + spec[i].skew_bytes);
    x.numel = spec[i].numel;
    x.offset = offset;
    x.dtype = spec[i].dtype;
    offset += spec[i].numel;
    t.tensors.push_back(x);
  }
  t.entries.resize(spec.size());
  build_outer_table(t.tensors.data(), static_cast<int>(spec.size()), t.entries.data(), t.runs);
  return t;
}

// Replays the table kernels' loop (every unit of every dtype's run, each thread of a grid) and
// counts how often each element of the fragment's fp32 state is touched; checks that each unit
// names the tensor that holds its state elements, stays inside it, and goes in 16 bytes only
// where the tensor's data and state are 16-byte aligned. Gives the touches and the groups.
void table_coverage(const Table& t, uint32_t blocks, uint32_t threads, bool grouped,
                    std::vector<int>* touched, int64_t* groups_taken, const std::string& what) {
  int64_t numel = 0;
  for (const OuterTensor& x : t.tensors) numel += x.numel;
  std::vector<int>& seen = *touched;
  seen.assign(static_cast<size_t>(numel), 0);
  *groups_taken = 0;
  for (int d = 0; d < kOuterDtypes; ++d) {
    const OuterTableRun& run = t.runs[d];
    if (run.count == 0) continue;
    const int64_t total = grouped ? run.units : run.elements;
    const int64_t stride = static_cast<int64_t>(blocks) * threads;
    for (int64_t g = 0; g < stride; ++g) {
      for (int64_t u = g; u < total; u += stride) {
        const OuterUnit w = outer_unit_at(t.entries.data() + run.first, run.count, u, grouped);
        const OuterTensor* owner = nullptr;
        for (const OuterTensor& x : t.tensors)
          if (x.data == w.data) owner = &x;
        ASSERT_NE(owner, nullptr) << what << ": unit " << u << " names no tensor";
        EXPECT_EQ(owner->dtype, d) << what << ": unit " << u << " of another dtype's run";
        const int n = w.group ? kOuterVec : 1;
        ASSERT_GE(w.element, 0) << what;
        ASSERT_LE(w.element + n, owner->numel)
            << what << ": unit " << u << " runs past its tensor of " << owner->numel;
        ASSERT_EQ(w.state, owner->offset + w.element) << what;
        if (w.group) {
          ++*groups_taken;
          EXPECT_TRUE(grouped) << what;
          EXPECT_EQ(reinterpret_cast<uintptr_t>(w.data) % 16, 0u) << what;
          EXPECT_EQ(w.state % 4, 0) << what << ": a group's state is not 16-byte aligned";
        }
        for (int j = 0; j < n; ++j) ++seen[static_cast<size_t>(w.state + j)];
      }
    }
  }
}

void expect_every_element_once(const std::vector<TestTensor>& spec, const std::string& name) {
  const Table t = make_table(spec);
  int64_t aligned_groups = 0;
  for (const OuterTensor& x : t.tensors)
    if (reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.offset % 4 == 0)
      aligned_groups += x.numel / kOuterVec;
  for (uint32_t blocks : {1u, 3u, 8u}) {
    for (uint32_t threads : {32u, 256u}) {
      for (bool grouped : {true, false}) {
        const std::string what = name + ", " + std::to_string(blocks) + " x " +
                                 std::to_string(threads) + (grouped ? " grouped" : " singly");
        int64_t groups = 0;
        std::vector<int> seen;
        table_coverage(t, blocks, threads, grouped, &seen, &groups, what);
        if (::testing::Test::HasFatalFailure()) return;
        for (size_t e = 0; e < seen.size(); ++e)
          ASSERT_EQ(seen[e], 1) << what << ": state element " << e;
        // The 16-byte accesses are kept wherever the tensor allows them.
        EXPECT_EQ(groups, grouped ? aligned_groups : 0) << what;
      }
    }
  }
}

constexpr uint8_t kF32 = math::kDtypeF32, kF16 = math::kDtypeF16, kBF16 = math::kDtypeBF16;

TEST(OuterV2TableMap, EveryElementOfEveryTensorOnceOneDtype) {
  expect_every_element_once({{kF32, 1}}, "one element");
  expect_every_element_once({{kF32, 4096}}, "one aligned tensor");
  expect_every_element_once({{kF32, 8}, {kF32, 8}, {kF32, 16}}, "whole groups");
  expect_every_element_once({{kF32, 5}, {kF32, 61}, {kF32, 200}, {kF32, 1003}}, "odd sizes");
  expect_every_element_once({{kF16, 7}, {kF16, 9}, {kF16, 4099}}, "fp16, odd");
}

TEST(OuterV2TableMap, EmptyTensorsAnywhereTakeNothing) {
  expect_every_element_once({{kF32, 0}, {kF32, 17}, {kF32, 0}, {kF32, 0}, {kF32, 64}, {kF32, 0}},
                            "empty first, between and last");
  expect_every_element_once({{kBF16, 0}, {kF16, 33}, {kBF16, 0}}, "a run of empty tensors only");
}

TEST(OuterV2TableMap, UnalignedAndMixedAlignmentInOneTable) {
  // Data past a 16-byte boundary (by one or three elements), state offsets that leave it
  // (sizes not multiples of 4 before), and aligned ones between: one table, one launch a dtype.
  expect_every_element_once({{kF32, 100, 4}, {kF32, 64, 0}, {kF32, 3, 12}, {kF32, 96, 0}},
                            "fp32 skewed data");
  expect_every_element_once({{kF32, 5}, {kF32, 64}, {kF32, 3}, {kF32, 32}, {kF32, 9}},
                            "fp32 offsets in and out of alignment");
  expect_every_element_once(
      {{kBF16, 777, 2}, {kF16, 32, 0}, {kF32, 100003, 0}, {kBF16, 24, 0}, {kF16, 61, 6}},
      "every dtype, mixed alignment");
}

TEST(OuterV2TableMap, ManyTensorsOfEveryDtype) {
  // As a model's hundreds of parameters: sizes from 1 to a few thousand, every dtype interleaved,
  // every fourth tensor skewed.
  std::vector<TestTensor> spec;
  for (int i = 0; i < 300; ++i) {
    const uint8_t dtype = static_cast<uint8_t>(i % 3);
    const int64_t numel = (i * 37) % 211 + (i % 7 == 0 ? 1024 : 0) + (i % 11 == 0 ? 0 : 1);
    spec.push_back({dtype, numel, i % 4 == 3 ? static_cast<int>(math::dtype_bytes(dtype)) : 0});
  }
  expect_every_element_once(spec, "300 tensors");
}

TEST(OuterV2TableMap, TableGroupsByDtypeInFragmentOrder) {
  // State offsets 0, 16, 26, 29, 37; all data 16-byte aligned.
  const Table t = make_table({{kF32, 16}, {kBF16, 10}, {kF32, 3}, {kBF16, 8}, {kF16, 0}});
  const OuterTableRun& f32 = t.runs[kF32];
  EXPECT_EQ(f32.first, 0);
  EXPECT_EQ(f32.count, 2);
  EXPECT_EQ(f32.elements, 19);
  EXPECT_EQ(f32.units, 2 + 3);  // two groups, then 3 singly
  EXPECT_EQ(t.entries[1].data, t.tensors[2].data);
  EXPECT_EQ(t.entries[1].unit_begin, 2);
  EXPECT_EQ(t.entries[1].element_begin, 16);
  EXPECT_EQ(t.runs[kF16].first, 2);
  EXPECT_EQ(t.runs[kF16].count, 1);
  EXPECT_EQ(t.runs[kF16].units, 0);
  const OuterTableRun& bf16 = t.runs[kBF16];
  EXPECT_EQ(bf16.first, 3);
  EXPECT_EQ(bf16.count, 2);
  EXPECT_EQ(t.entries[3].groups, 1);  // 10 at offset 16: one group, 2 singly
  EXPECT_EQ(t.entries[4].groups, 0);  // 8 at offset 29: the state is not 16-byte aligned
  EXPECT_EQ(bf16.units, 3 + 8);
  EXPECT_EQ(bf16.elements, 18);
}

}  // namespace
}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
