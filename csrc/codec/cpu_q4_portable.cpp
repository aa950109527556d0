// The portable q4 loops: the reference every vector loop must equal byte for byte.
#include <algorithm>
#include <cstring>

#include "cpu_q4_loops.h"

namespace gradcomp {
namespace cpu {
namespace detail {

void random_bits_portable(const math::RngKey& key, int64_t first_element, int n, uint16_t* r16) {
  const int64_t first_group = first_element / math::kRandomGroup;
  for (int i = 0; i < n; i += math::kRandomGroup) {
    const math::Philox4 r =
        math::random_group(key, static_cast<uint64_t>(first_group + i / math::kRandomGroup));
    for (int j = 0; j < math::kRandomGroup; ++j)
      r16[i + j] = static_cast<uint16_t>(math::random16(r, j));
  }
}

void encode_block_portable(const Q4EncodeChunk& c, int s, int n, const uint16_t* r16) {
  float acc[256], rin[256];
  int32_t q[256];
  uint32_t absmax = 0;
  for (int i = 0; i < n; ++i) {
    rin[i] = c.residual_in != nullptr ? c.residual_in[s + i] : 0.0f;
    acc[i] = math::add_rn(c.input[s + i], rin[i]);
    absmax = std::max(absmax, math::abs_bits(acc[i]));
  }
  const float step = math::q4_step_from_absmax_bits(absmax);
  std::memcpy(&c.scales[s / c.block], &step, 4);
  for (int i = 0; i < n; ++i) {
    const uint32_t bits = c.stochastic ? r16[s + i] : 0u;
    q[i] = step > 0.0f ? math::q4_quantize_positive_step(acc[i], step, bits, c.stochastic) : 0;
  }
  for (int i = 0; i < n; i += 2) {
    const uint32_t lo = static_cast<uint32_t>(q[i] + 8);
    const uint32_t hi = i + 1 < n ? static_cast<uint32_t>(q[i + 1] + 8) : math::kQ4ZeroNibble;
    c.codes[(s + i) / 2] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (c.residual_out == nullptr) return;
  // A non-finite block keeps its old residual so one bad step cannot poison later ones.
  const bool finite = math::is_finite_bits(absmax);
  for (int i = 0; i < n; ++i) {
    c.residual_out[s + i] =
        finite ? math::sub_rn(acc[i], math::mul_rn(static_cast<float>(q[i]), step)) : rin[i];
  }
}

void encode_chunk_portable(const Q4EncodeChunk& c) {
  uint16_t random_bits[kQ4ChunkElements];
  const uint16_t* r16 = nullptr;
  if (c.stochastic) {
    random_bits_portable(c.rng, c.first_element, c.n, random_bits);
    r16 = random_bits;
  }
  for (int s = 0; s < c.n; s += c.block)
    encode_block_portable(c, s, std::min(c.block, c.n - s), r16);
}

bool decode_chunk_portable(const Q4DecodeChunk& c) {
  for (int w = 0; w < c.num_payloads; ++w) {
    const uint8_t* scales = c.payloads[w] + c.scales_offset;
    const uint8_t* codes = c.payloads[w] + c.codes_offset;
    for (int s = 0; s < c.n; s += c.block) {
      float step;
      std::memcpy(&step, scales + 4 * (s / c.block), 4);
      const int end = std::min(c.n, s + c.block);
      for (int i = s; i < end; ++i) {
        const uint8_t byte = codes[i / 2];
        const uint32_t nibble = (i & 1) ? (byte >> 4) : (byte & 0xF);
        c.sum[i] = math::add_rn(w == 0 ? 0.0f : c.sum[i], math::q4_dequantize(nibble, step));
      }
    }
  }
  bool nonfinite = false;
  for (int i = 0; i < c.n; ++i) {
    c.sum[i] = math::div_rn(c.sum[i], c.divisor);
    nonfinite |= !math::is_finite_bits(math::float_bits(c.sum[i]));
  }
  return nonfinite;
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
