// The index maps and small decisions of the v2 top-k kernels, host and device, so that host tests
// can prove them before a device runs them (tests/math/test_topk_v2_map.cpp).
#pragma once

#include "math/topk_math.h"
#include "payload_header.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// ---- encode: tiles of the ordered compaction ------------------------------------------------

// A compaction tile is kTopKThreads threads of kTopKItems consecutive elements each (blocked).
constexpr int kTopKThreads = 256;
constexpr int kTopKItems = 8;
constexpr int64_t kTopKTile = int64_t{kTopKThreads} * kTopKItems;

GRADCOMP_HD int64_t topk_tiles(int64_t numel) {
  return numel <= 0 ? 0 : (numel + kTopKTile - 1) / kTopKTile;
}
// First element of thread `t` of tile `tile`, and how many of its kTopKItems exist (0 to 8).
GRADCOMP_HD int64_t topk_thread_first(int64_t tile, int t) {
  return tile * kTopKTile + int64_t{t} * kTopKItems;
}
GRADCOMP_HD int topk_thread_count(int64_t numel, int64_t first) {
  const int64_t left = numel - first;
  return left <= 0 ? 0 : (left < kTopKItems ? static_cast<int>(left) : kTopKItems);
}

// The scan value of one element against threshold key T: (greater) << 32 | (equal). Both
// counts stay below 2^31 (a bucket has fewer elements), so the packed sums never carry.
GRADCOMP_HD uint64_t topk_count_pair(uint32_t key, uint32_t threshold) {
  return (key > threshold ? (uint64_t{1} << 32) : 0) + (key == threshold ? 1 : 0);
}
// Payload position of an element with `gt` greater and `eq` equal keys before it (v1's rule).
GRADCOMP_HD uint64_t topk_position(uint64_t gt, uint64_t eq, uint64_t eq_limit) {
  return gt + (eq < eq_limit ? eq : eq_limit);
}
// Entries a payload holds once the totals are known.
GRADCOMP_HD uint64_t topk_entry_count(uint64_t total_pair, uint64_t eq_limit, uint32_t capacity) {
  const uint64_t eq = total_pair & 0xFFFFFFFFu;
  const uint64_t c = (total_pair >> 32) + (eq < eq_limit ? eq : eq_limit);
  return c < capacity ? c : capacity;
}

// The body-checksum terms (format::body_checksum_term) an entry at payload position `pos`
// contributes: its index word, and its value's bits in the value word (fp32: one word each;
// fp16/bf16: half of a word, the low half for even positions). The terms are linear in the
// word, so the halves of a shared word add on their own; zero words add nothing.
// `value_word0` = (section1_offset - 64) / 4.
GRADCOMP_HD uint64_t topk_entry_checksum(uint32_t index, uint64_t pos, uint32_t value_bits,
                                         uint8_t value_dtype, uint64_t value_word0) {
  uint64_t sum = format::body_checksum_term(index, pos);
  if (value_dtype == math::kDtypeF32) {
    sum += format::body_checksum_term(value_bits, value_word0 + pos);
  } else {
    sum += format::body_checksum_term((value_bits & 0xFFFFu) << (16 * (pos & 1)),
                                      value_word0 + (pos >> 1));
  }
  return sum;
}

// TopKEncodeParams::nan_head: a set flag reads element 0 of the range (relative to `begin`) as
// this value before the residual is added, the quiet NaN the host path's NaN-head table holds in
// every dtype (fp32 0x7fc00000; fp16 0x7e00 and bf16 0x7fc0 widen to it). Adding the residual
// gives the canonical NaN on both backends (math::add_rn), whose key 0x7fffffff is the largest
// key: every pass orders it first, and the strided sample always holds element 0.
constexpr uint32_t kTopKNanHeadBits = 0x7FC00000u;
GRADCOMP_HD bool topk_reads_nan_head(int64_t element, uint32_t flag) {
  return element == 0 && flag != 0;
}
// Element `element` of the range as the encode reads it (v: its loaded value), before the residual.
GRADCOMP_HD float topk_element_with_nan_head(int64_t element, uint32_t flag, float v) {
  return topk_reads_nan_head(element, flag) ? math::bits_float(kTopKNanHeadBits) : v;
}

// The look-back word of a compaction tile: its packed (greater << 32 | equal) count, whose two
// halves stay below 2^31, with bit 31 set once the tile's own aggregate is posted and bit 63 set
// once its inclusive prefix is. One 64-bit word, so a reader never sees a flag without its value.
constexpr uint64_t kTopKAggregateFlag = uint64_t{1} << 31;
constexpr uint64_t kTopKInclusiveFlag = uint64_t{1} << 63;
constexpr uint64_t kTopKFlags = kTopKAggregateFlag | kTopKInclusiveFlag;
GRADCOMP_HD uint64_t topk_tile_word(uint64_t pair, bool inclusive) {
  return pair | (inclusive ? kTopKInclusiveFlag : kTopKAggregateFlag);
}
GRADCOMP_HD uint64_t topk_tile_value(uint64_t word) {
  return word & ~kTopKFlags;
}

