// The 4-bit row codec element by element: the reference the CPU loops and the CUDA kernels equal
// byte for byte, and the GCW4 header both write.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_element_io.h"
#include "cpu_weight_row_loops.h"
#include "int4_params.h"
#include "math/int4_math.h"

namespace gradcomp {
namespace cpu {
namespace detail {

void int4_write_header(uint8_t* p, uint8_t flags, uint32_t block, int num_runs, uint64_t numel,
                       uint64_t sum) {
  int8_write_header(p, flags, block, num_runs, numel, sum);
  const uint32_t magic = kInt4PayloadMagic;
  const uint16_t version = kInt4PayloadVersion;
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
}

uint64_t int4_encode_row_reference(const void* input, const Int8Run* runs, int num_runs,
                                   uint32_t block_size, uint8_t* payload) {
  const uint64_t total = int4_row_payload_bytes(runs, num_runs, block_size);
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const uint64_t numel = int8_row_numel(runs, num_runs);
  const int64_t block = block_size;
  uint8_t* scales = payload + kInt8HeaderBytes;
  uint8_t* codes = scales + int8_align16(2 * blocks);
  std::memset(payload, 0, total);  // padding, and the nibbles ORed in below
  const auto* at = static_cast<const uint8_t*>(input);
  uint64_t block_index = 0, out = 0, nonfinite_at = 0;
  for (int r = 0; r < num_runs && nonfinite_at == 0; ++r) {
    const uint8_t dt = runs[r].dtype;
    for (int64_t start = 0; start < runs[r].numel && nonfinite_at == 0; start += block) {
      const int64_t end = std::min<int64_t>(start + block, runs[r].numel);
      float absmax = 0.0f;
      for (int64_t i = start; i < end; ++i) {
        const float a = std::fabs(load_element(at, i, dt));
        if (!std::isfinite(a)) {
          nonfinite_at = 1 + out + static_cast<uint64_t>(i - start);
          break;
        }
        absmax = a > absmax ? a : absmax;
      }
      if (nonfinite_at != 0) break;
      const uint16_t sbits = math::int4_scale_bits(absmax);
      std::memcpy(scales + 2 * block_index++, &sbits, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i, ++out) {
        const uint8_t nibble =
            math::int4_nibble(math::int4_quantize(load_element(at, i, dt), scale));
        codes[out / 2] |= static_cast<uint8_t>((out & 1) ? nibble << 4 : nibble);
      }
    }
    at += runs[r].numel * math::dtype_bytes(dt);
  }
  if (nonfinite_at != 0) {
    // A NaN weight never reaches the wire as numbers: the flagged payload carries no body.
    std::memset(payload, 0, total);
    int4_write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel, 0);
    return nonfinite_at;
  }
  const uint64_t sum =
      body_sum_portable(payload + kInt8HeaderBytes, 0, (total - kInt8HeaderBytes) / 4);
  int4_write_header(payload, 0, block_size, num_runs, numel, sum);
  return 0;
}

void int4_decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                               uint32_t block_size, void* output) {
  decode_row_reference(payload, runs, num_runs, block_size, output,
                       [](const uint8_t* codes, uint64_t k, float scale) {
                         const uint32_t nibble = (k & 1) ? codes[k / 2] >> 4 : codes[k / 2] & 0xFu;
                         return math::int4_dequantize(math::int4_code(nibble), scale);
                       });
}

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
