// Named phases for the timelines: a RECORD_FUNCTION range for the PyTorch profiler and, in CUDA
// builds, an NVTX range for Nsight.
#pragma once

#include <ATen/record_function.h>

#include <vector>

#if defined(GRADCOMP_HAVE_CUDA)
#include <nvtx3/nvToolsExt.h>
#endif

namespace gradcomp {
namespace torch_ext {

struct NvtxRange {
  explicit NvtxRange(const char* name) {
#if defined(GRADCOMP_HAVE_CUDA)
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#if defined(GRADCOMP_HAVE_CUDA)
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

#define GRADCOMP_PHASE(name)                         \
  RECORD_FUNCTION(name, std::vector<c10::IValue>()); \
  ::gradcomp::torch_ext::NvtxRange gradcomp_nvtx_range_(name)

}  // namespace torch_ext
}  // namespace gradcomp
