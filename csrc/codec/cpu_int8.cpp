// The int8 row codec on the host: encode, the payload verdict and decode over the loops of the
// active instruction set (cpu_weight_row_loops.h), and the CPU backend's int8 operations over them.
#include <cstring>

#include "cpu_weight_row_loops.h"
#include "cpu_weight_rows.h"
#include "gradcomp/cpu.h"
#include "math/int8_math.h"

namespace gradcomp {
namespace cpu {
namespace detail {

uint64_t int8_encode_run(const Int8EncodeRun& run, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return encode_run_avx2(run);
#endif
  (void)isa;
  return encode_run_portable(run);
}

void int8_decode_run(const Int8DecodeRun& run, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return decode_run_avx2(run);
#endif
  (void)isa;
  decode_run_portable(run);
}

void int4_pack_codes(const int8_t* codes, int64_t n, uint64_t first, uint8_t* packed, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return pack_codes_avx2(codes, n, first, packed);
#endif
  (void)isa;
  pack_codes_portable(codes, n, first, packed);
}

void int4_unpack_codes(const uint8_t* packed, uint64_t first, int64_t n, int8_t* codes, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return unpack_codes_avx2(packed, first, n, codes);
#endif
  (void)isa;
  unpack_codes_portable(packed, first, n, codes);
}

uint64_t int8_body_sum(const uint8_t* body, uint64_t words, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return body_sum_avx2(body, words);
#endif
  (void)isa;
  return body_sum_portable(body, 0, words);
}

uint64_t row_body_sum(const uint8_t* payload, uint64_t total_bytes, Isa isa) {
  return int8_body_sum(payload + kInt8HeaderBytes, (total_bytes - kInt8HeaderBytes) / 4, isa);
}

Int8Verdict weight_row_verdict(const uint8_t* p, const Int8Run* runs, int num_runs,
                               uint32_t block_size, uint32_t magic_expected,
                               uint16_t version_expected, uint64_t total_bytes) {
  uint32_t magic, block, nruns;
  uint16_t version;
  uint64_t numel, sum;
  std::memcpy(&magic, p, 4);
  std::memcpy(&version, p + 4, 2);
  std::memcpy(&block, p + 8, 4);
  std::memcpy(&nruns, p + 12, 4);
  std::memcpy(&numel, p + 16, 8);
  std::memcpy(&sum, p + 24, 8);
  if (magic != magic_expected) return kInt8BadMagic;
  if (version != version_expected) return kInt8BadVersion;
  if (block != block_size || nruns != static_cast<uint32_t>(num_runs) ||
      numel != int8_row_numel(runs, num_runs))
    return kInt8BadLayout;
  // Byte 7 is reserved and always written 0: any other value is a header this build cannot read.
  if ((p[6] & ~kInt8FlagNonfinite) != 0 || p[7] != 0) return kInt8BadFlags;
  if (sum != row_body_sum(p, total_bytes, active_isa())) return kInt8BadChecksum;
  return (p[6] & kInt8FlagNonfinite) != 0 ? kInt8Nonfinite : kInt8Ok;
}

}  // namespace detail

uint64_t int8_encode_row(const void* input, const Int8Run* runs, int num_runs, uint32_t block_size,
                         uint8_t* payload) {
  const Isa isa = active_isa();
  const uint64_t total = int8_row_payload_bytes(runs, num_runs, block_size);
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const uint64_t numel = int8_row_numel(runs, num_runs);
  uint8_t* scales = payload + kInt8HeaderBytes;
  const uint64_t codes_at = kInt8HeaderBytes + int8_align16(2 * blocks);
  int8_t* codes = reinterpret_cast<int8_t*>(payload + codes_at);
  // The padding after each section is zero; the loops write every other body byte.
  std::memset(scales + 2 * blocks, 0, codes_at - kInt8HeaderBytes - 2 * blocks);
  std::memset(payload + codes_at + numel, 0, total - codes_at - numel);
  const auto* at = static_cast<const uint8_t*>(input);
  uint64_t row_offset = 0;
  for (int r = 0; r < num_runs; ++r) {
    detail::Int8EncodeRun run;
    run.input = at;
    run.dtype = runs[r].dtype;
    run.numel = runs[r].numel;
    run.block = static_cast<int>(block_size);
    run.scales = scales;
    run.codes = codes + row_offset;
    const uint64_t bad = detail::int8_encode_run(run, isa);
    if (bad != 0) {
      // A NaN weight never reaches the wire as numbers: the flagged payload carries no body.
      std::memset(payload, 0, total);
      detail::int8_write_header(payload, kInt8FlagNonfinite, block_size, num_runs, numel, 0);
      return row_offset + bad;
    }
    scales += 2 * math::int8_num_blocks(static_cast<uint64_t>(runs[r].numel), block_size);
    at += runs[r].numel * math::dtype_bytes(runs[r].dtype);
    row_offset += static_cast<uint64_t>(runs[r].numel);
  }
  detail::int8_write_header(payload, 0, block_size, num_runs, numel,
                            detail::row_body_sum(payload, total, isa));
  return 0;
}

Int8Verdict int8_row_verdict(const uint8_t* p, const Int8Run* runs, int num_runs,
                             uint32_t block_size) {
  return detail::weight_row_verdict(p, runs, num_runs, block_size, kInt8PayloadMagic,
                                    kInt8PayloadVersion,
                                    int8_row_payload_bytes(runs, num_runs, block_size));
}

void int8_decode_row(const uint8_t* payload, const Int8Run* runs, int num_runs, uint32_t block_size,
                     void* output) {
  const Isa isa = active_isa();
  const uint64_t blocks = int8_row_blocks(runs, num_runs, block_size);
  const uint8_t* scales = payload + kInt8HeaderBytes;
  const int8_t* codes = reinterpret_cast<const int8_t*>(scales + int8_align16(2 * blocks));
  auto* at = static_cast<uint8_t*>(output);
  for (int r = 0; r < num_runs; ++r) {
    detail::Int8DecodeRun run;
    run.scales = scales;
    run.codes = codes;
    run.dtype = runs[r].dtype;
    run.numel = runs[r].numel;
    run.block = static_cast<int>(block_size);
    run.output = at;
    detail::int8_decode_run(run, isa);
    scales += 2 * math::int8_num_blocks(static_cast<uint64_t>(runs[r].numel), block_size);
    codes += runs[r].numel;
    at += runs[r].numel * math::dtype_bytes(runs[r].dtype);
  }
}

void int8_encode(const Int8EncodeParams& p) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, "int8 encode: " << problem);
  *p.nonfinite_at = int8_encode_row(p.input, p.runs, p.num_runs, p.block_size, p.payload);
}

void int8_decode(const Int8DecodeParams& p) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, "int8 decode: " << problem);
  decode_checked_rows(p, "int8 decode", int8_row_verdict, int8_decode_row);
}

}  // namespace cpu
}  // namespace gradcomp
