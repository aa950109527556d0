// The 4-bit weight v2 kernels (kernels/v2/int4_v2_*.cu) replayed on the host lane by lane with
// their index map and arithmetic (int4_v2_map.h, math/int4_math.h): every code nibble and scale
// written once, payloads, non-finite reports and decoded rows equal to the CPU reference's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gradcomp/cpu.h"
#include "int4_params.h"
#include "payload_header.h"
#include "v2/int4_v2_map.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;
using int4::ChunkMap;
using int4::kChunk;

constexpr uint8_t kGarbage = 0xA5;  // what the caller's buffers hold before a kernel writes

// ---- The element rules --------------------------------------------------------------------

// The kernels' nibble: the fast quotient from every reciprocal approximation the device may start
// from (rcp.approx is within 1 ulp; 2 tried) when the block is in the fast domain, and always the
// division, against the reference's int4_nibble(int4_quantize).
void expect_same_nibble(float x, float scale, uint32_t min_key, long* checked) {
  const uint32_t ref = math::int4_nibble(math::int4_quantize(x, scale));
  if (math::int8_fast_block(scale, min_key)) {
    const uint32_t rn = math::float_bits(math::div_rn(1.0f, scale));
    for (int k = -2; k <= 2; ++k) {
      const float y = math::q4_refine_reciprocal(scale, math::bits_float(rn + k));
      ASSERT_EQ(math::int4_nibble_of_quotient(math::q4_fast_quotient(x, scale, y), scale), ref)
          << "x=" << x << " scale=" << scale << " approx " << k;
    }
  }
  ASSERT_EQ(math::int4_nibble_of_quotient(math::div_rn(x, scale), scale), ref)
      << "x=" << x << " scale=" << scale;
  ++*checked;
}

// Every bf16 scale int4_scale_bits can produce and every code: k * scale, the ties
// (k + 1/2) * scale and their fp32 neighbours, both signs. A mutation of the rounding (ties away,
// truncation), of the clamp or of the bias fails it.
TEST(Int4V2Map, NibbleEqualsTheReferenceForEveryScaleAndEveryCode) {
  long checked = 0;
  for (uint32_t sbits = 1; sbits < 0x7F80u; ++sbits) {
    const float scale = math::bf16_to_float(static_cast<uint16_t>(sbits));
    const float absmax = math::mul_rn(scale, 7.0f);
    for (int k = 0; k <= 7; ++k) {
      for (float base : {math::mul_rn(static_cast<float>(k), scale),
                         math::mul_rn(static_cast<float>(k) + 0.5f, scale)}) {
        for (float x : {base, std::nextafter(base, 0.0f), std::nextafter(base, 1e38f)}) {
          if (!(x <= absmax) || !std::isfinite(x)) continue;
          const uint32_t key = math::q4_dividend_key(math::abs_bits(x));
          expect_same_nibble(x, scale, key, &checked);
          expect_same_nibble(-x, scale, key, &checked);
        }
      }
    }
  }
  // A scale that is not > 0 (a block of zeros) codes 0.
  EXPECT_EQ(math::int4_nibble_of_quotient(0.0f, 0.0f), 8u);
  EXPECT_GT(checked, 500000);
}

TEST(Int4V2Map, DequantizedNibbleEqualsTheReferenceForEveryNibbleAndScale) {
  for (uint32_t sbits = 0; sbits < 0x7F80u; ++sbits) {
    const float scale = math::bf16_to_float(static_cast<uint16_t>(sbits));
    for (uint32_t nibble = 0; nibble < 16; ++nibble) {
      const float ref = math::int4_dequantize(math::int4_code(nibble), scale);
      // The kernels pass the nibble with the other nibbles of its word above it.
      ASSERT_EQ(math::float_bits(math::int4_dequantize_nibble(nibble | 0xA0u, scale)),
                math::float_bits(ref))
          << nibble << " " << scale;
    }
  }
}

// ---- The kernels, replayed ----------------------------------------------------------------

struct Row {
  std::vector<Int8Run> runs;
  uint32_t block;
  std::vector<uint8_t> bytes;
  int num_runs() const { return static_cast<int>(runs.size()); }
};

