// Element-level arithmetic shared by the CPU reference backend and the CUDA kernels.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define GRADCOMP_HD __host__ __device__ __forceinline__
#else
#define GRADCOMP_HD inline
#endif

namespace gradcomp {
namespace math {

// Every float operation below goes through these helpers so that neither nvcc nor the host
// compiler can contract a multiply and an add into an FMA: contraction would change the bytes.
GRADCOMP_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
GRADCOMP_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
GRADCOMP_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
GRADCOMP_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

GRADCOMP_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  union {
    float f;
    uint32_t u;
  } v;
  v.f = f;
  return v.u;
#endif
}
GRADCOMP_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  union {
    float f;
    uint32_t u;
  } v;
  v.u = u;
  return v.f;
#endif
}

GRADCOMP_HD bool is_finite_bits(uint32_t bits) {
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// ---- 16-bit float conversions (round to nearest even), written out so both sides agree ----

GRADCOMP_HD float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_float(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal half: value = man * 2^-24, exact in fp32.
    float v = mul_rn((float)man, 5.9604644775390625e-08f);
    return bits_float(sign | float_bits(v));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

GRADCOMP_HD uint16_t float_to_half(float f) {
  uint32_t x = float_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) {  // Inf or NaN; NaN stays quiet NaN
    return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0u));
  }
  if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: overflow
  if (ax < 0x38800000u) {                                    // below the smallest normal half
    if (ax < 0x33000000u) return (uint16_t)sign;             // below half of smallest subnormal
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e;  // 14..24 for this range
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return (uint16_t)(sign | r);
}

GRADCOMP_HD float bf16_to_float(uint16_t b) {
  return bits_float((uint32_t)b << 16);
}

GRADCOMP_HD uint16_t float_to_bf16(float f) {
  uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  return (uint16_t)((x + 0x7FFFu + lsb) >> 16);
}

// dtype codes match gradcomp::DType.
enum : uint8_t { kDtypeF32 = 0, kDtypeF16 = 1, kDtypeBF16 = 2 };

GRADCOMP_HD float load_as_float(const void* base, int64_t i, uint8_t dtype) {
  if (dtype == kDtypeF32) return static_cast<const float*>(base)[i];
  uint16_t v = static_cast<const uint16_t*>(base)[i];
  return dtype == kDtypeF16 ? half_to_float(v) : bf16_to_float(v);
}

GRADCOMP_HD void store_from_float(void* base, int64_t i, uint8_t dtype, float v) {
  if (dtype == kDtypeF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dtype == kDtypeF16 ? float_to_half(v) : float_to_bf16(v);
  }
}

// Rounds v to the given storage dtype and back, so callers can see what storing it keeps.
GRADCOMP_HD float round_to_dtype(float v, uint8_t dtype) {
  if (dtype == kDtypeF16) return half_to_float(float_to_half(v));
  if (dtype == kDtypeBF16) return bf16_to_float(float_to_bf16(v));
  return v;
}

// ---- Philox4x32-10 (Salmon et al., SC'11), counter-based random bits ----

struct Philox4 {
  uint32_t v[4];
};

GRADCOMP_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  uint64_t p = (uint64_t)a * (uint64_t)b;
  *hi = (uint32_t)(p >> 32);
  *lo = (uint32_t)p;
}

constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

GRADCOMP_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kPhiloxMul0, c0, &hi0, &lo0);
    mulhilo32(kPhiloxMul1, c2, &hi1, &lo1);
    uint32_t n0 = hi1 ^ c1 ^ k0;
    uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kPhiloxWeyl0;
    k1 += kPhiloxWeyl1;
  }
  Philox4 r;
  r.v[0] = c0;
  r.v[1] = c1;
  r.v[2] = c2;
  r.v[3] = c3;
  return r;
}

// Where a random stream comes from. Two encodes with equal keys draw equal bits.
struct RngKey {
  uint64_t seed;
  uint32_t step;
  uint32_t bucket;
  uint32_t rank;
  uint32_t phase;  // distinguishes encodes of the same elements within one step (two-phase q4)
};

