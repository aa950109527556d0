// The int8 row codec element by element: the reference the CPU loops and the CUDA kernels equal
// byte for byte, and the GCW8 header both write.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_element_io.h"
#include "cpu_weight_row_loops.h"
#include "gradcomp/format.h"
#include "math/int8_math.h"

namespace gradcomp {
namespace cpu {
namespace detail {
namespace {

// The body checksum of the wire format v2 (docs/format.md, format::body_checksum_term), over the
// bytes after this payload's shorter header.
uint64_t body_sum(const uint8_t* payload, uint64_t total) {
  uint64_t sum = 0;
  const uint64_t words = (total - kInt8HeaderBytes) / 4;
  for (uint64_t i = 0; i < words; ++i) {
    uint32_t w;
    std::memcpy(&w, payload + kInt8HeaderBytes + 4 * i, 4);
    sum += format::body_checksum_term(w, i);
  }
  return sum;
}

}  // namespace

void int8_write_header(uint8_t* p, uint8_t flags, uint32_t block, int num_runs, uint64_t numel,
                       uint64_t sum) {
  const uint32_t magic = kInt8PayloadMagic, runs = static_cast<uint32_t>(num_runs);
  const uint16_t version = kInt8PayloadVersion;
  std::memset(p, 0, kInt8HeaderBytes);
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
  p[6] = flags;
  std::memcpy(p + 8, &block, 4);
  std::memcpy(p + 12, &runs, 4);
  std::memcpy(p + 16, &numel, 8);
  std::memcpy(p + 24, &sum, 8);
}

uint64_t int8_encode_row_reference(const void* input, const Int8Run* runs, int num_runs,
                                   uint32_t block_size, uint8_t* payload) {
  const uint64_t total = int8_row_payload_bytes(runs, num_runs, block_size);
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const int64_t block = block_size;
  uint8_t* scales = payload + kInt8HeaderBytes;
  int8_t* codes = reinterpret_cast<int8_t*>(scales + int8_align16(2 * blocks));
  std::memset(payload, 0, total);
  const auto* at = static_cast<const uint8_t*>(input);
  uint64_t block_index = 0, out = 0, row_offset = 0, nonfinite_at = 0;
  for (int r = 0; r < num_runs; ++r) {
    const uint8_t dt = runs[r].dtype;
    for (int64_t start = 0; start < runs[r].numel; start += block) {
      const int64_t end = std::min<int64_t>(start + block, runs[r].numel);
      float absmax = 0.0f;
      bool block_finite = true;
      for (int64_t i = start; i < end; ++i) {
        const float a = std::fabs(load_element(at, i, dt));
        if (!std::isfinite(a) && block_finite && nonfinite_at == 0)
          nonfinite_at = 1 + row_offset + static_cast<uint64_t>(i);
        block_finite = block_finite && std::isfinite(a);
        absmax = a > absmax ? a : absmax;
      }
      if (!block_finite) continue;  // the payload is flagged below; its codes are never sent
      const uint16_t sbits = math::int8_scale_bits(absmax);
      std::memcpy(scales + 2 * block_index++, &sbits, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i)
        codes[out++] = static_cast<int8_t>(math::int8_quantize(load_element(at, i, dt), scale));
    }
    at += runs[r].numel * math::dtype_bytes(dt);
    row_offset += static_cast<uint64_t>(runs[r].numel);
  }
  const uint64_t numel = int8_row_numel(runs, num_runs);
  if (nonfinite_at != 0) {
    // A NaN weight never reaches the wire as numbers: the flagged payload carries no body.
    std::memset(payload, 0, total);
    int8_write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel, 0);
    return nonfinite_at;
  }
  int8_write_header(payload, 0, block_size, num_runs, numel, body_sum(payload, total));
  return 0;
}

void int8_decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                               uint32_t block_size, void* output) {
  decode_row_reference(payload, runs, num_runs, block_size, output,
                       [](const uint8_t* codes, uint64_t k, float scale) {
                         return math::int8_dequantize(static_cast<int8_t>(codes[k]), scale);
                       });
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
