// v2 payload checks, shared by the v2 decoders: every body summed with 16-byte loads, the
// headers checked by the last block to finish, in one launch.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

// As detail::launch_payload_checks (kernels/payload_kernels.h); `sums` holds n + 1 zeroed words
// (the last counts finished blocks).
cudaError_t launch_checks(const uint8_t* const* payloads, int n, const int64_t* numel_each,
                          int64_t numel, uint8_t codec, uint32_t param, uint8_t value_dtype,
                          uint64_t available, uint64_t* sums, int32_t* status, cudaStream_t stream);

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