// Sixteen random bits per element; one Philox call serves the 8 elements of one aligned group.
constexpr int kRandomGroup = 8;

// The Philox key of a random stream; the counter is (group, step, bucket).
GRADCOMP_HD uint32_t q4_philox_key0(const RngKey& key) {
  return (uint32_t)key.seed ^ (key.rank * 0x9E3779B9u);
}
GRADCOMP_HD uint32_t q4_philox_key1(const RngKey& key) {
  return (uint32_t)(key.seed >> 32) ^ (key.phase * 0xBB67AE85u);
}

GRADCOMP_HD Philox4 q4_random_group(const RngKey& key, uint64_t group) {
  return philox4x32_10((uint32_t)group, (uint32_t)(group >> 32), key.step, key.bucket,
                       q4_philox_key0(key), q4_philox_key1(key));
}

GRADCOMP_HD uint32_t random16(const Philox4& r, int lane) {
  uint32_t w = r.v[lane >> 1];
  return (lane & 1) ? (w >> 16) : (w & 0xFFFFu);
}

// ---- q4: 4-bit block quantization ----

constexpr int kQ4MaxCode = 7;  // codes q in [-7, 7], stored as nibble q + 8
constexpr uint8_t kQ4ZeroNibble = 8;

GRADCOMP_HD uint32_t abs_bits(float x) {
  return float_bits(x) & 0x7FFFFFFFu;
}

// Step d of a block from the bit pattern of its largest |x| (integer max over abs bits orders
// finite values, then Inf, then NaN, so a non-finite element always wins). d has at most 21
// significant bits, so q * d is exact for every code and a value on the grid round-trips.
GRADCOMP_HD float q4_step_from_absmax_bits(uint32_t absmax_bits) {
  if (absmax_bits >= 0x7F800000u) return bits_float(0x7FC00000u);
  if (absmax_bits == 0) return 0.0f;
  uint32_t d = float_bits(div_rn(bits_float(absmax_bits), (float)kQ4MaxCode));
  d = (d == 0) ? 8u : ((d + 7u) & ~7u);
  return bits_float(d);
}

// Code in [-7, 7] for x in a block of step `step` > 0 (callers give 0 for other blocks).
// Stochastic rounding rounds up with probability frac(x / step) (to 2^-16), so E[q * step] = x.
// Written without short-circuit operators so the CPU loop vectorizes; floor uses a truncating
// conversion, exact for |t| <= 7.
GRADCOMP_HD int q4_quantize_positive_step(float x, float step, uint32_t rand16, bool stochastic) {
  const float t0 = div_rn(x, step);
  const float t = t0 > 7.0f ? 7.0f : (t0 < -7.0f ? -7.0f : t0);
  const float tr = (float)(int)t;
  const float fl = tr > t ? sub_rn(tr, 1.0f) : tr;
  const float frac = sub_rn(t, fl);
  const int q = (int)fl;
  const float bar =
      stochastic ? mul_rn((float)rand16, 1.0f / 65536.0f) : ((q & 1) ? 0x1.fffffep-2f : 0.5f);
  const int up = (int)(bar < frac);
  const int r = q + up;
  return r > kQ4MaxCode ? kQ4MaxCode : r;
}

GRADCOMP_HD int q4_quantize(float x, float step, uint32_t rand16, bool stochastic) {
  if (!(step > 0.0f)) return 0;  // all-zero block, or non-finite block (step is NaN)
  return q4_quantize_positive_step(x, step, rand16, stochastic);
}

GRADCOMP_HD float q4_dequantize(uint32_t nibble, float step) {
  return mul_rn((float)((int)nibble - 8), step);
}

// ---- top-k: keys and radix passes ----

// Key monotone in |x| for every float; NaN orders above Inf so non-finite values are selected.
GRADCOMP_HD uint32_t topk_key(float x) {
  return abs_bits(x);
}

