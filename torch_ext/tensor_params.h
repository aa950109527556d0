// Thin torch layer: tensor checks and conversion of tensors to the core's params structs.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "gradcomp/gradcomp.h"

namespace gradcomp {
namespace torch_ext {

// The torch layer's one error-checking macro: a c10::Error (ValueError/RuntimeError in Python).
#define GRADCOMP_TORCH_CHECK(cond, ...) TORCH_CHECK(cond, "gradcomp: ", __VA_ARGS__)

// Runs core code, turning gradcomp::Error into a c10::Error with the same text.
template <typename F>
auto call_core(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const gradcomp::Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

DType to_dtype(at::ScalarType t, const char* what);
at::ScalarType to_scalar_type(DType d);

// A contiguous float32/float16/bfloat16 tensor on CPU or CUDA, or an error naming `what`.
void check_gradient_tensor(const at::Tensor& t, const char* what);

// One segment covering the whole (contiguous) tensor.
inline Segment whole_segment(const at::Tensor& t) {
  return Segment{t.data_ptr(), 0, t.numel()};
}

// A backend for the tensor's device: the shared CPU backend, or the CUDA backend of the device
// and current stream.
Backend& backend_for(const at::Tensor& t);

}  // namespace torch_ext
}  // namespace gradcomp
