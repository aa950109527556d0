// The portable int8 row loops: a block at a time, one dtype per loop, no branch per element.
#include <algorithm>
#include <cstring>

#include "cpu_int8_loops.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace cpu {
namespace detail {
namespace {

// Elements are copied byte-wise: a run of a mixed-dtype row need not be naturally aligned.
template <uint8_t kDtype>
float load(const uint8_t* at, int64_t i) {
  if (kDtype == math::kDtypeF32) {
    float v;
    std::memcpy(&v, at + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, at + 2 * i, 2);
  return kDtype == math::kDtypeF16 ? math::half_to_float(h) : math::bf16_to_float(h);
}

template <uint8_t kDtype>
void store(uint8_t* at, int64_t i, float v) {
  if (kDtype == math::kDtypeF32) {
    std::memcpy(at + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = kDtype == math::kDtypeF16 ? math::float_to_half(v) : math::float_to_bf16(v);
  std::memcpy(at + 2 * i, &h, 2);
}

// The largest |x| of a block as fp32 bits: for non-negative floats the order of the bits is the
// order of the values, and a NaN or an infinity (bits >= 0x7F800000) wins over every finite value,
// so one maximum finds both the scale's absmax and whether the block is finite.
template <uint8_t kDtype>
uint32_t absmax_bits(const uint8_t* at, int64_t start, int64_t end) {
  uint32_t m = 0;
  for (int64_t i = start; i < end; ++i)
    m = std::max(m, math::float_bits(load<kDtype>(at, i)) & 0x7FFFFFFFu);
  return m;
}

template <uint8_t kDtype>
uint64_t first_nonfinite(const uint8_t* at, int64_t start, int64_t end) {
  for (int64_t i = start; i < end; ++i)
    if ((math::float_bits(load<kDtype>(at, i)) & 0x7FFFFFFFu) >= 0x7F800000u)
      return 1 + static_cast<uint64_t>(i);
  return 0;
}

template <uint8_t kDtype>
uint64_t encode_run(const Int8EncodeRun& r) {
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int64_t end = std::min<int64_t>(start + r.block, r.numel);
    const uint32_t m = absmax_bits<kDtype>(r.input, start, end);
    if (m >= 0x7F800000u) return first_nonfinite<kDtype>(r.input, start, end);
    const uint16_t sbits = math::int8_scale_bits(math::bits_float(m));
    std::memcpy(r.scales + 2 * b, &sbits, 2);
    const float scale = math::bf16_to_float(sbits);
    for (int64_t i = start; i < end; ++i)
      r.codes[i] = static_cast<int8_t>(math::int8_quantize(load<kDtype>(r.input, i), scale));
  }
  return 0;
}

template <uint8_t kDtype>
void decode_run(const Int8DecodeRun& r) {
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int64_t end = std::min<int64_t>(start + r.block, r.numel);
    uint16_t sbits;
    std::memcpy(&sbits, r.scales + 2 * b, 2);
    const float scale = math::bf16_to_float(sbits);
    for (int64_t i = start; i < end; ++i)
      store<kDtype>(r.output, i, math::int8_dequantize(r.codes[i], scale));
  }
}

}  // namespace

uint64_t encode_run_portable(const Int8EncodeRun& r) {
  if (r.dtype == math::kDtypeF32) return encode_run<math::kDtypeF32>(r);
  if (r.dtype == math::kDtypeF16) return encode_run<math::kDtypeF16>(r);
  return encode_run<math::kDtypeBF16>(r);
}

void decode_run_portable(const Int8DecodeRun& r) {
  if (r.dtype == math::kDtypeF32) return decode_run<math::kDtypeF32>(r);
  if (r.dtype == math::kDtypeF16) return decode_run<math::kDtypeF16>(r);
  decode_run<math::kDtypeBF16>(r);
}

uint64_t body_sum_portable(const uint8_t* body, uint64_t first_word, uint64_t words) {
  uint64_t sum = 0;
  for (uint64_t i = first_word; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, body + 4 * i, 4);
    sum += format::body_checksum_term(w, i);
  }
  return sum;
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
