// The v2 top-k kernels' index maps and decisions (kernels/v2/topk_v2_map.h), proven on the host:
// every element and output byte visited exactly once, the compaction's positions, the fused
// body checksum, the look-back word, the digit chooser, the sample bracket with its fallback,
// and the decode tiles' runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "v2/topk_v2_map.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;

const int64_t kOddSizes[] = {0, 1, 7, 8, 9, 255, 2047, 2048, 2049, 4095, 4096, 4097, 5000, 100003};

TEST(TopKV2Map, CompactionTilesCoverEveryElementOnce) {
  for (int64_t n : kOddSizes) {
    std::vector<int> seen(static_cast<size_t>(n), 0);
    int64_t outside = 0;
    for (int64_t tile = 0; tile < topk_tiles(n); ++tile)
      for (int t = 0; t < kTopKThreads; ++t) {
        const int64_t first = topk_thread_first(tile, t);
        const int c = topk_thread_count(n, first);
        for (int j = 0; j < c; ++j) {
          if (first + j < 0 || first + j >= n)
            ++outside;
          else
            ++seen[static_cast<size_t>(first + j)];
        }
      }
    EXPECT_EQ(outside, 0) << n;
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; })) << n;
    EXPECT_EQ(topk_tiles(n) * kTopKTile >= n, true);
  }
}

// The exact threshold key and ties taken, by sorting (the CPU reference's result).
void reference_threshold(const std::vector<uint32_t>& keys, int64_t k, uint32_t* t,
                         uint64_t* eq_limit) {
  if (k == 0) {
    *t = 0xFFFFFFFFu;
    *eq_limit = 0;
    return;
  }
  std::vector<uint32_t> s = keys;
  std::sort(s.begin(), s.end(), std::greater<uint32_t>());
  *t = s[static_cast<size_t>(k - 1)];
  uint64_t gt = 0;
  for (uint32_t x : keys) gt += x > *t;
  *eq_limit = static_cast<uint64_t>(k) - gt;
}

// The compaction as the kernel runs it: per-tile aggregate, look-back prefix, block-exclusive
// scan, then per-thread positions. Returns the entries (index per position, -1 unwritten).
std::vector<int64_t> simulate_compaction(const std::vector<uint32_t>& keys, uint32_t threshold,
                                         uint64_t eq_limit, uint32_t capacity, uint64_t* count,
                                         int* twice) {
  const int64_t n = static_cast<int64_t>(keys.size());
  std::vector<int64_t> out(capacity, -1);
  *twice = 0;
  uint64_t prefix = 0;  // inclusive prefix of the tiles before, as the look-back returns it
  for (int64_t tile = 0; tile < topk_tiles(n); ++tile) {
    std::vector<uint64_t> mine(kTopKThreads, 0);
    for (int t = 0; t < kTopKThreads; ++t) {
      const int64_t first = topk_thread_first(tile, t);
      for (int j = 0; j < topk_thread_count(n, first); ++j)
        mine[t] += topk_count_pair(keys[first + j], threshold);
    }
    uint64_t before = prefix;
    for (int t = 0; t < kTopKThreads; ++t) {
      const int64_t first = topk_thread_first(tile, t);
      uint64_t gt = before >> 32, eq = before & 0xFFFFFFFFu;
      for (int j = 0; j < topk_thread_count(n, first); ++j) {
        const uint32_t key = keys[first + j];
        const bool sel = key > threshold || (key == threshold && eq < eq_limit);
        const uint64_t pos = topk_position(gt, eq, eq_limit);
        if (key > threshold) ++gt;
        if (key == threshold) ++eq;
        if (sel && pos < capacity) {
          if (out[pos] != -1) ++*twice;
          out[pos] = first + j;
        }
      }
      before += mine[t];
    }
    // The word the tile posts, read back through its flags.
    const uint64_t word = topk_tile_word(before, true);
    EXPECT_NE(word & kTopKInclusiveFlag, 0u);
    prefix = topk_tile_value(word);
  }
  *count = topk_entry_count(prefix, eq_limit, capacity);
  return out;
}

