// CUDA launchers: one per kernel family, taking the torch-free params structs (device pointers).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "params.h"

namespace gradcomp {
namespace kernels {

// What a launcher did. `rejected` names the rule the params broke (params_problem, or a
// launcher's own requirement), and then nothing was launched; otherwise `error` is the status of
// the launches. Launchers never synchronize.
struct LaunchStatus {
  const char* rejected = nullptr;
  cudaError_t error = cudaSuccess;
  bool ok() const { return rejected == nullptr && error == cudaSuccess; }
};

inline LaunchStatus launched(cudaError_t error) {
  LaunchStatus s;
  s.error = error;
  return s;
}

// Every pointer in the params (segment tables and payload pointer arrays included) is device
// memory.

// `max_ctas` bounds the grid so that encoding next to backward leaves SMs free (0 = no bound).
LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream);

// Validates every header and body checksum on the device into *p.status (which must be zero on
// entry), then decodes; a non-zero status leaves the output untouched.
LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream);

// Bytes p.workspace must hold for a bucket of numel elements: the same buffer serves encode (the
// radix-select state) and decode (the fp32 sums).
size_t topk_workspace_bytes(int64_t numel);
LaunchStatus run_topk_encode(const TopKEncodeParams& p, cudaStream_t stream);

// *p.status must be zero on entry.
LaunchStatus run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream);

// DGC's remedies (params.h): p.scratch (device, (topk_clip_chunks(numel) + 1) floats; a top-k
// workspace is large enough) is needed when clipping. The mask reads the payload's entry count
// from its header on the device.
LaunchStatus run_topk_accumulate(const TopKAccumulateParams& p, cudaStream_t stream);
LaunchStatus run_topk_mask(const TopKMaskParams& p, cudaStream_t stream);

// Checks payloads of differing element counts into *p.status (zero on entry), so the decodes
// queued after it write nothing when one is bad.
LaunchStatus run_check_payloads(const PayloadCheckParams& p, cudaStream_t stream);

// Reads the flag on the device, so the host never waits to choose a bucket's residuals.
LaunchStatus run_end_bucket(const EndBucketParams& p, cudaStream_t stream);
// Sets *p.nonfinite when the segments (a device segment table) hold a NaN or an infinity.
LaunchStatus run_nonfinite_scan(const NonfiniteScanParams& p, cudaStream_t stream);

}  // namespace kernels
}  // namespace gradcomp
