// The AVX2 and AVX-512 q4 loops, with the portable loops' bytes. One file over 400 lines: the
// two instruction sets share one chunk loop (AVX-512 replaces its Philox and quantize passes), and
// splitting them would put target-attributed helpers in a header.
#include "cpu_q4_loops.h"

#if GRADCOMP_X86
#include <algorithm>
#include <cstring>

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12's unmasked AVX-512 intrinsics pass _mm512_undefined_epi32() as the merge source, which
// its own -Wmaybe-uninitialized then reports at every call.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
// Function-level targets keep AVX2 out of every other function, so the library still runs on
// CPUs without it; FMA is deliberately not enabled (contraction would change the bytes).
#define GRADCOMP_AVX2 __attribute__((target("avx2")))
#define GRADCOMP_AVX512 __attribute__((target("avx2,avx512f")))

namespace gradcomp {
namespace cpu {
namespace detail {
namespace {

// Philox's key words for each of its ten rounds, as math::philox4x32_10 advances them.
struct RoundKeys {
  uint32_t k0[10], k1[10];
  explicit RoundKeys(const math::RngKey& key) {
    uint32_t a = math::philox_key0(key), b = math::philox_key1(key);
    for (int round = 0; round < 10; ++round, a += math::kPhiloxWeyl0, b += math::kPhiloxWeyl1) {
      k0[round] = a;
      k1[round] = b;
    }
  }
};

GRADCOMP_AVX2 inline void mulhilo8(__m256i a, __m256i m, __m256i* hi, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
}

// Philox4x32-10 for kWays x 8 consecutive groups, lane j of way v computing group
// first_group + 8 v + j, stored as the words of the results in group order (the r16 layout of
// math::random16). Independent ways interleave so the multiplies' latency overlaps.
template <int kWays>
GRADCOMP_AVX2 inline void philox8(const __m256i* round_k0, const __m256i* round_k1, __m256i step,
                                  __m256i bucket, uint64_t first_group, uint16_t* r16) {
  __m256i c0[kWays], c1[kWays], c2[kWays], c3[kWays];
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int v = 0; v < kWays; ++v) {
    const uint64_t g = first_group + 8 * v;
    const uint32_t g_lo = static_cast<uint32_t>(g);
    c0[v] = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(g_lo)), lane);
    // Lanes whose low word wrapped past 2^32 (unsigned c0 < g_lo) carry into the high word.
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i wrapped = _mm256_cmpgt_epi32(
        _mm256_set1_epi32(static_cast<int>(g_lo ^ 0x80000000u)), _mm256_xor_si256(c0[v], sign));
    c1[v] = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(g >> 32)), wrapped);
    c2[v] = step;
    c3[v] = bucket;
  }
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(math::kPhiloxMul0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(math::kPhiloxMul1));
  for (int round = 0; round < 10; ++round) {
    for (int v = 0; v < kWays; ++v) {
      __m256i hi0, lo0, hi1, lo1;
      mulhilo8(c0[v], m0, &hi0, &lo0);
      mulhilo8(c2[v], m1, &hi1, &lo1);
      c0[v] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[v]), round_k0[round]);
      c2[v] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[v]), round_k1[round]);
      c1[v] = lo1;
      c3[v] = lo0;
    }
  }
  for (int v = 0; v < kWays; ++v) {
    // 4 x 8 transpose: word w of group j goes to words [4 j + w].
    const __m256i t0 = _mm256_unpacklo_epi32(c0[v], c1[v]);
    const __m256i t1 = _mm256_unpackhi_epi32(c0[v], c1[v]);
    const __m256i t2 = _mm256_unpacklo_epi32(c2[v], c3[v]);
    const __m256i t3 = _mm256_unpackhi_epi32(c2[v], c3[v]);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* out = reinterpret_cast<__m256i*>(r16) + 4 * v;
    _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u1, 0x20));
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
    _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
  }
}