std::vector<uint32_t> random_keys(int64_t n, uint32_t seed, uint32_t distinct) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> keys(static_cast<size_t>(n));
  for (auto& k : keys) k = static_cast<uint32_t>(rng() % distinct) * 0x1000u;  // many ties
  return keys;
}

TEST(TopKV2Map, CompactionWritesEachPositionOnceInIndexOrder) {
  for (int64_t n : kOddSizes) {
    if (n == 0) continue;
    for (int64_t k : {int64_t{0}, int64_t{1}, n / 3, n}) {
      for (uint32_t distinct : {3u, 1000u}) {
        const auto keys = random_keys(n, static_cast<uint32_t>(n * 31 + k), distinct);
        uint32_t t;
        uint64_t eq_limit;
        reference_threshold(keys, k, &t, &eq_limit);
        uint64_t count;
        int twice;
        const auto out =
            simulate_compaction(keys, t, eq_limit, static_cast<uint32_t>(k), &count, &twice);
        ASSERT_EQ(twice, 0);
        ASSERT_EQ(count, static_cast<uint64_t>(k)) << n << " " << k;
        // The reference: the k largest, ties to the lower index, in index order.
        std::vector<int64_t> order(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(),
                         [&](int64_t a, int64_t b) { return keys[a] > keys[b]; });
        order.resize(static_cast<size_t>(k));
        std::sort(order.begin(), order.end());
        ASSERT_EQ(out, order) << n << " " << k << " " << distinct;
      }
    }
  }
}

TEST(TopKV2Map, ApproximateCompactionStopsAtCapacity) {
  const auto keys = random_keys(10007, 5, 50);
  const uint32_t threshold = 40 * 0x1000u;
  uint64_t count;
  int twice;
  const auto out = simulate_compaction(keys, threshold, ~uint64_t{0}, 100, &count, &twice);
  EXPECT_EQ(twice, 0);
  EXPECT_EQ(count, 100u);
  EXPECT_TRUE(std::is_sorted(out.begin(), out.end()));
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](int64_t i) { return i >= 0; }));
}

// The fused exact path compacts only the buffered entries (every key at or above the bracket's
// bottom lo, in index order): the same payload as the compaction over the whole bucket whenever
// the threshold is at least lo.
TEST(TopKV2Map, BufferedCompactionEqualsTheFullOne) {
  for (int64_t n : {int64_t{13}, int64_t{2049}, int64_t{100003}}) {
    const auto keys = random_keys(n, static_cast<uint32_t>(n), 700);
    for (int64_t k : {int64_t{1}, (n + 99) / 100, n / 3}) {
      uint32_t t;
      uint64_t eq_limit;
      reference_threshold(keys, k, &t, &eq_limit);
      for (uint32_t lo : {0u, t / 2, t}) {
        std::vector<uint32_t> buf_keys;
        std::vector<int64_t> buf_index;
        for (int64_t i = 0; i < n; ++i)
          if (keys[i] >= lo) {
            buf_keys.push_back(keys[i]);
            buf_index.push_back(i);
          }
        uint64_t count_full, count_buf;
        int twice_full, twice_buf;
        const auto full = simulate_compaction(keys, t, eq_limit, static_cast<uint32_t>(k),
                                              &count_full, &twice_full);
        auto buffered = simulate_compaction(buf_keys, t, eq_limit, static_cast<uint32_t>(k),
                                            &count_buf, &twice_buf);
        for (auto& e : buffered) e = e < 0 ? e : buf_index[static_cast<size_t>(e)];
        EXPECT_EQ(twice_buf, 0);
        EXPECT_EQ(count_buf, count_full);
        EXPECT_EQ(buffered, full) << n << " " << k << " " << lo;
      }
    }
  }
}

