// The 4-bit row codec on the host, element by element: the reference (GCW4, docs/format.md) and the
// CPU backend's 4-bit operations.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu_int8_loops.h"
#include "cpu_weight_rows.h"
#include "gradcomp/cpu.h"
#include "int4_params.h"
#include "math/int4_math.h"

namespace gradcomp {
namespace cpu {
namespace {

// Rows of mixed dtypes need not keep elements naturally aligned (cpu_int8_reference.cpp): bytes
// are copied, never dereferenced as floats.
float load_element(const uint8_t* at, int64_t i, uint8_t dtype) {
  if (dtype == math::kDtypeF32) {
    float v;
    std::memcpy(&v, at + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, at + 2 * i, 2);
  return dtype == math::kDtypeF16 ? math::half_to_float(h) : math::bf16_to_float(h);
}

void store_element(uint8_t* at, int64_t i, uint8_t dtype, float v) {
  if (dtype == math::kDtypeF32) {
    std::memcpy(at + 4 * i, &v, 4);
    return;
  }
  const uint16_t h = dtype == math::kDtypeF16 ? math::float_to_half(v) : math::float_to_bf16(v);
  std::memcpy(at + 2 * i, &h, 2);
}

// GCW8's header with GCW4's magic and version (the same fields at the same offsets).
void write_header(uint8_t* p, uint8_t flags, uint32_t block, int num_runs, uint64_t numel,
                  uint64_t sum) {
  detail::int8_write_header(p, flags, block, num_runs, numel, sum);
  const uint32_t magic = kInt4PayloadMagic;
  const uint16_t version = kInt4PayloadVersion;
  std::memcpy(p, &magic, 4);
  std::memcpy(p + 4, &version, 2);
}

uint64_t body_sum(const uint8_t* payload, uint64_t total) {
  return detail::int8_body_sum(payload + kInt8HeaderBytes, (total - kInt8HeaderBytes) / 4,
                               active_isa());
}

}  // namespace

uint64_t int4_encode_row(const void* input, const Int8Run* runs, int num_runs, uint32_t block_size,
                         uint8_t* payload) {
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
    write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel, 0);
    return nonfinite_at;
  }
  write_header(payload, 0, block_size, num_runs, numel, body_sum(payload, total));
  return 0;
}

Int8Verdict int4_row_verdict(const uint8_t* p, const Int8Run* runs, int num_runs,
                             uint32_t block_size) {
  return detail::weight_row_verdict(p, runs, num_runs, block_size, kInt4PayloadMagic,
                                    kInt4PayloadVersion,
                                    int4_row_payload_bytes(runs, num_runs, block_size));
}

void int4_decode_row(const uint8_t* payload, const Int8Run* runs, int num_runs, uint32_t block_size,
                     void* output) {
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const int64_t block = block_size;
  const uint8_t* scales = payload + kInt8HeaderBytes;
  const uint8_t* codes = scales + int8_align16(2 * blocks);
  auto* at = static_cast<uint8_t*>(output);
  uint64_t block_index = 0, in = 0;
  for (int r = 0; r < num_runs; ++r) {
    const uint8_t dt = runs[r].dtype;
    for (int64_t start = 0; start < runs[r].numel; start += block) {
      const int64_t end = std::min<int64_t>(start + block, runs[r].numel);
      uint16_t sbits;
      std::memcpy(&sbits, scales + 2 * block_index++, 2);
      const float scale = math::bf16_to_float(sbits);
      for (int64_t i = start; i < end; ++i, ++in) {
        const uint32_t nibble = (in & 1) ? codes[in / 2] >> 4 : codes[in / 2] & 0xFu;
        store_element(at, i, dt, math::int4_dequantize(math::int4_code(nibble), scale));
      }
    }
    at += runs[r].numel * math::dtype_bytes(dt);
  }
}

void int4_encode(const Int8EncodeParams& p) {
  const char* problem = int4_params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, "4-bit encode: " << problem);
  *p.nonfinite_at = int4_encode_row(p.input, p.runs, p.num_runs, p.block_size, p.payload);
}

void int4_decode(const Int8DecodeParams& p) {
  const char* problem = int4_params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, "4-bit decode: " << problem);
  decode_checked_rows(p, "4-bit decode", int4_row_verdict, int4_decode_row);
}

}  // namespace cpu
}  // namespace gradcomp