GRADCOMP_AVX2 void random_bits_avx2(const math::RngKey& key, int64_t first_element, int n,
                                    uint16_t* r16) {
  const RoundKeys keys(key);
  __m256i k0v[10], k1v[10];
  for (int round = 0; round < 10; ++round) {
    k0v[round] = _mm256_set1_epi32(static_cast<int>(keys.k0[round]));
    k1v[round] = _mm256_set1_epi32(static_cast<int>(keys.k1[round]));
  }
  const __m256i step = _mm256_set1_epi32(static_cast<int>(key.step));
  const __m256i bucket = _mm256_set1_epi32(static_cast<int>(key.bucket));
  constexpr int kWays = 4;
  constexpr int kBatch = kWays * 8 * math::kRandomGroup;
  int i = 0;
  for (; i + kBatch <= n; i += kBatch) {
    philox8<kWays>(k0v, k1v, step, bucket,
                   static_cast<uint64_t>((first_element + i) / math::kRandomGroup), r16 + i);
  }
  if (i < n) random_bits_portable(key, first_element + i, n - i, r16 + i);
}

// Philox4x32-10 for kWays x 16 consecutive groups with 512-bit lanes: the same rounds as
// philox8, with masked shuffles for the hi/lo halves and one ternary-logic op per xor pair.
template <int kWays>
GRADCOMP_AVX512 inline void philox16(const __m512i* round_k0, const __m512i* round_k1, __m512i step,
                                     __m512i bucket, uint64_t first_group, uint16_t* r16) {
  __m512i c0[kWays], c1[kWays], c2[kWays], c3[kWays];
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int v = 0; v < kWays; ++v) {
    const uint64_t g = first_group + 16 * v;
    const __m512i g_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g)));
    const __m512i g_hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(g >> 32)));
    c0[v] = _mm512_add_epi32(g_lo, lane);
    // Lanes whose low word wrapped past 2^32 carry into the high word.
    const __mmask16 wrapped = _mm512_cmplt_epu32_mask(c0[v], g_lo);
    c1[v] = _mm512_mask_add_epi32(g_hi, wrapped, g_hi, _mm512_set1_epi32(1));
    c2[v] = step;
    c3[v] = bucket;
  }
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(math::kPhiloxMul0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(math::kPhiloxMul1));
  constexpr auto kOddWords = static_cast<_MM_PERM_ENUM>(0xF5);   // dwords 1, 1, 3, 3
  constexpr auto kEvenWords = static_cast<_MM_PERM_ENUM>(0xA0);  // dwords 0, 0, 2, 2
  for (int round = 0; round < 10; ++round) {
    for (int v = 0; v < kWays; ++v) {
      const __m512i even0 = _mm512_mul_epu32(c0[v], m0);
      const __m512i odd0 = _mm512_mul_epu32(_mm512_srli_epi64(c0[v], 32), m0);
      const __m512i even1 = _mm512_mul_epu32(c2[v], m1);
      const __m512i odd1 = _mm512_mul_epu32(_mm512_srli_epi64(c2[v], 32), m1);
      const __m512i hi0 = _mm512_mask_shuffle_epi32(odd0, 0x5555, even0, kOddWords);
      const __m512i hi1 = _mm512_mask_shuffle_epi32(odd1, 0x5555, even1, kOddWords);
      const __m512i lo0 = _mm512_mask_shuffle_epi32(even0, 0xAAAA, odd0, kEvenWords);
      const __m512i lo1 = _mm512_mask_shuffle_epi32(even1, 0xAAAA, odd1, kEvenWords);
      c0[v] = _mm512_ternarylogic_epi32(hi1, c1[v], round_k0[round], 0x96);  // a ^ b ^ c
      c2[v] = _mm512_ternarylogic_epi32(hi0, c3[v], round_k1[round], 0x96);
      c1[v] = lo1;
      c3[v] = lo0;
    }
  }
  for (int v = 0; v < kWays; ++v) {
    // 4 x 16 transpose: each 128-bit lane of u_j ends up holding one group's four words.
    const __m512i t0 = _mm512_unpacklo_epi32(c0[v], c1[v]);
    const __m512i t1 = _mm512_unpackhi_epi32(c0[v], c1[v]);
    const __m512i t2 = _mm512_unpacklo_epi32(c2[v], c3[v]);
    const __m512i t3 = _mm512_unpackhi_epi32(c2[v], c3[v]);
    const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
    const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
    const __m512i a01 = _mm512_shuffle_i32x4(u0, u1, 0x44),
                  a23 = _mm512_shuffle_i32x4(u2, u3, 0x44);
    const __m512i b01 = _mm512_shuffle_i32x4(u0, u1, 0xEE),
                  b23 = _mm512_shuffle_i32x4(u2, u3, 0xEE);
    __m512i* out = reinterpret_cast<__m512i*>(r16) + 4 * v;
    _mm512_storeu_si512(out + 0, _mm512_shuffle_i32x4(a01, a23, 0x88));
    _mm512_storeu_si512(out + 1, _mm512_shuffle_i32x4(a01, a23, 0xDD));
    _mm512_storeu_si512(out + 2, _mm512_shuffle_i32x4(b01, b23, 0x88));
    _mm512_storeu_si512(out + 3, _mm512_shuffle_i32x4(b01, b23, 0xDD));
  }
}

