// The 4-bit weight all-gather's GCW4 row layout (docs/format.md): GCW8's header, scales and rules
// with two 4-bit codes per byte; its params are the int8 codec's (kernels/int8_params.h).
#pragma once

#include <stdint.h>

#include "int8_params.h"
#include "math/int4_math.h"

namespace gradcomp {

constexpr uint32_t kInt4PayloadMagic = 0x34574347u;  // "GCW4" read as a little-endian u32
constexpr uint16_t kInt4PayloadVersion = 1;

// Header (GCW8's 32 bytes), one bf16 scale per block of every run, the row's codes two per byte
// (element i of the row, runs back to back, in nibble i % 2 of byte i / 2), each section padded
// to 16 bytes.
inline uint64_t int4_row_payload_bytes(const Int8Run* runs, int num_runs, uint32_t block) {
  return kInt8HeaderBytes + int8_align16(2 * int8_row_blocks(runs, num_runs, block)) +
         int8_align16((int8_row_numel(runs, num_runs) + 1) / 2);
}

// The rules of a row's runs, as int8's (the block sizes are the same).
inline const char* int4_runs_problem(const Int8Run* runs, int num_runs, uint32_t block) {
  return int8_runs_problem(runs, num_runs, block);
}

inline const char* int4_params_problem(const Int8EncodeParams& p) {
  if (const char* r = int4_runs_problem(p.runs, p.num_runs, p.block_size)) return r;
  if (p.input == nullptr || p.payload == nullptr) return "input or payload is null";
  if (p.nonfinite_at == nullptr) return "no non-finite report word";
  if (p.payload_bytes < int4_row_payload_bytes(p.runs, p.num_runs, p.block_size))
    return "payload is shorter than the row's 4-bit payload";
  return nullptr;
}

inline const char* int4_params_problem(const Int8DecodeParams& p) {
  if (const char* r = int4_runs_problem(p.runs, p.num_runs, p.block_size)) return r;
  if (p.payloads == nullptr || p.num_payloads < 1) return "no payloads";
  if (p.payload_bytes < int4_row_payload_bytes(p.runs, p.num_runs, p.block_size))
    return "payloads are shorter than the row's 4-bit payload";
  if (p.output == nullptr || p.verdicts == nullptr) return "output or verdict words are null";
  if (p.output_bytes / static_cast<uint64_t>(p.num_payloads) < int8_row_bytes(p.runs, p.num_runs))
    return "output is shorter than one row per payload";
  return nullptr;
}

}  // namespace gradcomp
