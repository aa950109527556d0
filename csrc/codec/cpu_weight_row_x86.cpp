// The AVX2 weight row loops (int8, 4-bit), with the portable loops' bytes: 16 elements per step,
// unaligned loads and stores (a run of a mixed-dtype row may start at any byte), the portable math
// for tails.
#include "cpu_weight_row_loops.h"

#if GRADCOMP_X86
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "cpu_element_io.h"
#include "gradcomp/format.h"

// A function-level target keeps AVX2 out of every other function (the library still runs on CPUs
// without it); FMA is deliberately not enabled (contraction would change the bytes).
#define GRADCOMP_AVX2 __attribute__((target("avx2")))

namespace gradcomp {
namespace cpu {
namespace detail {
namespace {

constexpr uint32_t kNonfiniteBits = 0x7F800000u;

// Eight elements as fp32 (exact): fp32 or bf16 only; fp16 runs are staged through fp32 first.
template <uint8_t kDtype>
GRADCOMP_AVX2 inline __m256 load8(const uint8_t* at, int64_t i) {
  if (kDtype == math::kDtypeF32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at + 4 * i));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 2 * i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Codes of eight elements as int32, as math::int8_quantize and math::int4_quantize compute them:
// x / scale correctly rounded, clamped to [-max, max] (rintf is monotone and the bounds are
// integers, so clamping first gives the same codes), rounded to nearest, ties to even.
template <CodeRules kRules>
GRADCOMP_AVX2 inline __m256i quantize8(__m256 x, __m256 scale) {
  const float bound = static_cast<float>(max_code<kRules>());
  const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(x, scale), _mm256_set1_ps(-bound)),
                                 _mm256_set1_ps(bound));
  return _mm256_cvttps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Encodes one block of n elements at `at`; returns 0, or 1 + the block offset of its first
// non-finite element (then nothing is written).
template <uint8_t kDtype, CodeRules kRules>
GRADCOMP_AVX2 uint64_t encode_block(const uint8_t* at, int n, uint8_t* scale_out, int8_t* codes) {
  const int vec = n / 16 * 16;
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i mv = _mm256_setzero_si256();
  for (int i = 0; i < vec; i += 8)
    mv =
        _mm256_max_epu32(mv, _mm256_and_si256(_mm256_castps_si256(load8<kDtype>(at, i)), abs_mask));
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mv), _mm256_extracti128_si256(mv, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
  uint32_t m = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
  for (int i = vec; i < n; ++i)
    m = std::max(m, math::float_bits(load_element<kDtype>(at, i)) & 0x7FFFFFFFu);
  if (m >= kNonfiniteBits) {
    for (int i = 0; i < n; ++i)
      if ((math::float_bits(load_element<kDtype>(at, i)) & 0x7FFFFFFFu) >= kNonfiniteBits)
        return 1 + i;
  }
  const uint16_t sbits = scale_bits<kRules>(math::bits_float(m));
  std::memcpy(scale_out, &sbits, 2);
  const float scale = math::bf16_to_float(sbits);
  if (!(scale > 0.0f)) {
    std::memset(codes, 0, static_cast<size_t>(n));
    return 0;
  }
  const __m256 sv = _mm256_set1_ps(scale);
  // The two packs leave the code dwords as q0[0..3] q1[0..3] 0 0 | q0[4..7] q1[4..7] 0 0.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < vec; i += 16) {
    const __m256i q0 = quantize8<kRules>(load8<kDtype>(at, i), sv);
    const __m256i q1 = quantize8<kRules>(load8<kDtype>(at, i + 8), sv);
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_setzero_si256()), order);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm256_castsi256_si128(bytes));
  }
  for (int i = vec; i < n; ++i)
    codes[i] = static_cast<int8_t>(quantize<kRules>(load_element<kDtype>(at, i), scale));
  return 0;
}

template <uint8_t kDtype, CodeRules kRules>
GRADCOMP_AVX2 uint64_t encode_run(const Int8EncodeRun& r) {
  const int64_t size = math::dtype_bytes(kDtype);
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int n = static_cast<int>(std::min<int64_t>(r.block, r.numel - start));
    const uint64_t bad =
        encode_block<kDtype, kRules>(r.input + start * size, n, r.scales + 2 * b, r.codes + start);
    if (bad != 0) return static_cast<uint64_t>(start) + bad;
  }
  return 0;
}