// Digits of the 31 key bits, most significant first: 11 + 11 + 9 bits.
constexpr int kTopKPasses = 3;
GRADCOMP_HD int topk_pass_shift(int pass) {
  return pass == 0 ? 20 : (pass == 1 ? 9 : 0);
}
GRADCOMP_HD int topk_pass_bins(int pass) {
  return pass == 2 ? 512 : 2048;
}
GRADCOMP_HD uint32_t topk_pass_mask_above(int pass) {
  // Bits of the key already fixed before `pass`.
  return pass == 0 ? 0u : (pass == 1 ? 0x7FF00000u : 0x7FFFFE00u);
}
GRADCOMP_HD uint32_t topk_digit(uint32_t key, int pass) {
  return (key >> topk_pass_shift(pass)) & (uint32_t)(topk_pass_bins(pass) - 1);
}

// Given a pass's histogram of candidate digits, picks the digit holding the remaining-th largest
// key. Returns the digit; *above receives how many candidates have a larger digit.
GRADCOMP_HD uint32_t topk_choose_digit(const uint32_t* hist, int bins, uint64_t remaining,
                                       uint64_t* above) {
  uint64_t acc = 0;
  for (int d = bins - 1; d >= 0; --d) {
    if (acc + hist[d] >= remaining) {
      *above = acc;
      return (uint32_t)d;
    }
    acc += hist[d];
  }
  *above = acc;
  return 0;
}

// Value stored for a selected element; fp16 saturates at its largest finite value so the excess
// stays in the residual instead of becoming Inf.
GRADCOMP_HD float topk_value_round(float acc, uint8_t value_dtype) {
  if (value_dtype == kDtypeF16 && is_finite_bits(float_bits(acc))) {
    acc = acc > 65504.0f ? 65504.0f : (acc < -65504.0f ? -65504.0f : acc);
  }
  return round_to_dtype(acc, value_dtype);
}

// Approximate mode: the threshold is the m-th largest key of an evenly strided sample.
constexpr int64_t kTopKSampleMax = 4096;
GRADCOMP_HD int64_t topk_sample_size(int64_t n) {
  return n < kTopKSampleMax ? n : kTopKSampleMax;
}
GRADCOMP_HD int64_t topk_sample_index(int64_t j, int64_t n, int64_t samples) {
  return j * n / samples;
}
GRADCOMP_HD int64_t topk_sample_rank(int64_t k, int64_t n, int64_t samples) {
  int64_t m = (k * samples + n - 1) / n;
  return m < 1 ? 1 : (m > samples ? samples : m);
}

// ---- wire format v1 header (docs/format.md) ----

constexpr uint32_t kPayloadMagic = 0x504D4347u;  // "GCMP" in little-endian byte order
constexpr uint16_t kFormatVersion = 1;
constexpr uint64_t kHeaderBytes = 64;
constexpr uint64_t kSectionAlign = 16;

enum : uint8_t { kCodecQ4 = 1, kCodecTopK = 2 };

struct PayloadHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t codec;
  uint8_t dtype;        // dtype of the encoded input
  uint8_t value_dtype;  // top-k value storage; f32 for q4 scales
  uint8_t flags;        // bit 0: stochastic rounding (q4)
  uint16_t reserved0;
  uint32_t param;  // q4: block size; top-k: capacity (entries the sections hold)
  uint64_t numel;
  uint64_t count;  // q4: number of blocks; top-k: entries present (<= capacity)
  uint64_t section0_bytes;
  uint64_t section1_bytes;
  uint64_t reserved1;
  uint32_t reserved2;
  uint32_t checksum;  // FNV-1a of the 60 bytes before it
};

GRADCOMP_HD uint64_t align_up(uint64_t x, uint64_t a) {
  return (x + a - 1) / a * a;
}

GRADCOMP_HD uint32_t header_checksum(const PayloadHeader& h) {
  const unsigned char* p = reinterpret_cast<const unsigned char*>(&h);
  uint32_t x = 2166136261u;
  for (int i = 0; i < 60; ++i) {
    x ^= p[i];
    x *= 16777619u;
  }
  return x;
}

GRADCOMP_HD uint64_t q4_num_blocks(uint64_t numel, uint32_t block) {
  return (numel + block - 1) / block;
}

