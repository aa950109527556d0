// Inner loops of the CPU int8 row codec over one run (one dtype): portable and AVX2, equal bytes.
#pragma once

#include <cstdint>

#include "gradcomp/cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#define GRADCOMP_X86 1
#endif

namespace gradcomp {
namespace cpu {
namespace detail {

// One run of a row encode: its blocks' bf16 scales and int8 codes. No pointer need be aligned
// (a run of a mixed-dtype row may start at any byte).
struct Int8EncodeRun {
  const uint8_t* input = nullptr;  // numel elements of `dtype`
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;
  int block = 64;
  uint8_t* scales = nullptr;  // one bf16 per block, little-endian
  int8_t* codes = nullptr;    // numel codes
};

// One run of a row decode: the inverse, writing numel elements of `dtype` at `output`.
struct Int8DecodeRun {
  const uint8_t* scales = nullptr;
  const int8_t* codes = nullptr;
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;
  int block = 64;
  uint8_t* output = nullptr;
};

// Encodes the run with the loops of `isa` (cpu_int8.cpp dispatches). Returns 0 when every element
// is finite, else 1 + the run offset of the first non-finite one; the scales and codes written
// before it are then left for the caller to clear (the reference clears the whole payload).
uint64_t int8_encode_run(const Int8EncodeRun& run, Isa isa);
void int8_decode_run(const Int8DecodeRun& run, Isa isa);
// The GCW8 body checksum (docs/format.md) over `words` u32 words at `body`.
uint64_t int8_body_sum(const uint8_t* body, uint64_t words, Isa isa);

// The portable loops (cpu_int8_portable.cpp); the vector loops use them for tails.
uint64_t encode_run_portable(const Int8EncodeRun& run);
void decode_run_portable(const Int8DecodeRun& run);
uint64_t body_sum_portable(const uint8_t* body, uint64_t first_word, uint64_t words);

#if GRADCOMP_X86
// AVX2 loops (cpu_int8_x86.cpp).
uint64_t encode_run_avx2(const Int8EncodeRun& run);
void decode_run_avx2(const Int8DecodeRun& run);
uint64_t body_sum_avx2(const uint8_t* body, uint64_t words);
#endif

// Today's element-by-element codec (cpu_int8_reference.cpp), kept as the reference the loops
// above must equal byte for byte in tests: the same contract as cpu::int8_encode_row and
// cpu::int8_decode_row.
uint64_t int8_encode_row_reference(const void* input, const Int8Run* runs, int num_runs,
                                   uint32_t block_size, uint8_t* payload);
void int8_decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                               uint32_t block_size, void* output);
// The GCW8 header with its body checksum `sum` (bytes 0..31).
void int8_write_header(uint8_t* payload, uint8_t flags, uint32_t block, int num_runs,
                       uint64_t numel, uint64_t sum);

// The checks a weight row's header and body must pass (GCW8 and GCW4 share the header layout and
// differ in magic, version and size): what int8_row_verdict and int4_row_verdict return.
Int8Verdict weight_row_verdict(const uint8_t* p, const Int8Run* runs, int num_runs,
                               uint32_t block_size, uint32_t magic, uint16_t version,
                               uint64_t total_bytes);

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
