// Named phases for the timelines: a RECORD_FUNCTION range for the PyTorch profiler and, in CUDA
// builds, an NVTX range for Nsight.
#pragma once

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <functional>
#include <memory>
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

// Sets a thread's profiler state for a scope and puts back what it had.
class ProfilerContext {
 public:
  ProfilerContext(const at::RecordFunctionTLS& tls, std::shared_ptr<c10::ThreadLocalDebugInfo> info)
      : saved_tls_(at::get_record_function_tls_()),
        saved_info_(c10::ThreadLocalDebugInfo::current()) {
    at::set_record_function_tls_(tls);
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(std::move(info));
  }
  ~ProfilerContext() {
    at::set_record_function_tls_(saved_tls_);
    c10::ThreadLocalDebugInfo::_forceCurrentDebugInfo(std::move(saved_info_));
  }
  ProfilerContext(const ProfilerContext&) = delete;
  ProfilerContext& operator=(const ProfilerContext&) = delete;

 private:
  at::RecordFunctionTLS saved_tls_;
  std::shared_ptr<c10::ThreadLocalDebugInfo> saved_info_;
};

// Work done on another thread shows in the profiler of the thread that handed it over. Only the
// record-function state and debug info travel: the full ThreadLocalState also carries
// Python-object state whose copies need the GIL.
inline std::function<void()> with_profiler_context(std::function<void()> task) {
  return [task = std::move(task), tls = at::get_record_function_tls_(),
          info = c10::ThreadLocalDebugInfo::current()] {
    ProfilerContext context(tls, info);
    task();
  };
}

#define GRADCOMP_PHASE(name)                         \
  RECORD_FUNCTION(name, std::vector<c10::IValue>()); \
  ::gradcomp::torch_ext::NvtxRange gradcomp_nvtx_range_(name)

}  // namespace torch_ext
}  // namespace gradcomp
