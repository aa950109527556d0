// Tensor checks, dtype mapping and per-device backends for the torch layer.
#include "tensor_params.h"

#include <map>
#include <memory>
#include <mutex>

#if defined(GRADCOMP_HAVE_CUDA)
#include <c10/cuda/CUDAStream.h>
#endif

namespace gradcomp {
namespace torch_ext {

DType to_dtype(at::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      GRADCOMP_TORCH_CHECK(false, what, " must be float32, float16 or bfloat16, got ", t);
  }
}

at::ScalarType to_scalar_type(DType d) {
  return d == DType::kFloat32 ? at::kFloat : (d == DType::kFloat16 ? at::kHalf : at::kBFloat16);
}

void check_gradient_tensor(const at::Tensor& t, const char* what) {
  GRADCOMP_TORCH_CHECK(t.defined(), what, " is undefined");
  to_dtype(t.scalar_type(), what);
  GRADCOMP_TORCH_CHECK(t.is_contiguous(), what, " must be contiguous (call .contiguous())");
  GRADCOMP_TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), what,
                       " must be on CPU or CUDA, got ", t.device());
#if !defined(GRADCOMP_HAVE_CUDA)
  GRADCOMP_TORCH_CHECK(
      t.device().is_cpu(), what, " is on ", t.device(),
      " but this gradcomp build has no CUDA kernels (nvcc was not found at build time)");
#endif
}

Backend& backend_for(const at::Tensor& t) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (t.device().is_cpu()) {
    static std::unique_ptr<Backend> cpu = make_cpu_backend(1);
    return *cpu;
  }
#if defined(GRADCOMP_HAVE_CUDA)
  static std::map<std::pair<int, cudaStream_t>, std::unique_ptr<Backend>> cuda_backends;
  const int device = t.device().index();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  auto& b = cuda_backends[{device, stream}];
  if (!b) {
    cuda::CudaBackendOptions o;
    o.device = device;
    o.stream = stream;
    b = call_core([&] { return cuda::make_cuda_backend(o); });
  }
  return *b;
#else
  GRADCOMP_TORCH_CHECK(false, "no CUDA support in this build");
#endif
}

}  // namespace torch_ext
}  // namespace gradcomp
