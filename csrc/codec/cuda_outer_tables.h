// The CUDA backend's device tables of DiLoCo fragments' tensors, uploaded once per layout.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "gradcomp/cuda.h"
#include "outer_params.h"
#include "v2/outer_v2_map.h"

namespace gradcomp {
namespace cuda {

// A fragment's tensor list (pointers, sizes, offsets, dtypes) holds from round to round, so its
// device table (kernels/v2/outer_v2_map.h) is built and uploaded the first time the list is seen
// and found again by comparing the list on the host: no upload, no host wait per round. A list
// that changes (parameters reallocated, another fragment) gets its own slot; with every slot
// taken the least recently used one is rebuilt after the launches that read it have run.
class OuterTableCache {
 public:
  OuterTableCache() = default;
  OuterTableCache(const OuterTableCache&) = delete;
  OuterTableCache& operator=(const OuterTableCache&) = delete;
  // Destructors cannot throw: errors here are dropped, the memory is released regardless.
  ~OuterTableCache() {
    for (Slot& s : slots_) {
      if (s.done != nullptr) {
        cudaEventSynchronize(s.done);
        cudaEventDestroy(s.done);
      }
      cudaFreeHost(s.host);
      cudaFree(s.device);
    }
  }

  // The device table of `tensors` (validated by the caller), uploaded on `stream` if new. Call
  // used() after the launches that read it.
  const kernels::v2::OuterDeviceTable& table(const OuterTensor* tensors, int count,
                                             cudaStream_t stream) {
    ++clock_;
    for (Slot& s : slots_) {
      if (s.done != nullptr && same_list(s.key, tensors, count)) {
        s.last_use = clock_;
        last_ = &s;
        return s.table;
      }
    }
    Slot& s = *std::min_element(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) {
      return a.last_use < b.last_use;
    });
    if (s.done == nullptr) {
      GRADCOMP_CUDA_CHECK(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    } else {
      GRADCOMP_CUDA_CHECK(cudaEventSynchronize(s.done));  // its last launches and upload
    }
    const size_t bytes = sizeof(kernels::v2::OuterTableEntry) * count;
    if (bytes > s.bytes) {
      GRADCOMP_CUDA_CHECK(cudaFreeHost(s.host));
      GRADCOMP_CUDA_CHECK(cudaFree(s.device));
      s.host = nullptr;
      s.device = nullptr;
      s.bytes = 0;
      GRADCOMP_CUDA_CHECK(cudaMallocHost(&s.host, bytes));
      GRADCOMP_CUDA_CHECK(cudaMalloc(&s.device, bytes));
      s.bytes = bytes;
    }
    s.key.assign(tensors, tensors + count);
    kernels::v2::build_outer_table(tensors, count, s.host, s.table.runs);
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(s.device, s.host, bytes, cudaMemcpyHostToDevice, stream));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(s.done, stream));  // the upload, if no launch follows
    s.table.entries = s.device;
    s.last_use = clock_;
    last_ = &s;
    return s.table;
  }

  // Marks the table table() last returned as read by what is queued on `stream` so far.
  void used(cudaStream_t stream) {
    if (last_ != nullptr) GRADCOMP_CUDA_CHECK(cudaEventRecord(last_->done, stream));
  }

 private:
  static bool same_list(const std::vector<OuterTensor>& key, const OuterTensor* tensors,
                        int count) {
    if (key.size() != static_cast<size_t>(count)) return false;
    for (int i = 0; i < count; ++i) {
      const OuterTensor& a = key[static_cast<size_t>(i)];
      const OuterTensor& b = tensors[i];
      if (a.data != b.data || a.numel != b.numel || a.offset != b.offset || a.dtype != b.dtype)
        return false;
    }
    return true;
  }

  // Fragments a backend serves at once without rebuilding a table.
  static constexpr int kSlots = 16;
  struct Slot {
    std::vector<OuterTensor> key;
    kernels::v2::OuterTableEntry* host = nullptr;  // pinned: the upload's source
    kernels::v2::OuterTableEntry* device = nullptr;
    size_t bytes = 0;
    kernels::v2::OuterDeviceTable table;
    cudaEvent_t done = nullptr;  // null: the slot was never filled
    uint64_t last_use = 0;
  };
  std::array<Slot, kSlots> slots_;
  Slot* last_ = nullptr;
  uint64_t clock_ = 0;
};

}  // namespace cuda
}  // namespace gradcomp