GRADCOMP_AVX512 void random_bits_avx512(const math::RngKey& key, int64_t first_element, int n,
                                        uint16_t* r16) {
  const RoundKeys keys(key);
  __m512i k0v[10], k1v[10];
  for (int round = 0; round < 10; ++round) {
    k0v[round] = _mm512_set1_epi32(static_cast<int>(keys.k0[round]));
    k1v[round] = _mm512_set1_epi32(static_cast<int>(keys.k1[round]));
  }
  const __m512i step = _mm512_set1_epi32(static_cast<int>(key.step));
  const __m512i bucket = _mm512_set1_epi32(static_cast<int>(key.bucket));
  constexpr int kWays = 4;
  constexpr int kBatch = kWays * 16 * math::kRandomGroup;
  int i = 0;
  for (; i + kBatch <= n; i += kBatch) {
    philox16<kWays>(k0v, k1v, step, bucket,
                    static_cast<uint64_t>((first_element + i) / math::kRandomGroup), r16 + i);
  }
  if (i < n) random_bits_portable(key, first_element + i, n - i, r16 + i);
}

GRADCOMP_AVX2 inline void prefetch_line(const void* base, int offset) {
  _mm_prefetch(static_cast<const char*>(base) + offset, _MM_HINT_T0);
}

// Codes of 16 elements (values 0..15 in two vectors, element order) packed two per byte.
GRADCOMP_AVX2 inline void store_nibbles16(__m256i lo8, __m256i hi8, uint8_t* out) {
  // int16 elements 0..15 in order, then each 32-bit pair (e0 | e1 << 16) folds into one byte.
  const __m256i e = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo8, hi8), 0xD8);
  const __m256i folded = _mm256_or_si256(e, _mm256_srli_epi32(e, 12));
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(folded, pick);
  const __m128i joined =
      _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), joined);
}