GRADCOMP_HD PayloadHeader make_q4_header(uint64_t numel, uint32_t block, uint8_t dtype,
                                         bool stochastic) {
  PayloadHeader h;
  h.magic = kPayloadMagic;
  h.version = kFormatVersion;
  h.codec = kCodecQ4;
  h.dtype = dtype;
  h.value_dtype = kDtypeF32;
  h.flags = stochastic ? 1 : 0;
  h.reserved0 = 0;
  h.param = block;
  h.numel = numel;
  h.count = q4_num_blocks(numel, block);
  h.section0_bytes = h.count * 4;
  h.section1_bytes = (numel + 1) / 2;
  h.reserved1 = 0;
  h.reserved2 = 0;
  h.checksum = header_checksum(h);
  return h;
}

GRADCOMP_HD uint32_t value_dtype_bytes(uint8_t dtype) {
  return dtype == kDtypeF32 ? 4u : 2u;
}

GRADCOMP_HD PayloadHeader make_topk_header(uint64_t numel, uint32_t capacity, uint64_t count,
                                           uint8_t dtype, uint8_t value_dtype) {
  PayloadHeader h;
  h.magic = kPayloadMagic;
  h.version = kFormatVersion;
  h.codec = kCodecTopK;
  h.dtype = dtype;
  h.value_dtype = value_dtype;
  h.flags = 0;
  h.reserved0 = 0;
  h.param = capacity;
  h.numel = numel;
  h.count = count;
  h.section0_bytes = (uint64_t)capacity * 4;
  h.section1_bytes = (uint64_t)capacity * value_dtype_bytes(value_dtype);
  h.reserved1 = 0;
  h.reserved2 = 0;
  h.checksum = header_checksum(h);
  return h;
}

GRADCOMP_HD uint64_t section1_offset(const PayloadHeader& h) {
  return kHeaderBytes + align_up(h.section0_bytes, kSectionAlign);
}

GRADCOMP_HD uint64_t payload_bytes_of(const PayloadHeader& h) {
  return section1_offset(h) + align_up(h.section1_bytes, kSectionAlign);
}

// Why a header does not match the layout a decoder expects (0 = it matches).
enum HeaderStatus : int {
  kHeaderOk = 0,
  kHeaderBadMagic,
  kHeaderBadVersion,
  kHeaderBadChecksum,
  kHeaderBadCodec,
  kHeaderBadDtype,
  kHeaderLayoutMismatch,
  kHeaderBadCount,
  kHeaderTruncated,
};

// Checks a header against the expected codec, element count, block size or capacity and the
// payload's byte length. Sizes are recomputed here, never trusted from the header.
GRADCOMP_HD int check_header(const PayloadHeader& h, uint8_t codec, uint64_t numel, uint32_t param,
                             uint8_t value_dtype, uint64_t available_bytes) {
  if (h.magic != kPayloadMagic) return kHeaderBadMagic;
  if (h.version != kFormatVersion) return kHeaderBadVersion;
  if (h.checksum != header_checksum(h)) return kHeaderBadChecksum;
  if (h.codec != codec) return kHeaderBadCodec;
  if (h.dtype > kDtypeBF16 || h.value_dtype != value_dtype) return kHeaderBadDtype;
  if (h.numel != numel || h.param != param) return kHeaderLayoutMismatch;
  PayloadHeader expect = codec == kCodecQ4
                             ? make_q4_header(numel, param, h.dtype, (h.flags & 1) != 0)
                             : make_topk_header(numel, param, h.count, h.dtype, value_dtype);
  if (h.section0_bytes != expect.section0_bytes || h.section1_bytes != expect.section1_bytes)
    return kHeaderLayoutMismatch;
  if (codec == kCodecQ4 ? h.count != expect.count : (h.count > param || h.count > numel))
    return kHeaderBadCount;
  if (payload_bytes_of(expect) > available_bytes) return kHeaderTruncated;
  return kHeaderOk;
}

}  // namespace math
}  // namespace gradcomp