// The emulated payload: bytes and how often each nibble of the body was written by its owner (a
// run writes the high nibble of its last byte as 0 when the next run owns it; that write is not
// counted, as the next run's write follows it in launch order).
struct Emulated {
  std::vector<uint8_t> p;
  std::vector<int> nibble_writes;  // per body nibble
  uint64_t sum = 0, nonfinite = 0;
  void put_nibble(uint64_t body_at, int h, uint32_t nibble, bool owner = true) {
    uint8_t& b = p[kInt8HeaderBytes + body_at];
    b = static_cast<uint8_t>((b & (h ? 0x0Fu : 0xF0u)) | ((nibble & 0xFu) << (4 * h)));
    if (owner) ++nibble_writes[2 * body_at + h];
  }
  void put_byte(uint64_t body_at, uint32_t byte) {
    put_nibble(body_at, 0, byte);
    put_nibble(body_at, 1, byte >> 4);
  }
};

struct Scan {
  uint32_t max_bits = 0, min_key = 0xFFFFFFFFu, first_bad = 0xFFFFFFFFu;
  void add(float x, uint32_t i) {
    const uint32_t bits = math::abs_bits(x);
    max_bits = std::max(max_bits, bits);
    min_key = std::min(min_key, math::q4_dividend_key(bits));
    if (bits >= 0x7F800000u && i < first_bad) first_bad = i;
  }
};

struct RunPlace {
  const uint8_t* elements;
  uint8_t dtype;
  int64_t numel;
  uint32_t log2;
  uint64_t first_block, codes_at, row_offset;
  uint64_t row_numel;  // a nibble at or past it is padding
};

uint64_t scale_term(Emulated& em, uint64_t scale_at, uint16_t sbits) {
  em.put_byte(scale_at, sbits & 0xFFu);
  em.put_byte(scale_at + 1, sbits >> 8);
  return format::body_checksum_term(static_cast<uint32_t>(sbits) << (8 * (scale_at & 3)),
                                    scale_at >> 2);
}

uint64_t byte_term(uint32_t byte, uint64_t at) {
  return format::body_checksum_term(byte << (8 * (at & 3)), at >> 2);
}

// int4_encode_v2_kernel over `warps` warps (lanes of a block's group scanned, then combined as the
// shuffles combine them); `approx`: the reciprocal approximation's ulp offset.
void replay_fused(const RunPlace& r, uint64_t warps, int approx, Emulated* em) {
  const uint32_t block = 1u << r.log2;
  const uint64_t blocks = (static_cast<uint64_t>(r.numel) + block - 1) >> r.log2;
  for (uint64_t warp = 0; warp < warps; ++warp) {
    const ChunkMap m0(r.log2, 0, warp, warps);
    const uint32_t size = 1u << m0.group_log2;
    for (uint64_t first = m0.warp_first; first < blocks; first += m0.stride) {
      for (uint32_t group = 0; group < 32 / size; ++group) {
        const uint64_t b = first + group;
        const int64_t start = static_cast<int64_t>(b << r.log2);
        const int64_t rest = b < blocks ? r.numel - start : 0;
        const uint32_t n = rest < block ? static_cast<uint32_t>(rest) : block;
        Scan scan;
        for (uint32_t sub = 0; sub < size; ++sub) {
          const ChunkMap m(r.log2, group * size + sub, warp, warps);
          EXPECT_EQ(m.group, group);
          for (uint32_t s = 0; s < m.steps; ++s)
            for (uint32_t i = m.chunk(s); i < std::min(m.chunk(s) + kChunk, n); ++i)
              scan.add(math::load_as_float(r.elements, start + i, r.dtype), i);
        }
        if (n == 0) continue;
        if (scan.first_bad != 0xFFFFFFFFu) {
          em->nonfinite =
              std::max<uint64_t>(em->nonfinite, ~(r.row_offset + start + scan.first_bad));
          continue;
        }
        const uint16_t sbits = int4::block_scale_bits(scan.max_bits);
        const float scale = math::bf16_to_float(sbits);
        em->sum += scale_term(*em, 2 * (r.first_block + b), sbits);
        const bool fast = math::int8_fast_block(scale, scan.min_key);
        const float y =
            fast
                ? math::q4_refine_reciprocal(
                      scale, math::bits_float(math::float_bits(math::div_rn(1.0f, scale)) + approx))
                : 0.0f;
        EXPECT_EQ((r.row_offset + start) % 2, 0u);
        const uint64_t codes_at = r.codes_at + (r.row_offset + start) / 2;
        for (uint32_t sub = 0; sub < size; ++sub) {
          const ChunkMap m(r.log2, group * size + sub, warp, warps);
          for (uint32_t s = 0; s < m.steps; ++s) {
            const uint32_t e = m.chunk(s);
            if (fast && e + kChunk <= n) {
              EXPECT_EQ((kInt8HeaderBytes + codes_at + e / 2) % 8, 0u) << "8-byte code store";
              uint32_t w[2];
              for (uint32_t half = 0; half < 2; ++half) {
                float v[8];
                for (int j = 0; j < 8; ++j)
                  v[j] = math::load_as_float(r.elements, start + e + half * 8 + j, r.dtype);
                w[half] = int4::codes_word(v, scale, y);
              }
              for (int k = 0; k < 8; ++k)
                em->put_byte(codes_at + e / 2 + k, w[k / 4] >> (8 * (k % 4)));
              const uint64_t word = (codes_at + e / 2) >> 2;
              em->sum += format::body_checksum_term(w[0], word) +
                         format::body_checksum_term(w[1], word + 1);
            } else {
              const uint32_t end = std::min(e + kChunk, n);
              uint32_t byte = 0;
              for (uint32_t i = e; i < end; ++i) {
                const float x = math::load_as_float(r.elements, start + i, r.dtype);
                const float t0 =
                    fast ? math::q4_fast_quotient(x, scale, y) : math::div_rn(x, scale);
                byte |= math::int4_nibble_of_quotient(t0, scale) << (4 * (i & 1));
                if ((i & 1) != 0 || i + 1 == end) {
                  em->put_nibble(codes_at + i / 2, 0, byte);
                  const uint64_t high = r.row_offset + start + (i | 1);
                  em->put_nibble(codes_at + i / 2, 1, byte >> 4,
                                 high < r.row_offset + r.numel || high >= r.row_numel);
                  em->sum += byte_term(byte, codes_at + i / 2);
                  byte = 0;
                }
              }
            }
          }
        }
      }
    }
  }
}