// Codes q in [-7, 7] of eight elements, as math::q4_quantize_positive_step computes them.
template <bool kStochastic>
GRADCOMP_AVX2 inline __m256i quantize8(__m256 x, __m256 step, const uint16_t* r16) {
  const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(x, step), _mm256_set1_ps(-7.0f)),
                                 _mm256_set1_ps(7.0f));
  // floor differs from the reference's truncate-and-correct only for t = -0 (giving -0, not
  // +0), where frac is a zero either way and the code is 0: the same bytes.
  const __m256 floor_t = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256i fl = _mm256_cvttps_epi32(floor_t);
  const __m256 frac = _mm256_sub_ps(t, floor_t);
  __m256 bar;
  if (kStochastic) {
    const __m256i bits =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r16)));
    bar = _mm256_mul_ps(_mm256_cvtepi32_ps(bits), _mm256_set1_ps(1.0f / 65536.0f));
  } else {
    const __m256i one = _mm256_set1_epi32(1);
    const __m256 odd = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(fl, one), one));
    bar = _mm256_blendv_ps(_mm256_set1_ps(0.5f), _mm256_set1_ps(0x1.fffffep-2f), odd);
  }
  const __m256 up = _mm256_cmp_ps(bar, frac, _CMP_LT_OQ);
  return _mm256_min_epi32(_mm256_sub_epi32(fl, _mm256_castps_si256(up)),
                          _mm256_set1_epi32(math::kQ4MaxCode));
}

// One 64-byte line of the next chunk per 16 elements hides the memory latency behind this
// chunk's arithmetic (it halves the single-thread time; the hardware prefetcher alone does not
// run far enough ahead).
GRADCOMP_AVX2 inline void prefetch_next(const Q4EncodeChunk& c, int i) {
  if (c.next_input != nullptr) prefetch_line(c.next_input, i * c.next_input_stride);
  if (c.next_residual_in != nullptr) prefetch_line(c.next_residual_in, i * c.next_residual_stride);
}

// Pass 2 of one block with 512-bit vectors: quantize8's operations on 16 lanes, with the codes
// folded in 64-bit lanes and narrowed by one vpmovqb.
template <bool kResidualOut, bool kStochastic>
GRADCOMP_AVX512 void quantize_block_avx512(const Q4EncodeChunk& c, int s, float step,
                                           const float* acc, const uint16_t* r16) {
  const __m512 stepv = _mm512_set1_ps(step);
  const __m512i one = _mm512_set1_epi32(1);
  for (int i = s; i < s + c.block; i += 16) {
    prefetch_next(c, i);
    const __m512 a = _mm512_load_ps(acc + i);
    const __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(a, stepv), _mm512_set1_ps(-7.0f)),
                                   _mm512_set1_ps(7.0f));
    const __m512 floor_t = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512i fl = _mm512_cvttps_epi32(floor_t);
    const __m512 frac = _mm512_sub_ps(t, floor_t);
    __m512 bar;
    if (kStochastic) {
      const __m512i bits =
          _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(r16 + i)));
      bar = _mm512_mul_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(1.0f / 65536.0f));
    } else {
      bar = _mm512_mask_blend_ps(_mm512_test_epi32_mask(fl, one), _mm512_set1_ps(0.5f),
                                 _mm512_set1_ps(0x1.fffffep-2f));
    }
    const __mmask16 up = _mm512_cmp_ps_mask(bar, frac, _CMP_LT_OQ);
    const __m512i q = _mm512_min_epi32(_mm512_mask_add_epi32(fl, up, fl, one),
                                       _mm512_set1_epi32(math::kQ4MaxCode));
    const __m512i nibbles = _mm512_add_epi32(q, _mm512_set1_epi32(math::kQ4ZeroNibble));
    const __m512i folded = _mm512_or_si512(nibbles, _mm512_srli_epi64(nibbles, 28));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(c.codes + i / 2), _mm512_cvtepi64_epi8(folded));
    if (kResidualOut) {
      _mm512_storeu_ps(c.residual_out + i,
                       _mm512_sub_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(q), stepv)));
    }
  }
}