TEST(TopKV2Map, EntryChecksumsAddUpToTheBodyChecksum) {
  std::mt19937 rng(7);
  for (uint8_t vd : {math::kDtypeF32, math::kDtypeF16, math::kDtypeBF16}) {
    for (uint32_t capacity : {1u, 2u, 3u, 5u, 7u, 8u, 33u}) {
      for (uint32_t count : {0u, capacity / 2, capacity}) {
        const format::PayloadHeader h = format::make_topk_header(1000, capacity, count, 0, vd);
        std::vector<uint8_t> payload(format::payload_bytes_of(h), 0);
        const uint64_t s1 = format::section1_offset(h);
        uint64_t sum = 0;
        for (uint32_t pos = 0; pos < count; ++pos) {
          const uint32_t index = rng();
          const uint32_t bits = vd == math::kDtypeF32 ? rng() : (rng() & 0xFFFFu);
          std::memcpy(&payload[kPayloadHeaderBytes + 4 * pos], &index, 4);
          if (vd == math::kDtypeF32) {
            std::memcpy(&payload[s1 + 4 * pos], &bits, 4);
          } else {
            const uint16_t b16 = static_cast<uint16_t>(bits);
            std::memcpy(&payload[s1 + 2 * pos], &b16, 2);
          }
          sum += topk_entry_checksum(index, pos, bits, vd, (s1 - kPayloadHeaderBytes) / 4);
        }
        EXPECT_EQ(sum, format::body_checksum(payload.data(), payload.size()))
            << int(vd) << " " << capacity << " " << count;
      }
    }
  }
}

TEST(TopKV2Map, LookbackWordKeepsItsValueAndFlags) {
  const uint64_t big = ((uint64_t{1} << 31) - 1) << 32 | ((uint64_t{1} << 31) - 1);
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{1} << 32, big}) {
    for (bool inc : {false, true}) {
      const uint64_t w = topk_tile_word(v, inc);
      EXPECT_EQ(topk_tile_value(w), v);
      EXPECT_NE(w & kTopKFlags, 0u);
      EXPECT_EQ((w & kTopKInclusiveFlag) != 0, inc);
    }
  }
}

// The block chooser run as the kernel runs it (256 threads of 8 slots, an exclusive scan).
bool choose_by_block(const std::vector<uint32_t>& hist, int bins, uint64_t remaining,
                     uint32_t* digit, uint64_t* above) {
  int found = 0;
  uint64_t excl = 0;
  for (int t = 0; t < math::kTopKMaxBins / kTopKChooseSlots; ++t) {
    uint32_t c[kTopKChooseSlots];
    uint64_t mine = 0;
    for (int i = 0; i < kTopKChooseSlots; ++i) {
      const int slot = t * kTopKChooseSlots + i;
      c[i] = slot < bins ? hist[bins - 1 - slot] : 0u;
      mine += c[i];
    }
    found += topk_choose_in_slots(c, t, bins, excl, remaining, digit, above);
    excl += mine;
  }
  return found == 1;
}

TEST(TopKV2Map, BlockChooserMatchesTheSerialChoice) {
  std::mt19937 rng(11);
  for (int bins : {2048, 512}) {
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<uint32_t> hist(bins, 0);
      const int filled = 1 + static_cast<int>(rng() % 20);
      for (int f = 0; f < filled; ++f) hist[rng() % bins] += rng() % 100;
      uint64_t total = 0;
      for (uint32_t h : hist) total += h;
      for (uint64_t remaining : {uint64_t{0}, uint64_t{1}, total / 2, total, total + 1}) {
        uint64_t above_ref = 0, above = 0;
        const uint32_t ref = math::topk_choose_digit(hist.data(), bins, remaining, &above_ref);
        uint32_t digit = 0;
        ASSERT_TRUE(choose_by_block(hist, bins, remaining, &digit, &above)) << remaining;
        ASSERT_EQ(digit, ref);
        ASSERT_EQ(above, above_ref);
      }
    }
  }
}

TEST(TopKV2Map, SampleIndexByShiftMatchesTheDivision) {
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{4095}, int64_t{4096}, int64_t{4097},
                    int64_t{100003}, int64_t{100000000}, math::kTopKMaxNumel}) {
    const int64_t s = math::topk_sample_size(n);
    for (int64_t j = 0; j < s; j += (j < 64 || s - j < 64) ? 1 : 97)
      ASSERT_EQ(topk_sample_index_shift(j, n), math::topk_sample_index(j, n, s)) << n << " " << j;
  }
}

