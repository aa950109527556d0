// The CPU codecs: the reference implementation of every codec. Payloads equal the CUDA kernels'.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradcomp/types.h"
#include "int4_params.h"
#include "int8_params.h"
#include "outer_params.h"

namespace gradcomp {
namespace cpu {

// Instruction sets the CPU q4 loops can use. Every one writes the same bytes as kPortable, the
// reference; the fastest one this CPU supports is chosen at first use. kAvx512 is the AVX2
// loops with 512-bit random-bit generation.
enum class Isa : uint8_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
bool isa_supported(Isa isa);
Isa active_isa();
// For tests and benchmarks: selects the loops every later call uses (process-wide). Throws Error
// when this CPU lacks the instruction set.
void set_active_isa(Isa isa);

// Encodes one q4 payload. Throws Error on bad parameters (the checks every backend shares).
// num_threads splits blocks over threads.
void q4_encode(const Q4EncodeParams& params, int num_threads = 1);

// Validates every payload (header and body checksum) first; on any mismatch throws Error and
// writes nothing.
void q4_decode(const Q4DecodeParams& params, int num_threads = 1);

// The q2 codec (params.codec == kCodecQ2), with q4's params structs, checks and validation; one
// portable loop (no vector paths yet).
void q2_encode(const Q4EncodeParams& params, int num_threads = 1);
void q2_decode(const Q4DecodeParams& params, int num_threads = 1);

// Bytes of the top-k workspace (params.workspace) on the CPU: the fp32 sums of numel elements.
// The CPU codecs take a null workspace and allocate the same amount per call; a Backend does not.
inline size_t topk_workspace_bytes(int64_t numel) {
  return static_cast<size_t>(numel > 0 ? numel : 0) * 4;
}

// Encodes one top-k payload; returns the entries written.
uint64_t topk_encode(const TopKEncodeParams& params);

// Validates every header and every index (in range, strictly increasing) before writing.
void topk_decode(const TopKDecodeParams& params);

// DGC's step before a top-k encode: clipping, then the momentum-corrected velocity (params.h).
void topk_accumulate(const TopKAccumulateParams& params);

// Momentum factor masking: zeroes params.target at the indices of a payload this rank encoded.
void topk_mask(const TopKMaskParams& params);

// Sets *params.nonfinite when the segments hold a NaN or an infinity.
void scan_nonfinite(const NonfiniteScanParams& params);

// Checks payloads of differing element counts (header and body checksum) before any is decoded;
// throws Error naming the first bad one's rank.
void check_payloads(const PayloadCheckParams& params);

// The int8 row codec (Backend::int8_encode, Backend::int8_decode); throws Error on bad params.
void int8_encode(const Int8EncodeParams& params);
void int8_decode(const Int8DecodeParams& params);
// Its row functions, on runs the caller checked (int8_runs_problem). Encode writes
// int8_row_payload_bytes and returns Int8EncodeParams::nonfinite_at's value; the verdict reads
// the header and body checksum; decode writes one row and trusts the payload's verdict.
uint64_t int8_encode_row(const void* input, const Int8Run* runs, int num_runs, uint32_t block,
                         uint8_t* payload);
Int8Verdict int8_row_verdict(const uint8_t* payload, const Int8Run* runs, int num_runs,
                             uint32_t block);
void int8_decode_row(const uint8_t* payload, const Int8Run* runs, int num_runs, uint32_t block,
                     void* output);

// The 4-bit row codec (GCW4, kernels/int4_params.h) on the int8 codec's params and verdicts, with
// the same contracts: element by element, the reference a GPU must equal byte for byte.
void int4_encode(const Int8EncodeParams& params);
void int4_decode(const Int8DecodeParams& params);
uint64_t int4_encode_row(const void* input, const Int8Run* runs, int num_runs, uint32_t block,
                         uint8_t* payload);
Int8Verdict int4_row_verdict(const uint8_t* payload, const Int8Run* runs, int num_runs,
                             uint32_t block);
void int4_decode_row(const uint8_t* payload, const Int8Run* runs, int num_runs, uint32_t block,
                     void* output);

// DiLoCo's outer step (Backend::outer_gradient, outer_step, outer_merge; kernels/outer_params.h)
// on host memory, math::outer_* per element; throws Error on bad params.
void outer_gradient(const OuterGradientParams& params);
void outer_step(const OuterStepParams& params);
void outer_merge(const OuterMergeParams& params);

}  // namespace cpu
}  // namespace gradcomp
