// v2's end of a bucket: kernels::run_end_bucket's contract, and a rejected payload keeps the
// committed residuals too (the reduce-scatter whose verdict stays on the device).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// As kernels::run_end_bucket, and also when *status (the decoders' rejection word, device
// memory) is non-zero: every pair's committed bytes are copied over its candidate, without
// counting the bucket as non-finite (the decoders wrote nothing).
LaunchStatus run_end_bucket(const EndBucketParams& p, const int32_t* status, cudaStream_t stream);

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
