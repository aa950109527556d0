// Launchers of the v2 kernels: the v1 launchers' contracts (kernels/launchers.h), rewritten for
// memory bandwidth. Opt-in (KernelGeneration::kV2) until a GPU run proves them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "int8_params.h"
#include "launchers.h"
#include "outer_params.h"
#include "v2/outer_v2_map.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// Same contract as kernels::run_q4_encode; the payload's body checksum is summed in the encode
// pass and the header sealed by the last block to finish.
LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream);

// Same contract as kernels::run_q4_decode: every payload checked on the device first, nothing
// written when one is bad.
LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream);

// q2 (codec kCodecQ2 in the params): kernels::run_q4_encode's and run_q4_decode's contracts with
// q2's bytes (cpu_q2.cpp is the reference). q2 has no v1 kernels: these are its only ones.
LaunchStatus run_q2_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream);
LaunchStatus run_q2_decode(const Q4DecodeParams& p, cudaStream_t stream);

// Same contract as kernels::run_check_payloads.
LaunchStatus run_check_payloads(const PayloadCheckParams& p, cudaStream_t stream);

// Same contracts as the v1 top-k launchers; the workspace is v2's own size.
size_t topk_workspace_bytes(int64_t numel);
LaunchStatus run_topk_encode(const TopKEncodeParams& p, cudaStream_t stream);
LaunchStatus run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream);

// ---- The int8 weight all-gather (kernels/int8_params.h; v2 only) ----------------------------
// Encode: one launch per run, then a seal writing the header (or zeroing a flagged body) and
// *p.nonfinite_at. Every pointer is device memory but p.runs (host); p.payload is 16-byte aligned;
// `scratch` holds 2 zeroed words (the body sum, the non-finite mark).
LaunchStatus run_int8_encode(const Int8EncodeParams& p, uint64_t* scratch, cudaStream_t stream);
// Check, then decode: p.payloads is a device array of 16-byte aligned payloads, p.runs host
// memory; `sums` holds num_payloads + 1 zeroed words. A payload whose verdict is not kInt8Ok
// leaves every row untouched (the decode launches read the verdicts on the device).
LaunchStatus run_int8_decode(const Int8DecodeParams& p, uint64_t* sums, cudaStream_t stream);

// ---- The 4-bit weight all-gather (GCW4, kernels/int4_params.h; v2 only) ---------------------
// run_int8_encode's and run_int8_decode's contracts with GCW4's bytes (cpu_int4.cpp is the
// reference): the same params, scratch and sum words, alignment and verdicts.
LaunchStatus run_int4_encode(const Int8EncodeParams& p, uint64_t* scratch, cudaStream_t stream);
LaunchStatus run_int4_decode(const Int8DecodeParams& p, uint64_t* sums, cudaStream_t stream);

// ---- DiLoCo's outer step (kernels/outer_params.h; v2 only) ---------------------------------
// The Backend::outer_* contracts, queued on `stream` without a wait. Every pointer is device
// memory but p.tensors (host); each tensor's elements must be aligned to its dtype (refused
// otherwise). `table` is p.tensors' device table (outer_v2_map.h's build_outer_table, uploaded by
// the caller, which keeps it alive until the launches have run). One launch per dtype the
// fragment has (16-byte accesses for each tensor whose data and stretch of the fp32 buffers are
// 16-byte aligned); the step without a store is one launch and reads no table.
LaunchStatus run_outer_gradient(const OuterGradientParams& p, const OuterDeviceTable& table,
                                cudaStream_t stream);
LaunchStatus run_outer_step(const OuterStepParams& p, const OuterDeviceTable& table,
                            cudaStream_t stream);
LaunchStatus run_outer_merge(const OuterMergeParams& p, const OuterDeviceTable& table,
                             cudaStream_t stream);

// How v2 finds the exact threshold in this build and process: the sample bracket (default), or
// cub::DeviceTopK with GRADCOMP_TOPK_EXACT=cub when the build found CCCL >= 3.3 (else it says
// that it fell back to the bracket).
const char* topk_exact_method();

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
