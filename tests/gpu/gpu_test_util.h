// Helpers of the GPU tests: device buffers, byte-string differences, both kernel generations.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/cuda.h"
#include "test_util.h"

namespace gradcomp {

#define SKIP_WITHOUT_GPU() \
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device on this machine"

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    GRADCOMP_CUDA_CHECK(cudaMalloc(&ptr_, bytes ? bytes : 16));
  }
  // The backends run on streams of their own (non-blocking ones among them), which plain
  // cudaMemcpy does not wait for: the device is synchronized around every copy.
  DeviceBuffer(const void* host, size_t bytes) : DeviceBuffer(bytes) {
    GRADCOMP_CUDA_CHECK(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice));
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  std::vector<uint8_t> host() const {
    std::vector<uint8_t> v(bytes_);
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(v.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

const DType kDtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Where two byte strings first differ, as 32-bit words around it (gtest prints only the start).
inline std::string first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size());
  size_t i = 0;
  while (i < a.size() && a[i] == b[i]) ++i;
  if (i == a.size()) return "equal";
  const size_t word = i / 4 * 4;
  char text[160];
  uint32_t wa = 0, wb = 0;
  std::memcpy(&wa, a.data() + word, std::min<size_t>(4, a.size() - word));
  std::memcpy(&wb, b.data() + word, std::min<size_t>(4, b.size() - word));
  std::snprintf(text, sizeof text, "first difference at byte %zu of %zu: word %08x vs %08x", i,
                a.size(), wa, wb);
  return text;
}

const KernelGeneration kGenerations[] = {KernelGeneration::kV1, KernelGeneration::kV2};

inline const char* gen_name(KernelGeneration g) {
  return g == KernelGeneration::kV2 ? "v2" : "v1";
}

// A CUDA backend running one kernel generation.
inline std::unique_ptr<Backend> backend_of(KernelGeneration g) {
  cuda::CudaBackendOptions o;
  o.kernels = g;
  return cuda::make_cuda_backend(o);
}

}  // namespace gradcomp