// int4_scales_v2_kernel then int4_bytes_v2_kernel.
void replay_scales_and_bytes(const RunPlace& r, Emulated* em) {
  const uint32_t block = 1u << r.log2;
  const uint64_t blocks = (static_cast<uint64_t>(r.numel) + block - 1) >> r.log2;
  for (uint64_t b = 0; b < blocks; ++b) {
    const int64_t start = static_cast<int64_t>(b << r.log2);
    const uint32_t n = static_cast<uint32_t>(std::min<int64_t>(block, r.numel - start));
    Scan scan;
    for (uint32_t i = 0; i < n; ++i)
      scan.add(math::load_as_float(r.elements, start + i, r.dtype), i);
    if (scan.first_bad != 0xFFFFFFFFu) {
      em->nonfinite = std::max<uint64_t>(em->nonfinite, ~(r.row_offset + start + scan.first_bad));
      continue;
    }
    em->sum += scale_term(*em, 2 * (r.first_block + b), int4::block_scale_bits(scan.max_bits));
  }
  if (em->nonfinite != 0) return;
  const int4::RunBytes bytes(r.row_offset, static_cast<uint64_t>(r.numel));
  for (uint64_t g = bytes.first; g < bytes.end; ++g) {
    const int64_t lo = int4::byte_low_element(g, r.row_offset);
    for (int h = 0; h < 2; ++h) {
      const int64_t i = lo + h;
      if (i < 0) continue;  // the previous run's nibble, kept
      uint32_t nibble = 0;  // past the run: the next run's or padding
      if (i < r.numel) {
        uint16_t sbits;
        std::memcpy(&sbits, em->p.data() + kInt8HeaderBytes + 2 * (r.first_block + (i >> r.log2)),
                    2);
        const float scale = math::bf16_to_float(sbits);
        nibble = math::int4_nibble_of_quotient(
            math::div_rn(math::load_as_float(r.elements, i, r.dtype), scale), scale);
        em->sum += byte_term(nibble << (4 * h), r.codes_at + g);
      }
      em->put_nibble(r.codes_at + g, h, nibble,
                     i < r.numel || r.row_offset + static_cast<uint64_t>(i) >= r.row_numel);
    }
  }
}

