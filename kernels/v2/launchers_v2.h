// Launchers of the v2 kernels: the v1 launchers' contracts (kernels/launchers.h), rewritten for
// memory bandwidth. Opt-in (KernelGeneration::kV2) until a GPU run proves them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "launchers.h"

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

// How v2 finds the exact threshold in this build and process: the sample bracket (default), or
// cub::DeviceTopK with GRADCOMP_TOPK_EXACT=cub when the build found CCCL >= 3.3 (else it says
// that it fell back to the bracket).
const char* topk_exact_method();

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
