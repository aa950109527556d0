// The 4-bit row codec on the host over the loops of the active instruction set
// (cpu_weight_row_loops.h: the int8 encode and decode loops under the 4-bit rules, then nibble
// packing), and the CPU backend's 4-bit operations.
#include <algorithm>
#include <cstring>

#include "cpu_weight_row_loops.h"
#include "cpu_weight_rows.h"
#include "gradcomp/cpu.h"
#include "int4_params.h"
#include "math/int4_math.h"

namespace gradcomp {
namespace cpu {
namespace {

// Codes pass through a stack buffer of this many bytes between the element loops and the nibble
// packing; a whole number of the largest blocks, so every chunk but a run's last is whole blocks.
constexpr int64_t kStagedCodes = 4 * math::kInt8MaxBlock;

}  // namespace

uint64_t int4_encode_row(const void* input, const Int8Run* runs, int num_runs, uint32_t block_size,
                         uint8_t* payload) {
  const Isa isa = active_isa();
  const uint64_t total = int4_row_payload_bytes(runs, num_runs, block_size);
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const uint64_t numel = int8_row_numel(runs, num_runs);
  uint8_t* scales = payload + kInt8HeaderBytes;
  const uint64_t codes_at = kInt8HeaderBytes + int8_align16(2 * blocks);
  uint8_t* packed = payload + codes_at;
  // The padding after each section is zero; the packing writes every code byte (a row of odd
  // length ends in a byte whose high nibble it leaves 0).
  std::memset(scales + 2 * blocks, 0, codes_at - kInt8HeaderBytes - 2 * blocks);
  std::memset(packed + (numel + 1) / 2, 0, total - codes_at - (numel + 1) / 2);
  int8_t staged[kStagedCodes];
  const auto* at = static_cast<const uint8_t*>(input);
  uint64_t row_offset = 0;
  for (int r = 0; r < num_runs; ++r) {
    const int64_t size = math::dtype_bytes(runs[r].dtype);
    for (int64_t start = 0; start < runs[r].numel; start += kStagedCodes) {
      detail::Int8EncodeRun run;
      run.input = at + start * size;
      run.dtype = runs[r].dtype;
      run.numel = std::min<int64_t>(kStagedCodes, runs[r].numel - start);
      run.block = static_cast<int>(block_size);
      run.scales = scales + 2 * (start / block_size);
      run.codes = staged;
      run.rules = detail::CodeRules::kInt4;
      const uint64_t bad = detail::int8_encode_run(run, isa);
      if (bad != 0) {
        // A NaN weight never reaches the wire as numbers: the flagged payload carries no body.
        std::memset(payload, 0, total);
        detail::int4_write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel, 0);
        return row_offset + static_cast<uint64_t>(start) + bad;
      }
      detail::int4_pack_codes(staged, run.numel, row_offset + static_cast<uint64_t>(start), packed,
                              isa);
    }
    scales += 2 * math::int8_num_blocks(static_cast<uint64_t>(runs[r].numel), block_size);
    at += runs[r].numel * size;
    row_offset += static_cast<uint64_t>(runs[r].numel);
  }
  detail::int4_write_header(payload, 0, block_size, num_runs, numel,
                            detail::row_body_sum(payload, total, isa));
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
  const Isa isa = active_isa();
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const uint8_t* scales = payload + kInt8HeaderBytes;
  const uint8_t* packed = scales + int8_align16(2 * blocks);
  int8_t staged[kStagedCodes];
  auto* at = static_cast<uint8_t*>(output);
  uint64_t row_offset = 0;
  for (int r = 0; r < num_runs; ++r) {
    const int64_t size = math::dtype_bytes(runs[r].dtype);
    for (int64_t start = 0; start < runs[r].numel; start += kStagedCodes) {
      detail::Int8DecodeRun run;
      run.scales = scales + 2 * (start / block_size);
      run.codes = staged;
      run.dtype = runs[r].dtype;
      run.numel = std::min<int64_t>(kStagedCodes, runs[r].numel - start);
      run.block = static_cast<int>(block_size);
      run.output = at + start * size;
      detail::int4_unpack_codes(packed, row_offset + static_cast<uint64_t>(start), run.numel,
                                staged, isa);
      detail::int8_decode_run(run, isa);
    }
    scales += 2 * math::int8_num_blocks(static_cast<uint64_t>(runs[r].numel), block_size);
    at += runs[r].numel * size;
    row_offset += static_cast<uint64_t>(runs[r].numel);
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