// run_int4_encode's launches and int8's seal. `address`: the row's device address modulo 16.
std::vector<uint8_t> replay_encode(const Row& row, uintptr_t address, int approx,
                                   uint64_t* nonfinite_at, std::vector<int>* writes) {
  const uint64_t total = int4_row_payload_bytes(row.runs.data(), row.num_runs(), row.block);
  const uint64_t blocks = int8_row_blocks(row.runs.data(), row.num_runs(), row.block);
  const uint64_t numel = int8_row_numel(row.runs.data(), row.num_runs());
  Emulated em{std::vector<uint8_t>(total, kGarbage),
              std::vector<int>(2 * (total - kInt8HeaderBytes), 0)};
  RunPlace r{row.bytes.data(), 0, 0, 0, 0, int8_align16(2 * blocks), 0, numel};
  while ((1u << r.log2) < row.block) ++r.log2;
  uint64_t offset_bytes = 0;
  for (const Int8Run& run : row.runs) {
    r.dtype = run.dtype;
    r.numel = run.numel;
    const uint64_t run_blocks = math::int8_num_blocks(run.numel, row.block);
    if (int4::run_aligned(address + offset_bytes, r.row_offset)) {
      const uint64_t per_warp = int4::blocks_per_warp(row.block, true);
      const uint64_t warps = (run_blocks + per_warp - 1) / per_warp;
      replay_fused(r, approx == 0 ? warps : 3, approx, &em);  // 3 warps: rounds that loop
    } else {
      replay_scales_and_bytes(r, &em);
    }
    offset_bytes += static_cast<uint64_t>(run.numel) * math::dtype_bytes(run.dtype);
    r.elements += static_cast<uint64_t>(run.numel) * math::dtype_bytes(run.dtype);
    r.first_block += run_blocks;
    r.row_offset += static_cast<uint64_t>(run.numel);
  }
  // The seal: a flagged body zeroed, else the sections' padding; then the header.
  uint8_t* body = em.p.data() + kInt8HeaderBytes;
  if (em.nonfinite != 0) {
    std::memset(body, 0, total - kInt8HeaderBytes);
  } else {
    for (uint64_t at = 2 * blocks; at < r.codes_at; ++at) em.put_byte(at, 0);
    for (uint64_t at = r.codes_at + (numel + 1) / 2; at < total - kInt8HeaderBytes; ++at)
      em.put_byte(at, 0);
  }
  const uint64_t sum = em.nonfinite != 0 ? 0 : em.sum;
  const uint32_t head[8] = {kInt4PayloadMagic,
                            kInt4PayloadVersion | ((em.nonfinite != 0 ? 1u : 0u) << 16),
                            row.block,
                            static_cast<uint32_t>(row.num_runs()),
                            static_cast<uint32_t>(numel),
                            static_cast<uint32_t>(numel >> 32),
                            static_cast<uint32_t>(sum),
                            static_cast<uint32_t>(sum >> 32)};
  std::memcpy(em.p.data(), head, sizeof head);
  *nonfinite_at = em.nonfinite != 0 ? ~em.nonfinite + 1 : 0;
  *writes = em.nibble_writes;
  return em.p;
}

