// The portable weight row loops (int8, 4-bit): a block at a time, one dtype per loop, no branch
// per element.
#include <algorithm>
#include <cstring>

#include "cpu_element_io.h"
#include "cpu_weight_row_loops.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace cpu {
namespace detail {
namespace {

// The largest |x| of a block as fp32 bits: for non-negative floats the order of the bits is the
// order of the values, and a NaN or an infinity (bits >= 0x7F800000) wins over every finite value,
// so one maximum finds both the scale's absmax and whether the block is finite.
template <uint8_t kDtype>
uint32_t absmax_bits(const uint8_t* at, int64_t start, int64_t end) {
  uint32_t m = 0;
  for (int64_t i = start; i < end; ++i)
    m = std::max(m, math::float_bits(load_element<kDtype>(at, i)) & 0x7FFFFFFFu);
  return m;
}

template <uint8_t kDtype>
uint64_t first_nonfinite(const uint8_t* at, int64_t start, int64_t end) {
  for (int64_t i = start; i < end; ++i)
    if ((math::float_bits(load_element<kDtype>(at, i)) & 0x7FFFFFFFu) >= 0x7F800000u)
      return 1 + static_cast<uint64_t>(i);
  return 0;
}

template <uint8_t kDtype, CodeRules kRules>
uint64_t encode_run(const Int8EncodeRun& r) {
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int64_t end = std::min<int64_t>(start + r.block, r.numel);
    const uint32_t m = absmax_bits<kDtype>(r.input, start, end);
    if (m >= 0x7F800000u) return first_nonfinite<kDtype>(r.input, start, end);
    const uint16_t sbits = scale_bits<kRules>(math::bits_float(m));
    std::memcpy(r.scales + 2 * b, &sbits, 2);
    const float scale = math::bf16_to_float(sbits);
    for (int64_t i = start; i < end; ++i)
      r.codes[i] = static_cast<int8_t>(quantize<kRules>(load_element<kDtype>(r.input, i), scale));
  }
  return 0;
}

template <CodeRules kRules>
uint64_t encode_run_of_rules(const Int8EncodeRun& r) {
  if (r.dtype == math::kDtypeF32) return encode_run<math::kDtypeF32, kRules>(r);
  if (r.dtype == math::kDtypeF16) return encode_run<math::kDtypeF16, kRules>(r);
  return encode_run<math::kDtypeBF16, kRules>(r);
}

template <uint8_t kDtype>
void decode_run(const Int8DecodeRun& r) {
  for (int64_t start = 0, b = 0; start < r.numel; start += r.block, ++b) {
    const int64_t end = std::min<int64_t>(start + r.block, r.numel);
    uint16_t sbits;
    std::memcpy(&sbits, r.scales + 2 * b, 2);
    const float scale = math::bf16_to_float(sbits);
    for (int64_t i = start; i < end; ++i)
      store_element<kDtype>(r.output, i, math::int8_dequantize(r.codes[i], scale));
  }
}

}  // namespace

uint64_t encode_run_portable(const Int8EncodeRun& r) {
  return r.rules == CodeRules::kInt8 ? encode_run_of_rules<CodeRules::kInt8>(r)
                                     : encode_run_of_rules<CodeRules::kInt4>(r);
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

void pack_codes_portable(const int8_t* codes, int64_t n, uint64_t first, uint8_t* packed) {
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t k = first + static_cast<uint64_t>(j);
    const uint8_t nibble = math::int4_nibble(codes[j]);
    if (k & 1)
      packed[k / 2] = static_cast<uint8_t>(packed[k / 2] | nibble << 4);
    else
      packed[k / 2] = nibble;
  }
}

void unpack_codes_portable(const uint8_t* packed, uint64_t first, int64_t n, int8_t* codes) {
  for (int64_t j = 0; j < n; ++j) {
    const uint64_t k = first + static_cast<uint64_t>(j);
    codes[j] = static_cast<int8_t>(math::int4_code((k & 1) ? packed[k / 2] >> 4 : packed[k / 2]));
  }
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
