// DiLoCo's outer v2 kernels' index maps: which elements of a fragment each thread takes.
#pragma once

#include <stdint.h>

#include "math/float_ops.h"
#include "math/half.h"
#include "outer_params.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// Elements a thread takes per 16-byte group (two float4 of fp32 state, one uint4 of 16-bit
// parameters).
constexpr int kOuterVec = 8;

// ---- one flat range of the fp32 state (the step that stores into no tensor) ----

// Thread g of the grid (stride threads in all) takes groups g, g + stride, ... below `groups`
// (elements [8 * group, 8 * group + 8)), then single elements first_tail, first_tail + stride, ...
// below n. An unaligned range has no groups: every element goes singly.
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

// ---- a fragment's tensors of one dtype, concatenated (one launch per operation and dtype) ----

// One tensor in the device table. Its work is `units`: its groups of 8 elements (16-byte
// accesses) first, then its remaining elements singly. A tensor has groups only when its data
// and its stretch of the fp32 state (`offset`) start 16-byte aligned; a launch whose state arrays
// are not 16-byte aligned takes every element singly and counts by `element_begin` instead.
struct OuterTableEntry {
  void* data;
  int64_t numel;
  int64_t offset;         // into the fragment's fp32 state
  int64_t groups;         // numel / 8 when aligned, else 0
  int64_t unit_begin;     // the run's units before this tensor (groups counted as one unit)
  int64_t element_begin;  // the run's elements before this tensor
};

// The tensors of one dtype: entries [first, first + count) of the table, their units and
// elements in all.
struct OuterTableRun {
  int first, count;
  int64_t units, elements;
};
constexpr int kOuterDtypes = 3;  // math::kDtypeF32, kDtypeF16, kDtypeBF16: a run each

// A fragment's table in device memory (built by build_outer_table, uploaded once per layout) and
// its runs, which the launchers read on the host.
struct OuterDeviceTable {
  const OuterTableEntry* entries = nullptr;
  OuterTableRun runs[kOuterDtypes] = {};
};

// Builds the table on the host: `entries` (num_tensors of them) in dtype order, each dtype's
// tensors in fragment order, and runs[d] for dtype code d (count 0: none of that dtype).
inline void build_outer_table(const OuterTensor* tensors, int num_tensors, OuterTableEntry* entries,
                              OuterTableRun (&runs)[kOuterDtypes]) {
  int at = 0;
  for (int d = 0; d < kOuterDtypes; ++d) {
    OuterTableRun& run = runs[d];
    run = OuterTableRun{at, 0, 0, 0};
    for (int i = 0; i < num_tensors; ++i) {
      const OuterTensor& t = tensors[i];
      if (t.dtype != d) continue;
      const bool aligned = (reinterpret_cast<uintptr_t>(t.data) & 15) == 0 && t.offset % 4 == 0;
      const int64_t groups = aligned ? t.numel / kOuterVec : 0;
      entries[at++] = OuterTableEntry{t.data, t.numel, t.offset, groups, run.units, run.elements};
      run.count += 1;
      run.units += t.numel - groups * (kOuterVec - 1);
      run.elements += t.numel;
    }
  }
}

// Where unit u of a run goes: a group of 8 (element, element + 8) or one element of tensor
// `data`, at `state` in the fp32 state. `grouped` false: the launch takes every element singly.
struct OuterUnit {
  void* data;
  int64_t element;
  int64_t state;
  bool group;
};

// The tensor holding unit u is the last entry that starts at or before it (a binary search:
// empty tensors start where the next one does, so none is ever chosen).
GRADCOMP_HD OuterUnit outer_unit_at(const OuterTableEntry* run, int count, int64_t u,
                                    bool grouped) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if ((grouped ? run[mid].unit_begin : run[mid].element_begin) <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const OuterTableEntry& t = run[lo];
  const int64_t groups = grouped ? t.groups : 0;
  const int64_t local = u - (grouped ? t.unit_begin : t.element_begin);
  OuterUnit w;
  w.data = t.data;
  w.group = local < groups;
  w.element = w.group ? local * kOuterVec : groups * kOuterVec + (local - groups);
  w.state = t.offset + w.element;
  return w;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