// run_int4_decode's launches for `rows` payloads side by side (the same payload each), into
// output at `address` modulo 16; counts each element's writes.
std::vector<uint8_t> replay_decode(const Row& row, const std::vector<uint8_t>& payload,
                                   uintptr_t address, int rows, std::vector<int>* writes) {
  const uint64_t row_bytes = int8_row_bytes(row.runs.data(), row.num_runs());
  const uint64_t numel = int8_row_numel(row.runs.data(), row.num_runs());
  std::vector<uint8_t> out(row_bytes * rows, kGarbage);
  writes->assign(numel * rows, 0);
  const uint8_t* body = payload.data() + kInt8HeaderBytes;
  uint32_t log2 = 0;
  while ((1u << log2) < row.block) ++log2;
  const uint64_t codes_at =
      int8_align16(2 * int8_row_blocks(row.runs.data(), row.num_runs(), row.block));
  uint64_t first_block = 0, row_offset = 0, offset_bytes = 0;
  for (const Int8Run& run : row.runs) {
    const uint64_t blocks = math::int8_num_blocks(run.numel, row.block);
    const bool aligned =
        int4::run_aligned(address + offset_bytes, row_offset) && (rows == 1 || row_bytes % 16 == 0);
    for (int w = 0; w < rows; ++w) {
      uint8_t* at = out.data() + row_bytes * w + offset_bytes;
      auto store = [&](int64_t i, float v) {
        math::store_from_float(at, i, run.dtype, v);
        ++(*writes)[numel * w + row_offset + i];
      };
      for (uint64_t b = 0; b < blocks; ++b) {
        const int64_t start = static_cast<int64_t>(b << log2);
        const uint32_t n = static_cast<uint32_t>(std::min<int64_t>(row.block, run.numel - start));
        uint16_t sbits;
        std::memcpy(&sbits, body + 2 * (first_block + b), 2);
        const float scale = math::bf16_to_float(sbits);
        if (aligned) {  // decode_aligned: 8-byte code loads of whole chunks
          const uint8_t* codes = body + codes_at + (row_offset + start) / 2;
          for (uint32_t e = 0; e < n; e += kChunk) {
            if (e + kChunk <= n) {
              EXPECT_EQ((kInt8HeaderBytes + codes_at + (row_offset + start) / 2 + e / 2) % 8, 0u);
              uint32_t wd[2];
              std::memcpy(wd, codes + e / 2, 8);
              for (uint32_t j = 0; j < kChunk; ++j)
                store(start + e + j,
                      math::int4_dequantize_nibble(wd[j / 8] >> (4 * (j % 8)), scale));
            } else {
              for (uint32_t i = e; i < n; ++i)
                store(start + i,
                      math::int4_dequantize_nibble(codes[i / 2] >> (4 * (i & 1)), scale));
            }
          }
        } else {
          for (uint32_t i = 0; i < n; ++i) {
            const uint64_t e = row_offset + start + i;
            store(start + i,
                  math::int4_dequantize_nibble(body[codes_at + e / 2] >> (4 * (e & 1)), scale));
          }
        }
      }
    }
    first_block += blocks;
    row_offset += static_cast<uint64_t>(run.numel);
    offset_bytes += static_cast<uint64_t>(run.numel) * math::dtype_bytes(run.dtype);
  }
  return out;
}

// Normal values with outliers, zero blocks, exact ties, tiny blocks (the division path) and huge
// ones, as each run's dtype.
Row make_row(std::vector<Int8Run> runs, uint32_t block, uint32_t seed) {
  Row row{std::move(runs), block, {}};
  row.bytes.assign(int8_row_bytes(row.runs.data(), row.num_runs()), 0);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  uint8_t* at = row.bytes.data();
  for (const Int8Run& r : row.runs) {
    for (int64_t i = 0; i < r.numel; ++i) {
      const int64_t blk = i / block;
      float v = nd(rng) * (i % 97 == 5 ? 40.0f : 1.0f);
      if (blk % 7 == 3) v = 0.0f;
      if (blk % 7 == 2) v = (i % block == 0) ? 7.0f : 0.5f * static_cast<float>(i % 15 - 7);
      if (blk % 7 == 5 && r.dtype == math::kDtypeF32) v *= 1e-35f;
      if (blk % 11 == 6 && r.dtype != math::kDtypeF16) v *= 1e30f;
      math::store_from_float(at, i, r.dtype, v);
    }
    at += r.numel * math::dtype_bytes(r.dtype);
  }
  return row;
}

std::vector<Row> rows() {
  using math::kDtypeBF16;
  using math::kDtypeF16;
  using math::kDtypeF32;
  std::vector<Row> out;
  uint32_t seed = 1;
  for (uint8_t dt : {kDtypeF32, kDtypeF16, kDtypeBF16})
    for (uint32_t block : {16u, 32u, 64u, 4096u})
      for (int64_t n : {1, 15, 16, 17, 33, 255, 1000, 4097})
        out.push_back(make_row({{dt, n}}, block, seed++));
  // Runs at odd and at aligned row offsets, dtypes mixed.
  out.push_back(make_row({{kDtypeF32, 17}, {kDtypeBF16, 16}, {kDtypeF16, 33}}, 16, seed++));
  out.push_back(make_row({{kDtypeBF16, 32}, {kDtypeF32, 1000}, {kDtypeF16, 1}}, 32, seed++));
  out.push_back(make_row({{kDtypeF16, 3}, {kDtypeF16, 5}, {kDtypeF32, 130}}, 64, seed++));
  out.push_back(make_row({{kDtypeBF16, 1}}, 16, seed++));
  return out;
}