// fp16 runs: each block converted to fp32 (exact) on the host's scalar path, then the fp32 loop.
template <CodeRules kRules>
GRADCOMP_AVX2 uint64_t encode_run_f16(const Int8EncodeRun& r) {
  alignas(32) float staged[math::kInt8MaxBlock];
  const auto* staged_bytes = reinterpret_cast<const uint8_t*>(staged);
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int n = static_cast<int>(std::min<int64_t>(r.block, r.numel - start));
    for (int i = 0; i < n; ++i) staged[i] = load_element<math::kDtypeF16>(r.input, start + i);
    const uint64_t bad =
        encode_block<math::kDtypeF32, kRules>(staged_bytes, n, r.scales + 2 * b, r.codes + start);
    if (bad != 0) return static_cast<uint64_t>(start) + bad;
  }
  return 0;
}

// bf16 bits of eight fp32 values in the low halves of 32-bit lanes, as math::float_to_bf16.
GRADCOMP_AVX2 inline __m256i to_bf16_8(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(static_cast<int>(kNonfiniteBits)));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

// code * scale as math::int8_dequantize gives it: x86 passes on an operand's NaN (a forged scale),
// the element math writes the canonical one.
GRADCOMP_AVX2 inline __m256 dequantize8(__m128i codes8, __m256 scale) {
  const __m256 d = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes8)), scale);
  const __m256 canonical =
      _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(math::kCanonicalNanBits)));
  return _mm256_blendv_ps(d, canonical, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
}

template <uint8_t kDtype>
GRADCOMP_AVX2 void decode_block(const int8_t* codes, int n, float scale, uint8_t* out) {
  const int vec = n / 16 * 16;
  const __m256 sv = _mm256_set1_ps(scale);
  for (int i = 0; i < vec; i += 16) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    const __m256 d0 = dequantize8(c, sv), d1 = dequantize8(_mm_srli_si128(c, 8), sv);
    if (kDtype == math::kDtypeF32) {
      _mm256_storeu_ps(reinterpret_cast<float*>(out + 4 * i), d0);
      _mm256_storeu_ps(reinterpret_cast<float*>(out + 4 * i + 32), d1);
    } else if (kDtype == math::kDtypeBF16) {
      const __m256i h =
          _mm256_permute4x64_epi64(_mm256_packus_epi32(to_bf16_8(d0), to_bf16_8(d1)), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * i), h);
    } else {
      alignas(32) float d[16];
      _mm256_store_ps(d, d0);
      _mm256_store_ps(d + 8, d1);
      for (int j = 0; j < 16; ++j) {
        const uint16_t h = math::float_to_half(d[j]);
        std::memcpy(out + 2 * (i + j), &h, 2);
      }
    }
  }
  for (int i = vec; i < n; ++i)
    store_element<kDtype>(out, i, math::int8_dequantize(codes[i], scale));
}

template <uint8_t kDtype>
GRADCOMP_AVX2 void decode_run(const Int8DecodeRun& r) {
  const int64_t size = math::dtype_bytes(kDtype);
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int n = static_cast<int>(std::min<int64_t>(r.block, r.numel - start));
    uint16_t sbits;
    std::memcpy(&sbits, r.scales + 2 * b, 2);
    decode_block<kDtype>(r.codes + start, n, math::bf16_to_float(sbits), r.output + start * size);
  }
}

// w * f mod 2^64 per 64-bit lane, w < 2^32.
GRADCOMP_AVX2 inline __m256i mul_u32_u64(__m256i w, __m256i f) {
  const __m256i high = _mm256_mul_epu32(w, _mm256_srli_epi64(f, 32));
  return _mm256_add_epi64(_mm256_mul_epu32(w, f), _mm256_slli_epi64(high, 32));
}

