// Inner loops of the CPU weight row codecs (int8, 4-bit) over one run (one dtype): portable and
// AVX2, equal bytes.
#pragma once

#include <cstdint>

#include "gradcomp/cpu.h"
#include "int4_params.h"
#include "math/int4_math.h"
#include "math/int8_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#define GRADCOMP_X86 1
#endif

namespace gradcomp {
namespace cpu {
namespace detail {

// Which element rules a run's codes follow: int8's (math/int8_math.h) or the 4-bit codec's
// (math/int4_math.h), whose codes the 4-bit row then packs two per byte (int4_pack_codes). The
// two differ in the largest code and so in the scale; rounding and clamping are alike.
enum class CodeRules : uint8_t { kInt8, kInt4 };

template <CodeRules kRules>
constexpr int max_code() {
  return kRules == CodeRules::kInt8 ? math::kInt8MaxCode : math::kInt4MaxCode;
}

template <CodeRules kRules>
inline uint16_t scale_bits(float absmax) {
  return kRules == CodeRules::kInt8 ? math::int8_scale_bits(absmax) : math::int4_scale_bits(absmax);
}

template <CodeRules kRules>
inline int quantize(float x, float scale) {
  return kRules == CodeRules::kInt8 ? math::int8_quantize(x, scale) : math::int4_quantize(x, scale);
}

// One run of a row encode: its blocks' bf16 scales and one code byte per element. No pointer need
// be aligned (a run of a mixed-dtype row may start at any byte).
struct Int8EncodeRun {
  const uint8_t* input = nullptr;  // numel elements of `dtype`
  uint8_t dtype = math::kDtypeF32;
  int64_t numel = 0;
  int block = 64;
  uint8_t* scales = nullptr;  // one bf16 per block, little-endian
  int8_t* codes = nullptr;    // numel codes
  CodeRules rules = CodeRules::kInt8;
};

// One run of a row decode: the inverse, writing numel elements of `dtype` at `output`. It serves
// both codecs: math::int4_dequantize and math::int8_dequantize are the same product code * scale.
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
// The same over the body of a whole GCW8 or GCW4 row of total_bytes (its header excluded).
uint64_t row_body_sum(const uint8_t* payload, uint64_t total_bytes, Isa isa);

// 4-bit codes (in [-7, 7], from an encode run under CodeRules::kInt4) packed two per byte as the
// GCW4 row holds them: code j goes to nibble first + j of `packed` (nibble k in byte k / 2, the low
// one for even k). A byte's low nibble is written before its high one: the low write sets the byte,
// the high one ORs into it, so runs and chunks of any length pack back to back.
void int4_pack_codes(const int8_t* codes, int64_t n, uint64_t first, uint8_t* packed, Isa isa);
// The inverse: n codes (nibble - 8, so nibble 0 gives -8) from nibble `first` of `packed` on.
void int4_unpack_codes(const uint8_t* packed, uint64_t first, int64_t n, int8_t* codes, Isa isa);

// The portable loops (cpu_weight_row_portable.cpp); the vector loops use them for tails.
uint64_t encode_run_portable(const Int8EncodeRun& run);
void decode_run_portable(const Int8DecodeRun& run);
uint64_t body_sum_portable(const uint8_t* body, uint64_t first_word, uint64_t words);
void pack_codes_portable(const int8_t* codes, int64_t n, uint64_t first, uint8_t* packed);
void unpack_codes_portable(const uint8_t* packed, uint64_t first, int64_t n, int8_t* codes);

#if GRADCOMP_X86
// AVX2 loops (cpu_weight_row_x86.cpp).
uint64_t encode_run_avx2(const Int8EncodeRun& run);
void decode_run_avx2(const Int8DecodeRun& run);
uint64_t body_sum_avx2(const uint8_t* body, uint64_t words);
void pack_codes_avx2(const int8_t* codes, int64_t n, uint64_t first, uint8_t* packed);
void unpack_codes_avx2(const uint8_t* packed, uint64_t first, int64_t n, int8_t* codes);
#endif

// Today's element-by-element codec (cpu_int8_reference.cpp), kept as the reference the loops
// above must equal byte for byte in tests: the same contract as cpu::int8_encode_row and
// cpu::int8_decode_row.
uint64_t int8_encode_row_reference(const void* input, const Int8Run* runs, int num_runs,
                                   uint32_t block_size, uint8_t* payload);
void int8_decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                               uint32_t block_size, void* output);
// The 4-bit row codec element by element (cpu_int4_reference.cpp), the same contract as
// cpu::int4_encode_row and cpu::int4_decode_row.
uint64_t int4_encode_row_reference(const void* input, const Int8Run* runs, int num_runs,
                                   uint32_t block_size, uint8_t* payload);
void int4_decode_row_reference(const uint8_t* payload, const Int8Run* runs, int num_runs,
                               uint32_t block_size, void* output);
// The GCW8 header with its body checksum `sum` (bytes 0..31).
void int8_write_header(uint8_t* payload, uint8_t flags, uint32_t block, int num_runs,
                       uint64_t numel, uint64_t sum);
// GCW8's header with GCW4's magic and version (the same fields at the same offsets).
void int4_write_header(uint8_t* payload, uint8_t flags, uint32_t block, int num_runs,
                       uint64_t numel, uint64_t sum);

// A weight row codec's entry points beside its element-by-element reference: what the tests and
// benchmarks that treat both codecs alike (test_weight_row_loops.cpp, bench_codecs.cpp) run.
struct WeightRowCodec {
  const char* name;
  uint64_t (*payload_bytes)(const Int8Run*, int, uint32_t);
  uint64_t (*encode)(const void*, const Int8Run*, int, uint32_t, uint8_t*);
  uint64_t (*encode_reference)(const void*, const Int8Run*, int, uint32_t, uint8_t*);
  void (*decode)(const uint8_t*, const Int8Run*, int, uint32_t, void*);
  void (*decode_reference)(const uint8_t*, const Int8Run*, int, uint32_t, void*);
  Int8Verdict (*verdict)(const uint8_t*, const Int8Run*, int, uint32_t);
};

inline const WeightRowCodec kInt8RowCodec = {
    "int8",          int8_row_payload_bytes,    int8_encode_row,  int8_encode_row_reference,
    int8_decode_row, int8_decode_row_reference, int8_row_verdict,
};
inline const WeightRowCodec kInt4RowCodec = {
    "int4",          int4_row_payload_bytes,    int4_encode_row,  int4_encode_row_reference,
    int4_decode_row, int4_decode_row_reference, int4_row_verdict,
};

// The checks a weight row's header and body must pass (GCW8 and GCW4 share the header layout and
// differ in magic, version and size): what int8_row_verdict and int4_row_verdict return.
Int8Verdict weight_row_verdict(const uint8_t* p, const Int8Run* runs, int num_runs,
                               uint32_t block_size, uint32_t magic, uint16_t version,
                               uint64_t total_bytes);

}  // namespace detail
}  // namespace cpu
}  // namespace gradcomp
