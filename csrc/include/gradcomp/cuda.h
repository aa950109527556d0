// CUDA backend: codec launches on a stream, device-side validation, and a Backend for collectives.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "gradcomp/backend.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace kernels {
struct LaunchStatus;
}  // namespace kernels

namespace cuda {
namespace detail {
// Throw Error naming the call (and file and line) when a CUDA call failed, or when a launcher
// refused its params or failed to launch (kernels/launchers.h).
void check_cuda(cudaError_t status, const char* call, const char* file, int line);
void check_cuda(const kernels::LaunchStatus& status, const char* call, const char* file, int line);
}  // namespace detail

// The CUDA layer's one error-checking macro, for CUDA runtime calls and gradcomp's launchers.
#define GRADCOMP_CUDA_CHECK(expr) \
  ::gradcomp::cuda::detail::check_cuda((expr), #expr, __FILE__, __LINE__)

// True when a CUDA device can be used from this process.
bool device_available();

struct CudaBackendOptions {
  int device = 0;
  cudaStream_t stream = nullptr;  // null: the backend creates its own non-blocking stream
  int max_encode_ctas = 0;        // bound on the encode grid, leaving SMs to backward (0 = none)
  KernelGeneration kernels = KernelGeneration::kDefault;  // resolved once, at construction
};

// A Backend running every codec on one device and stream. Params given to it carry host segment
// tables and payload pointer arrays (it stages them to the device) and device data pointers.
std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options = {});

}  // namespace cuda
}  // namespace gradcomp