// The exact selection as the v2 kernels run it: the sample bracket, the count above and the keys
// inside, three radix passes over the keys inside (or over every key when the bracket missed),
// each digit chosen by the block chooser.
void v2_exact_threshold(const std::vector<uint32_t>& keys, int64_t k, uint32_t* threshold,
                        uint64_t* eq_limit, bool* hit) {
  const int64_t n = static_cast<int64_t>(keys.size());
  const int64_t samples = math::topk_sample_size(n);
  std::vector<uint32_t> sample;
  for (int64_t j = 0; j < samples; ++j) sample.push_back(keys[topk_sample_index_shift(j, n)]);
  std::sort(sample.begin(), sample.end(), std::greater<uint32_t>());
  const int64_t m = math::topk_sample_rank(k, n, samples);
  int64_t r_hi, r_lo;
  topk_bracket_ranks(m, samples, &r_hi, &r_lo);
  const uint32_t hi = r_hi == 0 ? 0xFFFFFFFFu : sample[r_hi - 1];
  const uint32_t lo = r_lo == 0 ? 0u : sample[r_lo - 1];
  uint64_t gt = 0;
  std::vector<uint32_t> cand;
  for (uint32_t x : keys) {
    gt += x > hi;
    if (x >= lo && x <= hi) cand.push_back(x);
  }
  *hit = gt < static_cast<uint64_t>(k) && gt + cand.size() >= static_cast<uint64_t>(k);
  const std::vector<uint32_t>& src = *hit ? cand : keys;
  uint64_t remaining = *hit ? k - gt : k;
  uint32_t prefix = 0;
  for (int pass = 0; pass < math::kTopKPasses; ++pass) {
    std::vector<uint32_t> hist(math::kTopKMaxBins, 0);
    for (uint32_t x : src)
      if ((x & math::topk_pass_mask_above(pass)) == prefix) ++hist[math::topk_digit(x, pass)];
    uint32_t digit = 0;
    uint64_t above = 0;
    ASSERT_TRUE(choose_by_block(hist, math::topk_pass_bins(pass), remaining, &digit, &above));
    remaining -= above;
    prefix |= digit << math::topk_pass_shift(pass);
  }
  *threshold = prefix;
  *eq_limit = remaining;
}

TEST(TopKV2Map, BracketedSelectFindsTheExactThreshold) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  int hits = 0, runs = 0;
  for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{4097}, int64_t{100003}, int64_t{300000}}) {
    std::vector<uint32_t> keys(static_cast<size_t>(n));
    for (auto& x : keys) x = math::topk_key(normal(rng));
    for (int64_t k : {int64_t{1}, (n + 99) / 100, n / 2 + 1, n}) {
      uint32_t t, t_ref;
      uint64_t e, e_ref;
      bool hit;
      v2_exact_threshold(keys, k, &t, &e, &hit);
      reference_threshold(keys, k, &t_ref, &e_ref);
      EXPECT_EQ(t, t_ref) << n << " " << k;
      EXPECT_EQ(e, e_ref) << n << " " << k;
      hits += hit;
      ++runs;
    }
  }
  EXPECT_GE(hits, runs - 2);  // normal data: the bracket holds the threshold
}

TEST(TopKV2Map, BracketMissFallsBackToTheWholeBucket) {
  // Keys that the strided sample never sees: the large ones sit between sample points.
  const int64_t n = 409600;
  std::vector<uint32_t> keys(static_cast<size_t>(n), 0x3F000000u);
  for (int64_t i = 0; i < n; ++i)
    if (i % 100 != 0) keys[i] = 0x40000000u + static_cast<uint32_t>(i % 7);
  for (int64_t k : {int64_t{10}, int64_t{4000}, n - 5}) {
    uint32_t t, t_ref;
    uint64_t e, e_ref;
    bool hit;
    v2_exact_threshold(keys, k, &t, &e, &hit);
    reference_threshold(keys, k, &t_ref, &e_ref);
    EXPECT_EQ(t, t_ref) << k;
    EXPECT_EQ(e, e_ref) << k;
  }
  // Equal keys everywhere: the bracket holds every key.
  std::vector<uint32_t> same(5000, 0x12345u);
  uint32_t t;
  uint64_t e;
  bool hit;
  v2_exact_threshold(same, 77, &t, &e, &hit);
  EXPECT_TRUE(hit);
  EXPECT_EQ(t, 0x12345u);
  EXPECT_EQ(e, 77u);
}

