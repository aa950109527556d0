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

// A decode of two payloads of `codec` (1000 fp32 elements, blocks of 64), the second corrupted by
// `corrupt`: rejected at the next status check by an `Expected` whose message names `what`, the
// output untouched; check_payloads rejects the pair too and accepts two good ones.
template <class Expected>
void expect_corrupt_payload_rejected(Backend& backend, uint8_t codec,
                                     void (*corrupt)(std::vector<uint8_t>&), const char* what) {
  SCOPED_TRACE(what);
  testing::HostTensor x =
      testing::HostTensor::from_floats(DType::kFloat32, testing::normal_floats(1000, 2));
  auto good = testing::block_encode_tensor(codec, x, 64, true, {1, 0, 0, 0, 0}, {}, false, 1);
  auto bad = good;
  corrupt(bad.payload);
  DeviceBuffer dgood(good.payload.data(), good.payload.size()),
      dbad(bad.payload.data(), bad.payload.size());
  std::vector<float> sentinel(1000, 42.0f);
  DeviceBuffer dy(sentinel.data(), 4000);
  Segment seg{dy.get(), 0, 1000};
  const uint8_t* ptrs[2] = {dgood.get(), dbad.get()};
  Q4DecodeParams d;
  d.codec = codec;
  d.payloads = ptrs;
  d.num_payloads = 2;
  d.payload_bytes = good.payload.size();
  d.numel = 1000;
  d.segments = &seg;
  d.num_segments = 1;
  backend.q4_decode(d);
  try {
    backend.take_decode_status();
    ADD_FAILURE() << "a corrupted payload was accepted";
  } catch (const Expected& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::memcmp(dy.host().data(), sentinel.data(), 4000), 0);
  const int64_t numel[2] = {1000, 1000};
  PayloadCheckParams c;
  c.codec = codec;
  c.param = 64;
  c.value_dtype = codec == format::kCodecQ2 ? math::kDtypeBF16 : math::kDtypeF32;
  c.payloads = ptrs;
  c.num_payloads = 2;
  c.payload_bytes = good.payload.size();
  c.numel = numel;
  backend.check_payloads(c);
  EXPECT_THROW(backend.take_decode_status(), Expected);
  ptrs[1] = dgood.get();
  backend.check_payloads(c);
  EXPECT_FALSE(backend.take_decode_status());
}

}  // namespace gradcomp