// Pass 1 with 512-bit vectors: acc = input + residual and each full block's step.
template <bool kResidualIn>
GRADCOMP_AVX512 void block_sums_avx512(const Q4EncodeChunk& c, int full_blocks, float* acc,
                                       float* steps) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int b = 0; b < full_blocks; ++b) {
    __m512i absmax = _mm512_setzero_si512();
    for (int i = b * c.block; i < (b + 1) * c.block; i += 16) {
      const __m512 r = kResidualIn ? _mm512_loadu_ps(c.residual_in + i) : _mm512_setzero_ps();
      const __m512 a = _mm512_add_ps(_mm512_loadu_ps(c.input + i), r);
      _mm512_store_ps(acc + i, a);
      absmax = _mm512_max_epu32(absmax, _mm512_and_si512(_mm512_castps_si512(a), abs_mask));
    }
    steps[b] = math::q4_step_from_absmax_bits(_mm512_reduce_max_epu32(absmax));
  }
}

// Full blocks first get their sums and steps (pass 1), then their codes and residuals (pass 2),
// so no block's quantization waits on its own step. Blocks whose step is not positive (all zero
// or non-finite) and a partial last block go to the reference, which re-reads the inputs: pass 2
// writes only its own block's residual, so an aliased residual_in is still intact there.
template <bool kResidualIn, bool kResidualOut, bool kStochastic>
GRADCOMP_AVX2 void encode_chunk_avx2(const Q4EncodeChunk& c, bool wide) {
  alignas(64) uint16_t random_bits[kQ4ChunkElements];
  alignas(64) float acc[kQ4ChunkElements];
  float steps[kQ4ChunkElements / 16];
  const uint16_t* r16 = nullptr;
  if (kStochastic) {
    if (wide) {
      random_bits_avx512(c.rng, c.first_element, c.n, random_bits);
    } else {
      random_bits_avx2(c.rng, c.first_element, c.n, random_bits);
    }
    r16 = random_bits;
  }
  const int full_blocks = c.n / c.block;
  if (wide) block_sums_avx512<kResidualIn>(c, full_blocks, acc, steps);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  for (int b = 0; !wide && b < full_blocks; ++b) {
    __m256i absmax = _mm256_setzero_si256();
    for (int i = b * c.block; i < (b + 1) * c.block; i += 8) {
      const __m256 r = kResidualIn ? _mm256_loadu_ps(c.residual_in + i) : _mm256_setzero_ps();
      const __m256 a = _mm256_add_ps(_mm256_loadu_ps(c.input + i), r);
      _mm256_store_ps(acc + i, a);
      absmax = _mm256_max_epu32(absmax, _mm256_and_si256(_mm256_castps_si256(a), abs_mask));
    }
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(absmax), _mm256_extracti128_si256(absmax, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    steps[b] = math::q4_step_from_absmax_bits(static_cast<uint32_t>(_mm_cvtsi128_si32(m)));
  }
  const __m256i zero_nibble = _mm256_set1_epi32(math::kQ4ZeroNibble);
  for (int b = 0; b < full_blocks; ++b) {
    const int s = b * c.block;
    if (!(steps[b] > 0.0f)) {
      encode_block_portable(c, s, c.block, r16);
      continue;
    }
    std::memcpy(&c.scales[b], &steps[b], 4);
    if (wide) {
      quantize_block_avx512<kResidualOut, kStochastic>(c, s, steps[b], acc, r16);
      continue;
    }
    const __m256 stepv = _mm256_set1_ps(steps[b]);
    for (int i = s; i < s + c.block; i += 16) {
      prefetch_next(c, i);
      const __m256 a0 = _mm256_load_ps(acc + i), a1 = _mm256_load_ps(acc + i + 8);
      const __m256i q0 = quantize8<kStochastic>(a0, stepv, kStochastic ? r16 + i : nullptr);
      const __m256i q1 = quantize8<kStochastic>(a1, stepv, kStochastic ? r16 + i + 8 : nullptr);
      store_nibbles16(_mm256_add_epi32(q0, zero_nibble), _mm256_add_epi32(q1, zero_nibble),
                      c.codes + i / 2);
      if (kResidualOut) {
        _mm256_storeu_ps(c.residual_out + i,
                         _mm256_sub_ps(a0, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), stepv)));
        _mm256_storeu_ps(c.residual_out + i + 8,
                         _mm256_sub_ps(a1, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), stepv)));
      }
    }
  }
  const int tail = full_blocks * c.block;
  if (tail < c.n) encode_block_portable(c, tail, c.n - tail, r16);
}

}  // namespace