// The strided sample's element j (math::topk_sample_index) without a division: the sample is
// the whole bucket below kTopKSampleMax elements, else kTopKSampleMax = 2^12 strides.
static_assert(math::kTopKSampleMax == 4096, "the sample index shifts by 12");
GRADCOMP_HD int64_t topk_sample_index_shift(int64_t j, int64_t n) {
  return n <= math::kTopKSampleMax ? j : (j * n) >> 12;
}

// ---- exact threshold: the sample bracket ----------------------------------------------------

// The exact threshold T lies, with high probability, between the sample's keys at ranks
// m - d and m + d (1-based, descending; m = topk_sample_rank), d = 4 sqrt(m) + 4 (the sample
// count above the true threshold is about binomial: 4 standard deviations and a floor).
// *r_hi = 0 means no upper key (every key is at most the bracket's top); *r_lo = 0 means no
// lower key (the bracket reaches key 0). The pass then counts keys above the top, buffers the
// keys inside, and the bracket holds T exactly when above < k <= above + inside; otherwise the
// radix passes run over the whole bucket.
GRADCOMP_HD int64_t topk_isqrt(int64_t v) {
  int64_t r = 0;
  while ((r + 1) * (r + 1) <= v) ++r;
  return r;
}
GRADCOMP_HD void topk_bracket_ranks(int64_t m, int64_t samples, int64_t* r_hi, int64_t* r_lo) {
  const int64_t d = 4 * topk_isqrt(m) + 4;
  *r_hi = m - d >= 1 ? m - d : 0;
  *r_lo = m + d <= samples ? m + d : 0;
}

// ---- exact threshold: choosing a radix digit with one block ---------------------------------

// The last block of a radix pass chooses the digit: slot s (0 .. 2047) holds the count of digit
// bins - 1 - s (slots at or past `bins` hold 0), thread t holds slots [8t, 8t + 8) and `excl` is
// the sum of the slots before them. The thread whose slots hold the first slot where the running
// sum reaches `remaining` returns true with the digit and the count above it: what
// math::topk_choose_digit returns. When no slot reaches it, the thread holding digit 0 returns
// digit 0 with the total above (as topk_choose_digit does).
constexpr int kTopKChooseSlots = 8;
GRADCOMP_HD bool topk_choose_in_slots(const uint32_t (&c)[kTopKChooseSlots], int t, int bins,
                                      uint64_t excl, uint64_t remaining, uint32_t* digit,
                                      uint64_t* above) {
  uint64_t acc = excl;
  bool reached_before = t > 0 && excl >= remaining;
  bool found = false;
#pragma unroll
  for (int i = 0; i < kTopKChooseSlots; ++i) {
    const int slot = t * kTopKChooseSlots + i;
    if (!found && !reached_before && slot < bins && acc + c[i] >= remaining) {
      found = true;
      *digit = static_cast<uint32_t>(bins - 1 - slot);
      *above = acc;
    }
    acc += c[i];
  }
  const int last_slot = bins - 1;
  if (!found && acc < remaining && last_slot / kTopKChooseSlots == t) {
    found = true;
    *digit = 0;
    *above = acc;
  }
  return found;
}

// ---- decode: output tiles ------------------------------------------------------------------

// A decode tile is kTopKDecodeThreads threads x kTopKDecodeItems elements, summed in shared
// memory: every payload's entries inside the tile are one run (indices increase), added payload
// by payload in rank order.
constexpr int kTopKDecodeThreads = 256;
constexpr int kTopKDecodeItems = 16;
constexpr int64_t kTopKDecodeTile = int64_t{kTopKDecodeThreads} * kTopKDecodeItems;

GRADCOMP_HD int64_t topk_decode_tiles(int64_t numel) {
  return numel <= 0 ? 0 : (numel + kTopKDecodeTile - 1) / kTopKDecodeTile;
}
// The element of pass i (0 .. kTopKDecodeItems / 4 - 1) and lane-of-block t that the fp32 fast
// path stores as the first of 4 (float4 chunks striped across the block: each warp store
// instruction writes 512 contiguous bytes).
GRADCOMP_HD int topk_decode_chunk_first(int i, int t) {
  return 4 * (i * kTopKDecodeThreads + t);
}
// The element of pass i and thread t on the scalar path (striped: consecutive threads,
// consecutive elements).
GRADCOMP_HD int topk_decode_scalar_elem(int i, int t) {
  return i * kTopKDecodeThreads + t;
}

// First entry e in [0, count) with load(e) >= key (count when none): the start of a payload's run
// in a tile. `load` reads index entry e (on the device through __ldg).
template <typename Load>
GRADCOMP_HD uint64_t topk_lower_bound(Load load, uint64_t count, uint32_t key) {
  uint64_t lo = 0, hi = count;
  while (lo < hi) {
    const uint64_t mid = lo + ((hi - lo) >> 1);
    if (load(mid) < key)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
