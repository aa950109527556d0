// The int8 weight all-gather's params structs (encode a row, check and decode every rank's row),
// the GCW8 row layout (docs/format.md) and the rules both backends check.
#pragma once

#include <stdint.h>

#include "math/half.h"
#include "math/int8_math.h"

namespace gradcomp {

// Wire format of one row (docs/format.md, "int8 all-gather payload").
constexpr uint32_t kInt8PayloadMagic = 0x38574347u;  // "GCW8" read as a little-endian u32
constexpr uint16_t kInt8PayloadVersion = 1;
constexpr uint64_t kInt8HeaderBytes = 32;
constexpr uint8_t kInt8FlagNonfinite = 1;  // the shard held NaN or infinity: sections are zero

// A stretch of a row holding elements of one dtype (gradcomp::AllGatherRun with a dtype code).
struct Int8Run {
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;
};

// What a decode found in each payload (Int8DecodeParams::verdicts); kInt8Ok is 0.
enum Int8Verdict : int32_t {
  kInt8Ok = 0,
  kInt8Nonfinite = 1,  // a well-formed payload flagged kInt8FlagNonfinite
  kInt8BadMagic = 2,
  kInt8BadVersion = 3,
  kInt8BadLayout = 4,  // block size, run count or element count differ from the runs
  kInt8BadFlags = 5,
  kInt8BadChecksum = 6,
};

// Encodes one row (the runs' elements back to back) into one GCW8 payload. A row holding NaN or
// infinity is never quantized: the payload is flagged with zero sections.
struct Int8EncodeParams {
  const void* input = nullptr;    // backend memory
  const Int8Run* runs = nullptr;  // host memory
  int num_runs = 0;
  uint32_t block_size = 64;
  uint8_t* payload = nullptr;  // backend memory, int8_row_payload_bytes
  uint64_t payload_bytes = 0;  // bytes available behind `payload`
  // Backend memory, one word: 0 when the row is finite, else 1 + the row offset (elements, over
  // the runs back to back) of its first non-finite element.
  uint64_t* nonfinite_at = nullptr;
};

// Checks num_payloads payloads of the same runs and, only when every one is well-formed and
// finite, decodes payload w into row w of `output`.
struct Int8DecodeParams {
  const uint8_t* const* payloads = nullptr;  // host array of backend-memory pointers
  int num_payloads = 0;
  uint64_t payload_bytes = 0;     // bytes available behind each payload pointer
  const Int8Run* runs = nullptr;  // host memory
  int num_runs = 0;
  uint32_t block_size = 64;
  void* output = nullptr;     // backend memory: num_payloads rows of the runs' bytes
  uint64_t output_bytes = 0;  // bytes available behind `output`
  // Backend memory, num_payloads + 1 words: payload w's Int8Verdict, then 1 when any is not
  // kInt8Ok (then nothing was written), else 0.
  int32_t* verdicts = nullptr;
};

inline uint64_t int8_align16(uint64_t n) {
  return (n + 15) / 16 * 16;
}

inline uint64_t int8_row_blocks(const Int8Run* runs, int num_runs, uint32_t block) {
  uint64_t blocks = 0;
  for (int i = 0; i < num_runs; ++i)
    blocks += math::int8_num_blocks(static_cast<uint64_t>(runs[i].numel), block);
  return blocks;
}

inline uint64_t int8_row_numel(const Int8Run* runs, int num_runs) {
  uint64_t n = 0;
  for (int i = 0; i < num_runs; ++i) n += static_cast<uint64_t>(runs[i].numel);
  return n;
}

inline uint64_t int8_row_bytes(const Int8Run* runs, int num_runs) {
  uint64_t bytes = 0;
  for (int i = 0; i < num_runs; ++i)
    bytes += static_cast<uint64_t>(runs[i].numel) * math::dtype_bytes(runs[i].dtype);
  return bytes;
}

// Header, one bf16 scale per block of every run, one code per element, each section padded to
// 16 bytes.
inline uint64_t int8_row_payload_bytes(const Int8Run* runs, int num_runs, uint32_t block) {
  return kInt8HeaderBytes + int8_align16(2 * int8_row_blocks(runs, num_runs, block)) +
         int8_align16(int8_row_numel(runs, num_runs));
}

// The rule a row's runs keep, or null.
inline const char* int8_runs_problem(const Int8Run* runs, int num_runs, uint32_t block) {
  if (!math::int8_block_size_valid(block)) return "block size must be a power of two in [16, 4096]";
  if (runs == nullptr || num_runs < 1) return "a row needs at least one run";
  for (int i = 0; i < num_runs; ++i) {
    if (runs[i].numel <= 0) return "a run has no elements";
    if (!math::dtype_valid(runs[i].dtype))
      return "a run's dtype code is not float32, float16 or bfloat16";
  }
  return nullptr;
}

// The CUDA kernels read and write elements as their own type, so they need every element naturally
// aligned: the base, each run's offset in the row and, for rows side by side, the row's size. The
// CPU copies bytes and takes any layout; a device refuses this one by name instead of faulting.
inline const char* int8_alignment_problem(const Int8Run* runs, int num_runs, const void* base,
                                          bool rows_side_by_side) {
  uint64_t offset = 0, widest = 1;
  for (int i = 0; i < num_runs; ++i) {
    const uint64_t size = math::dtype_bytes(runs[i].dtype);
    if (offset % size != 0)
      return "a run starts at a byte offset that is not a multiple of its dtype's size";
    widest = size > widest ? size : widest;
    offset += static_cast<uint64_t>(runs[i].numel) * size;
  }
  if (reinterpret_cast<uintptr_t>(base) % widest != 0)
    return "the tensor's address is not aligned to its widest dtype";
  if (rows_side_by_side && offset % widest != 0)
    return "a row's size is not a multiple of its widest dtype's size, so the next row is "
           "unaligned";
  return nullptr;
}

inline const char* params_problem(const Int8EncodeParams& p) {
  if (const char* r = int8_runs_problem(p.runs, p.num_runs, p.block_size)) return r;
  if (p.input == nullptr || p.payload == nullptr) return "input or payload is null";
  if (p.nonfinite_at == nullptr) return "no non-finite report word";
  if (p.payload_bytes < int8_row_payload_bytes(p.runs, p.num_runs, p.block_size))
    return "payload is shorter than the row's int8 payload";
  return nullptr;
}

inline const char* params_problem(const Int8DecodeParams& p) {
  if (const char* r = int8_runs_problem(p.runs, p.num_runs, p.block_size)) return r;
  // The pointers themselves are checked where they are host memory (the backends).
  if (p.payloads == nullptr || p.num_payloads < 1) return "no payloads";
  if (p.payload_bytes < int8_row_payload_bytes(p.runs, p.num_runs, p.block_size))
    return "payloads are shorter than the row's int8 payload";
  if (p.output == nullptr || p.verdicts == nullptr) return "output or verdict words are null";
  if (p.output_bytes / static_cast<uint64_t>(p.num_payloads) < int8_row_bytes(p.runs, p.num_runs))
    return "output is shorter than one row per payload";
  return nullptr;
}

}  // namespace gradcomp