template <CodeRules kRules>
uint64_t encode_run_of_rules(const Int8EncodeRun& r) {
  if (r.dtype == math::kDtypeF32) return encode_run<math::kDtypeF32, kRules>(r);
  if (r.dtype == math::kDtypeF16) return encode_run_f16<kRules>(r);
  return encode_run<math::kDtypeBF16, kRules>(r);
}

}  // namespace

uint64_t encode_run_avx2(const Int8EncodeRun& r) {
  return r.rules == CodeRules::kInt8 ? encode_run_of_rules<CodeRules::kInt8>(r)
                                     : encode_run_of_rules<CodeRules::kInt4>(r);
}

void decode_run_avx2(const Int8DecodeRun& r) {
  if (r.dtype == math::kDtypeF32) return decode_run<math::kDtypeF32>(r);
  if (r.dtype == math::kDtypeF16) return decode_run<math::kDtypeF16>(r);
  decode_run<math::kDtypeBF16>(r);
}

// Words 8 at a time, their factors 2 i + 1 in 64-bit lanes: the same sum mod 2^64.
GRADCOMP_AVX2 uint64_t body_sum_avx2(const uint8_t* body, uint64_t words) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  __m256i f0 = _mm256_setr_epi64x(1, 3, 5, 7), f1 = _mm256_setr_epi64x(9, 11, 13, 15);
  const __m256i step = _mm256_set1_epi64x(16);
  uint64_t i = 0;
  for (; i + 8 <= words; i += 8) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 4 * i));
    acc0 =
        _mm256_add_epi64(acc0, mul_u32_u64(_mm256_cvtepu32_epi64(_mm256_castsi256_si128(w)), f0));
    acc1 = _mm256_add_epi64(acc1,
                            mul_u32_u64(_mm256_cvtepu32_epi64(_mm256_extracti128_si256(w, 1)), f1));
    f0 = _mm256_add_epi64(f0, step);
    f1 = _mm256_add_epi64(f1, step);
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(acc0, acc1));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3] + body_sum_portable(body, i, words);
}

// 32 codes into 16 bytes per step: each 16-bit lane holds an even code (low byte) and the odd one
// after it, which become the lane's nibbles; the pack to bytes works within 128-bit halves, and
// the permute puts the two halves' eight bytes side by side.
GRADCOMP_AVX2 void pack_codes_avx2(const int8_t* codes, int64_t n, uint64_t first,
                                   uint8_t* packed) {
  if ((first & 1) != 0 && n > 0) {  // the high nibble of a byte whose low one is written
    pack_codes_portable(codes, 1, first, packed);
    ++codes, --n, ++first;
  }
  uint8_t* out = packed + first / 2;
  const int64_t vec = n / 32 * 32;
  const __m256i bias = _mm256_set1_epi8(8), low_byte = _mm256_set1_epi16(0xFF);
  for (int64_t j = 0; j < vec; j += 32) {
    const __m256i nibbles =
        _mm256_add_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j)), bias);
    const __m256i pairs = _mm256_or_si256(_mm256_and_si256(nibbles, low_byte),
                                          _mm256_slli_epi16(_mm256_srli_epi16(nibbles, 8), 4));
    const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j / 2), _mm256_castsi256_si128(bytes));
  }
  pack_codes_portable(codes + vec, n - vec, first + static_cast<uint64_t>(vec), packed);
}

// 16 bytes into 32 codes per step: low and high nibbles interleaved, less 8.
GRADCOMP_AVX2 void unpack_codes_avx2(const uint8_t* packed, uint64_t first, int64_t n,
                                     int8_t* codes) {
  if ((first & 1) != 0 && n > 0) {
    unpack_codes_portable(packed, first, 1, codes);
    ++codes, --n, ++first;
  }
  const uint8_t* in = packed + first / 2;
  const int64_t vec = n / 32 * 32;
  const __m128i mask = _mm_set1_epi8(0x0F), bias = _mm_set1_epi8(8);
  for (int64_t j = 0; j < vec; j += 32) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + j / 2));
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j),
                     _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), bias));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j + 16),
                     _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), bias));
  }
  unpack_codes_portable(packed, first + static_cast<uint64_t>(vec), n - vec, codes + vec);
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp

#endif  // GRADCOMP_X86
