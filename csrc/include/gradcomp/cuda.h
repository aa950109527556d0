// CUDA backend: codec launches on a stream, device-side validation, and a Backend for collectives.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "gradcomp/collectives.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace cuda {

// The CUDA layer's one error-checking macro: throws gradcomp::Error naming the call and error.
#define GRADCOMP_CUDA_CHECK(expr)                                                   \
  do {                                                                              \
    const cudaError_t gradcomp_cuda_err_ = (expr);                                  \
    GRADCOMP_CHECK(gradcomp_cuda_err_ == cudaSuccess,                               \
                   #expr << " failed: " << cudaGetErrorString(gradcomp_cuda_err_)); \
  } while (0)

// True when a CUDA device can be used from this process.
bool device_available();

struct CudaBackendOptions {
  int device = 0;
  cudaStream_t stream = nullptr;  // null: the backend creates its own non-blocking stream
  int max_encode_ctas = 0;        // bound on the encode grid, leaving SMs to backward (0 = none)
};

// A Backend running every codec on one device and stream. Params given to it carry host segment
// tables and payload pointer arrays (it stages them to the device) and device data pointers.
std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options = {});

}  // namespace cuda
}  // namespace gradcomp