TEST(TopKV2Map, DecodeTileCoversEachWindowSlotOnce) {
  std::vector<int> fast(kTopKDecodeTile, 0), scalar(kTopKDecodeTile, 0);
  for (int t = 0; t < kTopKDecodeThreads; ++t) {
    for (int i = 0; i < kTopKDecodeItems / 4; ++i)
      for (int j = 0; j < 4; ++j) ++fast[topk_decode_chunk_first(i, t) + j];
    for (int i = 0; i < kTopKDecodeItems; ++i) ++scalar[topk_decode_scalar_elem(i, t)];
  }
  EXPECT_TRUE(std::all_of(fast.begin(), fast.end(), [](int s) { return s == 1; }));
  EXPECT_TRUE(std::all_of(scalar.begin(), scalar.end(), [](int s) { return s == 1; }));
  // A warp's fast-path store instruction covers 512 contiguous bytes.
  for (int i = 0; i < kTopKDecodeItems / 4; ++i)
    for (int t = 1; t < 32; ++t)
      EXPECT_EQ(topk_decode_chunk_first(i, t), topk_decode_chunk_first(i, t - 1) + 4);
}

TEST(TopKV2Map, DecodeRunsPartitionEveryPayloadsEntries) {
  std::mt19937 rng(9);
  for (int64_t n : kOddSizes) {
    if (n == 0) continue;
    std::vector<uint32_t> idx;
    for (int64_t i = 0; i < n; ++i)
      if (rng() % 7 == 0 || i == n - 1 || i == 0) idx.push_back(static_cast<uint32_t>(i));
    const uint64_t count = idx.size();
    auto load = [&](uint64_t e) { return idx[e]; };
    std::vector<int> seen(count, 0);
    for (int64_t tile = 0; tile < topk_decode_tiles(n); ++tile) {
      const int64_t lo = tile * kTopKDecodeTile;
      const int64_t hi = std::min<int64_t>(lo + kTopKDecodeTile, n);
      const uint64_t b = topk_lower_bound(load, count, static_cast<uint32_t>(lo));
      const uint64_t e = topk_lower_bound(load, count, static_cast<uint32_t>(hi));
      EXPECT_EQ(b,
                static_cast<uint64_t>(std::lower_bound(idx.begin(), idx.end(), lo) - idx.begin()));
      for (uint64_t x = b; x < e; ++x) {
        ++seen[x];
        EXPECT_GE(idx[x], lo);
        EXPECT_LT(idx[x], hi);  // its window slot idx - lo is inside the tile
      }
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; })) << n;
  }
}

TEST(TopKV2Math, PowerOfTwoReciprocalDividesExactly) {
  float inv = 0.0f;
  for (float d : {1.0f, 2.0f, 4.0f, 0.5f, -8.0f, 0x1p-126f, 0x1p126f}) {
    ASSERT_TRUE(math::pow2_reciprocal(d, &inv)) << d;
    EXPECT_EQ(math::mul_rn(d, inv), 1.0f) << d;
  }
  for (float d : {3.0f, 0.0f, -0.0f, 0x1p127f, 0x1p-127f, 0x1p-149f,
                  std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()})
    EXPECT_FALSE(math::pow2_reciprocal(d, &inv)) << d;
  std::mt19937 rng(1);
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           0x1p-149f,
                           0x1p-126f,
                           3.0e38f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN()};
  for (int i = 0; i < 20000; ++i) xs.push_back(math::bits_float(rng()));
  for (float d : {2.0f, 4.0f, 0.25f, -2.0f, 0x1p-126f, 0x1p126f, 1024.0f}) {
    ASSERT_TRUE(math::pow2_reciprocal(d, &inv));
    for (float x : xs)
      ASSERT_EQ(math::float_bits(math::mul_rn(x, inv)), math::float_bits(math::div_rn(x, d)))
          << x << " / " << d;
  }
}

}  // namespace
}  // namespace gradcomp