GRADCOMP_AVX2 void encode_chunk_x86(const Q4EncodeChunk& c, bool wide) {
  const bool rin = c.residual_in != nullptr, rout = c.residual_out != nullptr;
  if (c.stochastic) {
    if (rin && rout) return encode_chunk_avx2<true, true, true>(c, wide);
    if (rin) return encode_chunk_avx2<true, false, true>(c, wide);
    if (rout) return encode_chunk_avx2<false, true, true>(c, wide);
    return encode_chunk_avx2<false, false, true>(c, wide);
  }
  if (rin && rout) return encode_chunk_avx2<true, true, false>(c, false);
  if (rin) return encode_chunk_avx2<true, false, false>(c, false);
  if (rout) return encode_chunk_avx2<false, true, false>(c, false);
  return encode_chunk_avx2<false, false, false>(c, false);
}

GRADCOMP_AVX2 bool decode_chunk_x86(const Q4DecodeChunk& c) {
  const int vec_n = c.n / 16 * 16;
  const __m128i low_nibble = _mm_set1_epi8(0x0F);
  const __m256i zero_nibble = _mm256_set1_epi32(math::kQ4ZeroNibble);
  for (int w = 0; w < c.num_payloads; ++w) {
    const uint8_t* scales = c.payloads[w] + c.scales_offset;
    const uint8_t* codes = c.payloads[w] + c.codes_offset;
    for (int i = 0; i < vec_n; i += 16) {
      float step;
      std::memcpy(&step, scales + 4 * (i / c.block), 4);
      const __m256 stepv = _mm256_set1_ps(step);
      const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
      const __m128i nibbles = _mm_unpacklo_epi8(
          _mm_and_si128(packed, low_nibble), _mm_and_si128(_mm_srli_epi16(packed, 4), low_nibble));
      const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(nibbles), zero_nibble);
      const __m256i q1 =
          _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(nibbles, 8)), zero_nibble);
      const __m256 d0 = _mm256_mul_ps(_mm256_cvtepi32_ps(q0), stepv);
      const __m256 d1 = _mm256_mul_ps(_mm256_cvtepi32_ps(q1), stepv);
      const __m256 s0 = w == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(c.sum + i);
      const __m256 s1 = w == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(c.sum + i + 8);
      _mm256_storeu_ps(c.sum + i, _mm256_add_ps(s0, d0));
      _mm256_storeu_ps(c.sum + i + 8, _mm256_add_ps(s1, d1));
    }
  }
  const __m256 divisor = _mm256_set1_ps(c.divisor);
  const __m256i exp_mask = _mm256_set1_epi32(0x7F800000);
  __m256i nonfinite = _mm256_setzero_si256();
  for (int i = 0; i < vec_n; i += 8) {
    const __m256 v = _mm256_div_ps(_mm256_loadu_ps(c.sum + i), divisor);
    _mm256_storeu_ps(c.sum + i, v);
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(v), exp_mask);
    nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpeq_epi32(e, exp_mask));
  }
  bool tail_nonfinite = false;
  if (vec_n < c.n) {
    Q4DecodeChunk tail = c;
    tail.scales_offset = c.scales_offset + 4 * static_cast<uint64_t>(vec_n / c.block);
    tail.codes_offset = c.codes_offset + static_cast<uint64_t>(vec_n / 2);
    tail.sum = c.sum + vec_n;
    tail.n = c.n - vec_n;
    tail_nonfinite = decode_chunk_portable(tail);
  }
  return tail_nonfinite || !_mm256_testz_si256(nonfinite, nonfinite);
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp

#endif  // GRADCOMP_X86
