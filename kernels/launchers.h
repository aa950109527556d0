// CUDA launchers: one per kernel family, taking the torch-free params structs (device pointers).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "params.h"

namespace gradcomp {
namespace kernels {

// Every pointer in the params (segment tables and payload pointer arrays included) is device
// memory. Launchers return the launch status; they never synchronize.

// `max_ctas` bounds the grid so that encoding next to backward leaves SMs free (0 = no bound).
cudaError_t run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream);

// Validates every header on the device into *p.status (which must be zero on entry), then decodes;
// a non-zero status leaves the output untouched.
cudaError_t run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream);

size_t topk_workspace_bytes(int64_t numel);
cudaError_t run_topk_encode(const TopKEncodeParams& p, cudaStream_t stream);

// p.workspace holds numel fp32 sums; *p.status must be zero on entry.
cudaError_t run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream);

// Reads the flag on the device, so the host never waits to choose a bucket's residuals.
cudaError_t run_end_bucket(const EndBucketParams& p, cudaStream_t stream);

}  // namespace kernels
}  // namespace gradcomp