TEST(Int4V2Map, EncodeWritesEveryNibbleOnceAndEqualsTheReference) {
  for (const Row& row : rows()) {
    const uint64_t total = int4_row_payload_bytes(row.runs.data(), row.num_runs(), row.block);
    std::vector<uint8_t> want(total);
    const uint64_t want_at = cpu::int4_encode_row(row.bytes.data(), row.runs.data(), row.num_runs(),
                                                  row.block, want.data());
    ASSERT_EQ(want_at, 0u);
    for (uintptr_t address : {0, 4, 8}) {
      for (int approx : {0, -1, 1}) {
        SCOPED_TRACE(::testing::Message()
                     << "runs " << row.num_runs() << " numel " << row.runs[0].numel << " dtype "
                     << int(row.runs[0].dtype) << " block " << row.block << " address " << address
                     << " approx " << approx);
        uint64_t at = 1;
        std::vector<int> writes;
        ASSERT_EQ(replay_encode(row, address, approx, &at, &writes), want);
        EXPECT_EQ(at, 0u);
        for (uint64_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "body nibble " << i;
      }
    }
  }
}

TEST(Int4V2Map, ANonFiniteWeightIsReportedAtItsRowOffsetWithTheReferencesFlaggedPayload) {
  Row row =
      make_row({{math::kDtypeF32, 17}, {math::kDtypeBF16, 300}, {math::kDtypeF32, 40}}, 32, 5);
  for (int64_t bad : {int64_t{3}, int64_t{17 + 100}, int64_t{17 + 300 + 39}}) {
    Row r = row;
    const bool in_bf16 = bad >= 17 && bad < 317;
    uint8_t* run_at = r.bytes.data() + (bad < 17 ? 0 : (in_bf16 ? 17 * 4 : 17 * 4 + 300 * 2));
    const int64_t i = bad < 17 ? bad : (in_bf16 ? bad - 17 : bad - 317);
    math::store_from_float(run_at, i, in_bf16 ? math::kDtypeBF16 : math::kDtypeF32, NAN);
    std::vector<uint8_t> want(int4_row_payload_bytes(r.runs.data(), 3, 32));
    const uint64_t want_at =
        cpu::int4_encode_row(r.bytes.data(), r.runs.data(), 3, 32, want.data());
    EXPECT_EQ(want_at, static_cast<uint64_t>(bad) + 1);
    for (uintptr_t address : {0, 4}) {
      uint64_t at = 0;
      std::vector<int> writes;
      EXPECT_EQ(replay_encode(r, address, 0, &at, &writes), want) << bad;
      EXPECT_EQ(at, want_at);
    }
  }
}

TEST(Int4V2Map, DecodeWritesEveryElementOnceAndEqualsTheReference) {
  for (const Row& row : rows()) {
    const uint64_t total = int4_row_payload_bytes(row.runs.data(), row.num_runs(), row.block);
    std::vector<uint8_t> payload(total);
    cpu::int4_encode_row(row.bytes.data(), row.runs.data(), row.num_runs(), row.block,
                         payload.data());
    const uint64_t row_bytes = int8_row_bytes(row.runs.data(), row.num_runs());
    std::vector<uint8_t> want(row_bytes);
    cpu::int4_decode_row(payload.data(), row.runs.data(), row.num_runs(), row.block, want.data());
    for (uintptr_t address : {0, 4}) {
      for (int rows : {1, 2}) {
        // Rows side by side whose size leaves the next row's elements unaligned are refused by the
        // CUDA backend (int8_alignment_problem) before any launch: no kernel runs them.
        if (int8_alignment_problem(row.runs.data(), row.num_runs(),
                                   reinterpret_cast<const void*>(address), rows > 1) != nullptr)
          continue;
        std::vector<int> writes;
        const std::vector<uint8_t> got = replay_decode(row, payload, address, rows, &writes);
        for (int w = 0; w < rows; ++w)
          ASSERT_TRUE(std::equal(want.begin(), want.end(), got.begin() + row_bytes * w))
              << "row " << w << " address " << address << " block " << row.block;
        for (uint64_t i = 0; i < writes.size(); ++i) ASSERT_EQ(writes[i], 1) << "element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace gradcomp
