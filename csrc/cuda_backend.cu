// CUDA backend: validates parameters on the host, stages tables to the device, calls launchers.
#include <cstring>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/cuda.h"
#include "gradcomp/format.h"
#include "launchers.h"

namespace gradcomp {
namespace cuda {

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return false;
  }
  return count > 0;
}

namespace {

// Host-side checks shared with the CPU backend's rules, so both reject the same parameters.
void check_q4(const Q4EncodeParams& p) {
  Q4Options{static_cast<int>(p.block_size)}.validate();
  GRADCOMP_CHECK(p.numel >= 0 && p.begin % p.block_size == 0,
                 "q4 encode: range start " << p.begin << " must be a multiple of the block size "
                                           << p.block_size);
  GRADCOMP_CHECK(p.payload != nullptr, "q4 encode: payload is null");
}

void check_segments(const Segment* segs, int count, int64_t begin, int64_t numel,
                    const char* what) {
  GRADCOMP_CHECK(count >= 1 && segs != nullptr, what << ": no segments");
  int64_t expect = segs[0].offset;
  for (int i = 0; i < count; ++i) {
    GRADCOMP_CHECK(
        segs[i].offset == expect && segs[i].numel >= 0 && (segs[i].numel == 0 || segs[i].data),
        what << ": segment " << i << " is not contiguous with the previous one or has no data");
    expect += segs[i].numel;
  }
  GRADCOMP_CHECK(
      numel == 0 || (begin >= segs[0].offset && begin + numel <= expect),
      what << ": range [" << begin << ", " << begin + numel << ") is outside the segments");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& o) : options_(o) {
    GRADCOMP_CUDA_CHECK(cudaSetDevice(o.device));
    stream_ = o.stream;
    if (stream_ == nullptr) {
      GRADCOMP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      owns_stream_ = true;
    }
    GRADCOMP_CUDA_CHECK(cudaMalloc(&flags_, 2 * sizeof(int32_t)));
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_, 0, 2 * sizeof(int32_t), stream_));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cudaFree(flags_);
    cudaFree(tables_);
    if (owns_stream_) cudaStreamDestroy(stream_);
  }
  bool is_cuda() const override { return true; }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    GRADCOMP_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
    return p;
  }
  void release(void* p) override {
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    GRADCOMP_CUDA_CHECK(cudaFree(p));
  }
  void fill_zero(void* p, size_t bytes) override {
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  void copy_to_host(void* host, const void* src, size_t bytes) override {
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  void copy_from_host(void* dst, const void* host, size_t bytes) override {
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  void q4_encode(const Q4EncodeParams& p) override {
    check_q4(p);
    check_segments(p.segments, p.num_segments, p.begin, p.numel, "q4 encode");
    Q4EncodeParams d = p;
    d.segments = stage_segments(p.segments, p.num_segments);
    GRADCOMP_CUDA_CHECK(kernels::run_q4_encode(d, options_.max_encode_ctas, stream_));
  }
  void q4_decode(const Q4DecodeParams& p) override {
    Q4Options{static_cast<int>(p.block_size)}.validate();
    check_segments(p.segments, p.num_segments, p.begin, p.numel, "q4 decode");
    GRADCOMP_CHECK(p.num_payloads >= 1, "q4 decode: no payloads");
    Q4DecodeParams d = p;
    stage_decode(d);
    GRADCOMP_CUDA_CHECK(kernels::run_q4_decode(d, stream_));
    check_status("q4 decode");
  }
  void topk_encode(const TopKEncodeParams& p) override {
    check_segments(p.segments, p.num_segments, p.begin, p.numel, "top-k encode");
    GRADCOMP_CHECK(p.numel <= kTopKMaxNumel,
                   "top-k encode: bucket of "
                       << p.numel << " elements is too large (limit 2^31 - 1: indices are 32-bit)");
    GRADCOMP_CHECK(p.k >= 0 && p.k <= p.numel && p.capacity <= static_cast<uint64_t>(p.numel) &&
                       (!p.exact || p.capacity == p.k),
                   "top-k encode: k " << p.k << " or capacity " << p.capacity << " out of range");
    GRADCOMP_CHECK(p.workspace != nullptr, "top-k encode: no workspace");
    TopKEncodeParams d = p;
    d.segments = stage_segments(p.segments, p.num_segments);
    GRADCOMP_CUDA_CHECK(kernels::run_topk_encode(d, stream_));
  }
  void topk_decode(const TopKDecodeParams& p) override {
    check_segments(p.segments, p.num_segments, p.begin, p.numel, "top-k decode");
    GRADCOMP_CHECK(p.num_payloads >= 1 && p.workspace != nullptr,
                   "top-k decode: no payloads or workspace");
    TopKDecodeParams d = p;
    stage_decode(d);
    GRADCOMP_CUDA_CHECK(kernels::run_topk_decode(d, stream_));
    check_status("top-k decode");
  }
  size_t topk_workspace_bytes(int64_t numel) const override {
    const size_t sums = static_cast<size_t>(numel) * 4;
    const size_t select = kernels::topk_workspace_bytes(numel);
    return sums > select ? sums : select;
  }
  bool take_decode_status() override {
    int32_t host[2];
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(host, flags_, sizeof host, cudaMemcpyDeviceToHost, stream_));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_, 0, sizeof host, stream_));
    GRADCOMP_CHECK(host[0] == 0, "CUDA decode rejected a payload: "
                                     << (host[0] == 100 ? "index out of range or out of order"
                                                        : header_status_message(host[0])));
    return host[1] != 0;
  }

 private:
  static size_t align(size_t b) { return (b + 15) / 16 * 16; }

  // Decoders report a rejected payload at once, so the caller can name the call that failed.
  void check_status(const char* what) {
    int32_t status = 0;
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(&status, flags_, sizeof status, cudaMemcpyDeviceToHost, stream_));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (status != 0) {
      GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_, 0, sizeof status, stream_));
      GRADCOMP_CHECK(false, what << " rejected a payload: "
                                 << (status == 100 ? "index out of range or out of order"
                                                   : header_status_message(status)));
    }
  }

  // Device table space; grows (after draining the stream) when a launch needs more.
  char* reserve(size_t bytes) {
    if (bytes > table_bytes_) {
      GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
      GRADCOMP_CUDA_CHECK(cudaFree(tables_));
      table_bytes_ = bytes * 2;
      GRADCOMP_CUDA_CHECK(cudaMalloc(&tables_, table_bytes_));
    }
    // Earlier launches may still read the table: wait before overwriting it.
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return static_cast<char*>(tables_);
  }

  // Copies a decoder's segment table and payload pointer array to the device in one transfer and
  // points the params at them and at the backend's status words.
  template <typename Params>
  void stage_decode(Params& d) {
    const size_t seg_bytes = align(sizeof(Segment) * d.num_segments);
    char* table = reserve(seg_bytes + sizeof(void*) * d.num_payloads);
    std::vector<char> host(seg_bytes + sizeof(void*) * d.num_payloads);
    std::memcpy(host.data(), d.segments, sizeof(Segment) * d.num_segments);
    std::memcpy(host.data() + seg_bytes, d.payloads, sizeof(void*) * d.num_payloads);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(table, host.data(), host.size(), cudaMemcpyHostToDevice, stream_));
    d.segments = reinterpret_cast<const Segment*>(table);
    d.payloads = reinterpret_cast<const uint8_t* const*>(table + seg_bytes);
    d.status = flags_;
    d.nonfinite = reinterpret_cast<uint32_t*>(flags_ + 1);
  }

  const Segment* stage_segments(const Segment* segs, int count) {
    char* table = reserve(sizeof(Segment) * count);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(table, segs, sizeof(Segment) * count, cudaMemcpyHostToDevice, stream_));
    return reinterpret_cast<const Segment*>(table);
  }

  CudaBackendOptions options_;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  int32_t* flags_ = nullptr;
  void* tables_ = nullptr;
  size_t table_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

}  // namespace cuda
}  // namespace gradcomp
