// Launch helpers shared by the q4 and top-k launchers: sealing an encoded payload with its body
// checksum, and checking received payloads before they are decoded.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace gradcomp {
namespace kernels {
namespace detail {

// After the header (body checksum 0) and the sections are written: sums the body into the
// header and redoes the header checksum. `total` is the payload's byte length.
cudaError_t launch_seal(uint8_t* payload, uint64_t total, cudaStream_t stream);

// Checks every payload's header against the expected layout and its body against the header's
// checksum into *status (the first failure; decoders after it write nothing). Payload w holds
// numel_each[w] elements (device array), or `numel` when numel_each is null. `sums`: n zeroed
// device words.
cudaError_t launch_payload_checks(const uint8_t* const* payloads, int n, const int64_t* numel_each,
                                  int64_t numel, uint8_t codec, uint32_t param, uint8_t value_dtype,
                                  uint64_t available, uint64_t* sums, int32_t* status,
                                  cudaStream_t stream);

}  // namespace detail
}  // namespace kernels
}  // namespace gradcomp
