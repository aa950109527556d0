// CUDA backend: checks params with the CPU's rules, stages tables to the device, calls launchers.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_outer_tables.h"
#include "gradcomp/cuda.h"
#include "gradcomp/format.h"
#include "int4_params.h"
#include "launchers.h"
#include "params_checks.h"
#include "v2/end_bucket_v2.h"
#include "v2/launchers_v2.h"

namespace gradcomp {
namespace cuda {

namespace detail {

void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status == cudaSuccess) return;
  ::gradcomp::detail::throw_error(file, line,
                                  std::string(call) + " failed: " + cudaGetErrorString(status));
}

void check_cuda(const kernels::LaunchStatus& status, const char* call, const char* file, int line) {
  if (status.rejected != nullptr)
    ::gradcomp::detail::throw_error(file, line,
                                    std::string(call) + " refused its params: " + status.rejected);
  check_cuda(status.error, call, file, line);
}

}  // namespace detail

bool device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error for later calls
    return false;
  }
  return count > 0;
}

namespace {

using ::gradcomp::detail::check_backend_workspace;
using ::gradcomp::detail::check_params;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& o)
      : options_(o), v2_(resolve_kernel_generation(o.kernels) == KernelGeneration::kV2) {
    GRADCOMP_CUDA_CHECK(cudaSetDevice(o.device));
    stream_ = o.stream;
    if (stream_ == nullptr) {
      GRADCOMP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      owns_stream_ = true;
    }
    GRADCOMP_CUDA_CHECK(cudaMalloc(&flags_, kFlagWords * sizeof(int32_t)));
    GRADCOMP_CUDA_CHECK(cudaMallocHost(&snapshot_, sizeof(Flags)));
    GRADCOMP_CUDA_CHECK(cudaEventCreateWithFlags(&snapshot_done_, cudaEventDisableTiming));
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_, 0, kFlagWords * sizeof(int32_t), stream_));
  }
  // Destructors cannot throw: errors here are dropped, the memory is released regardless.
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cudaFree(flags_);
    cudaFreeHost(snapshot_);
    cudaEventDestroy(snapshot_done_);
    for (TableSlot& slot : tables_) {
      if (slot.done != nullptr) cudaEventDestroy(slot.done);
      cudaFreeHost(slot.host);
      cudaFree(slot.device);
    }
    if (owns_stream_) cudaStreamDestroy(stream_);
  }
  bool is_cuda() const override { return true; }
  // q2's only CUDA kernels are v2's (opt-in until a device runs them byte-equal to the CPU).
  void check_codec(uint8_t codec) const override {
    GRADCOMP_CHECK(codec != format::kCodecQ2 || v2_,
                   "Q2 on CUDA runs only on the v2 kernels (opt-in until a GPU run proves them): "
                   "set GRADCOMP_KERNELS=v2, or kernels=\"v2\" in the codec spec "
                   "(gradcomp.Q2(kernels=\"v2\"), gradcomp::Q2::kernels = KernelGeneration::kV2); "
                   "or use the CPU backend");
  }
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    GRADCOMP_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 16 : bytes));
    return p;
  }
  // Buffers release from destructors, which must not throw: a failure is kept and raised by the
  // next status call.
  void release(void* p) noexcept override {
    cudaError_t err = cudaStreamSynchronize(stream_);
    const cudaError_t freed = cudaFree(p);
    if (err == cudaSuccess) err = freed;
    if (err != cudaSuccess && deferred_error_ == cudaSuccess) deferred_error_ = err;
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
  void copy(void* dst, const void* src, size_t bytes) override {
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  void q4_encode(const Q4EncodeParams& p) override {
    check_codec(p.codec);
    check_params(p, p.codec == format::kCodecQ2 ? "q2 encode" : "q4 encode");
    GRADCOMP_CHECK(p.nan_head == nullptr || v2_,
                   "q4 encode: a device NaN-head flag (the reduce-scatter's non-finite poison) "
                   "needs the v2 kernels (GRADCOMP_KERNELS=v2)");
    Q4EncodeParams d = p;
    d.segments_host = p.segments;
    TableSlot& slot = stage_segments(d.segments, p.num_segments);
    if (p.codec == format::kCodecQ2)
      GRADCOMP_CUDA_CHECK(kernels::v2::run_q2_encode(d, options_.max_encode_ctas, stream_));
    else
      GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_q4_encode(d, options_.max_encode_ctas, stream_)
                              : kernels::run_q4_encode(d, options_.max_encode_ctas, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void q4_decode(const Q4DecodeParams& p) override {
    check_codec(p.codec);
    check_params(p, p.codec == format::kCodecQ2 ? "q2 decode" : "q4 decode");
    Q4DecodeParams d = p;
    d.segments_host = p.segments;
    TableSlot& slot = stage_decode(d);
    if (p.codec == format::kCodecQ2)
      GRADCOMP_CUDA_CHECK(kernels::v2::run_q2_decode(d, stream_));
    else
      GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_q4_decode(d, stream_)
                              : kernels::run_q4_decode(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void topk_encode(const TopKEncodeParams& p) override {
    check_params(p, "top-k encode");
    check_backend_workspace(p.workspace, "top-k encode");
    GRADCOMP_CHECK(p.nan_head == nullptr || v2_,
                   "top-k encode: a device NaN-head flag (the reduce-scatter's non-finite poison) "
                   "needs the v2 kernels (GRADCOMP_KERNELS=v2)");
    TopKEncodeParams d = p;
    TableSlot& slot = stage_segments(d.segments, p.num_segments);
    GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_topk_encode(d, stream_)
                            : kernels::run_topk_encode(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void topk_decode(const TopKDecodeParams& p) override {
    check_params(p, "top-k decode");
    check_backend_workspace(p.workspace, "top-k decode");
    TopKDecodeParams d = p;
    TableSlot& slot = stage_decode(d);
    GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_topk_decode(d, stream_)
                            : kernels::run_topk_decode(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void scan_nonfinite(const NonfiniteScanParams& p) override {
    // The backend's status word unless the caller gave its own, as on the CPU: the params are
    // checked with it in place.
    NonfiniteScanParams d = p;
    if (d.nonfinite == nullptr) d.nonfinite = reinterpret_cast<uint32_t*>(flags_ + kNonfinite);
    check_params(d, "non-finite scan");
    TableSlot& slot = stage_segments(d.segments, p.num_segments);
    GRADCOMP_CUDA_CHECK(kernels::run_nonfinite_scan(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void topk_accumulate(const TopKAccumulateParams& p) override {
    check_params(p, "top-k accumulate");
    TopKAccumulateParams d = p;
    TableSlot& slot = stage_segments(d.segments, p.num_segments);
    GRADCOMP_CUDA_CHECK(kernels::run_topk_accumulate(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  void topk_mask(const TopKMaskParams& p) override {
    check_params(p, "top-k mask");
    GRADCOMP_CUDA_CHECK(kernels::run_topk_mask(p, stream_));
  }
  void check_payloads(const PayloadCheckParams& p) override {
    check_codec(p.codec);
    check_params(p, "payload check");
    const size_t ptr_bytes = align(sizeof(void*) * p.num_payloads);
    const size_t numel_bytes = align(sizeof(int64_t) * p.num_payloads);
    const size_t bytes = ptr_bytes + numel_bytes + sizeof(uint64_t) * (p.num_payloads + 1);
    TableSlot& slot = acquire_table(bytes);
    std::memset(slot.host, 0, bytes);
    std::memcpy(slot.host, p.payloads, sizeof(void*) * p.num_payloads);
    std::memcpy(slot.host + ptr_bytes, p.numel, sizeof(int64_t) * p.num_payloads);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
    PayloadCheckParams d = p;
    d.payloads = reinterpret_cast<const uint8_t* const*>(slot.device);
    d.numel = reinterpret_cast<const int64_t*>(slot.device + ptr_bytes);
    d.body_sums = reinterpret_cast<uint64_t*>(slot.device + ptr_bytes + numel_bytes);
    d.status = flags_ + kStatus;
    GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_check_payloads(d, stream_)
                            : kernels::run_check_payloads(d, stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }
  size_t topk_workspace_bytes(int64_t numel) const override {
    return v2_ ? kernels::v2::topk_workspace_bytes(numel) : kernels::topk_workspace_bytes(numel);
  }
  bool take_decode_status() override {
    const Flags f = read_flags();
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_ + kNonfinite, 0, sizeof(int32_t), stream_));
    return f.nonfinite != 0;
  }
  void end_bucket(const ResidualPair* pairs, int count) override {
    EndBucketParams e = ::gradcomp::detail::end_bucket_params(pairs, count, "end_bucket");
    e.nonfinite = reinterpret_cast<const uint32_t*>(flags_ + kNonfinite);
    e.nonfinite_buckets = reinterpret_cast<uint32_t*>(flags_ + kNonfiniteBuckets);
    // v2: a rejected payload (the decoders wrote nothing) keeps the committed residuals too.
    GRADCOMP_CUDA_CHECK(v2_ ? kernels::v2::run_end_bucket(e, flags_ + kStatus, stream_)
                            : kernels::run_end_bucket(e, stream_));
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_ + kNonfinite, 0, sizeof(int32_t), stream_));
  }
  uint64_t take_nonfinite_buckets() override {
    uint64_t polled = 0;
    if (snapshot_pending_) {
      GRADCOMP_CUDA_CHECK(cudaEventSynchronize(snapshot_done_));
      poll_nonfinite_buckets(&polled);
    }
    const Flags f = read_flags();
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_ + kNonfiniteBuckets, 0, sizeof(int32_t), stream_));
    return polled + static_cast<uint32_t>(f.nonfinite_buckets);
  }
  bool poll_nonfinite_buckets(uint64_t* count) override {
    *count = 0;
    if (!snapshot_pending_) {
      // Copy the status words, then clear the count in stream order, so every bucket is counted
      // by exactly one report.
      GRADCOMP_CUDA_CHECK(
          cudaMemcpyAsync(snapshot_, flags_, sizeof(Flags), cudaMemcpyDeviceToHost, stream_));
      GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_ + kNonfiniteBuckets, 0, sizeof(int32_t), stream_));
      GRADCOMP_CUDA_CHECK(cudaEventRecord(snapshot_done_, stream_));
      snapshot_pending_ = true;
      return false;
    }
    raise_deferred_error();
    const cudaError_t state = cudaEventQuery(snapshot_done_);
    if (state == cudaErrorNotReady) return false;
    GRADCOMP_CUDA_CHECK(state);
    snapshot_pending_ = false;
    throw_if_rejected(snapshot_->status);
    *count = static_cast<uint32_t>(snapshot_->nonfinite_buckets);
    return true;
  }

  // The weight all-gathers' kernels (int8 and 4-bit) exist in v2 only; under v1 they are refused
  // naming the switch.
  const char* int8_unsupported() const override {
    return v2_ ? nullptr
               : "its CUDA kernels are v2 only: set GRADCOMP_KERNELS=v2 (opt-in until a GPU has "
                 "run them byte-equal to the CPU; docs/api.md, \"Kernel generations\")";
  }
  const char* int4_unsupported() const override { return int8_unsupported(); }
  void int8_encode(const Int8EncodeParams& p) override {
    weight_encode(p, params_problem(p), "int8 encode", kernels::v2::run_int8_encode);
  }
  void int8_decode(const Int8DecodeParams& p) override {
    weight_decode(p, params_problem(p), "int8 decode", kernels::v2::run_int8_decode);
  }
  void int4_encode(const Int8EncodeParams& p) override {
    weight_encode(p, int4_params_problem(p), "4-bit encode", kernels::v2::run_int4_encode);
  }
  void int4_decode(const Int8DecodeParams& p) override {
    weight_decode(p, int4_params_problem(p), "4-bit decode", kernels::v2::run_int4_decode);
  }

  // ---- DiLoCo's outer step (kernels/outer_params.h): v2 kernels only. Under v1 OuterSync keeps
  // the outer state in host memory and stages the parameters through it, as before v2 had them.
  const char* outer_unsupported() const override {
    return v2_ ? nullptr
               : "its CUDA kernels are v2 only: set GRADCOMP_KERNELS=v2 (opt-in until a GPU has "
                 "run them byte-equal to the CPU; docs/api.md, \"Kernel generations\")";
  }
  // One launch per dtype over the fragment's tensors, through its cached device table.
  void outer_gradient(const OuterGradientParams& p) override {
    check_outer(params_problem(p), "outer gradient");
    const auto& table = outer_tables_.table(p.tensors, p.num_tensors, stream_);
    GRADCOMP_CUDA_CHECK(kernels::v2::run_outer_gradient(p, table, stream_));
    outer_tables_.used(stream_);
  }
  void outer_step(const OuterStepParams& p) override {
    check_outer(params_problem(p), "outer step");
    if (p.num_tensors == 0) {  // no store: the fp32 state alone, no table
      GRADCOMP_CUDA_CHECK(kernels::v2::run_outer_step(p, kernels::v2::OuterDeviceTable{}, stream_));
      return;
    }
    const auto& table = outer_tables_.table(p.tensors, p.num_tensors, stream_);
    GRADCOMP_CUDA_CHECK(kernels::v2::run_outer_step(p, table, stream_));
    outer_tables_.used(stream_);
  }
  void outer_merge(const OuterMergeParams& p) override {
    check_outer(params_problem(p), "outer merge");
    const auto& table = outer_tables_.table(p.tensors, p.num_tensors, stream_);
    GRADCOMP_CUDA_CHECK(kernels::v2::run_outer_merge(p, table, stream_));
    outer_tables_.used(stream_);
  }

 private:
  // The outer operations' refusals, in the CPU's words first (the same params rule).
  void check_outer(const char* problem, const char* what) const {
    const char* unsupported = outer_unsupported();
    GRADCOMP_CHECK(unsupported == nullptr, "DiLoCo " << what << " on CUDA: " << unsupported);
    GRADCOMP_CHECK(problem == nullptr, "DiLoCo " << what << ": " << problem);
  }

  // The weight operations' shared refusals: v1 kernels, then the params' rule.
  void check_int8(const char* problem, const char* what) const {
    const char* unsupported = int8_unsupported();
    GRADCOMP_CHECK(unsupported == nullptr, what << " on CUDA: " << unsupported);
    GRADCOMP_CHECK(problem == nullptr, what << ": " << problem);
  }

  // A weight row's encode (GCW8 or GCW4, by `launch`): refusals, then two zeroed words (the body
  // sum, the non-finite mark) staged with no wait.
  using WeightEncodeLauncher = kernels::LaunchStatus (*)(const Int8EncodeParams&, uint64_t*,
                                                         cudaStream_t);
  void weight_encode(const Int8EncodeParams& p, const char* problem, const char* what,
                     WeightEncodeLauncher launch) {
    check_int8(problem, what);
    check_int8(int8_alignment_problem(p.runs, p.num_runs, p.input, false), what);
    GRADCOMP_CHECK(reinterpret_cast<uintptr_t>(p.payload) % 16 == 0,
                   what << ": the payload is not 16-byte aligned");
    TableSlot& slot = acquire_table(2 * sizeof(uint64_t));
    std::memset(slot.host, 0, 2 * sizeof(uint64_t));
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(slot.device, slot.host, 2 * sizeof(uint64_t),
                                        cudaMemcpyHostToDevice, stream_));
    GRADCOMP_CUDA_CHECK(launch(p, reinterpret_cast<uint64_t*>(slot.device), stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }

  // Every rank's rows checked then decoded (by `launch`): the payload pointers and
  // num_payloads + 1 zeroed body-sum words staged in one transfer.
  using WeightDecodeLauncher = kernels::LaunchStatus (*)(const Int8DecodeParams&, uint64_t*,
                                                         cudaStream_t);
  void weight_decode(const Int8DecodeParams& p, const char* problem, const char* what,
                     WeightDecodeLauncher launch) {
    check_int8(problem, what);
    check_int8(int8_alignment_problem(p.runs, p.num_runs, p.output, p.num_payloads > 1), what);
    for (int w = 0; w < p.num_payloads; ++w)
      GRADCOMP_CHECK(
          p.payloads[w] != nullptr && reinterpret_cast<uintptr_t>(p.payloads[w]) % 16 == 0,
          what << ": payload " << w << " is null or not 16-byte aligned");
    const size_t ptr_bytes = align(sizeof(void*) * p.num_payloads);
    const size_t bytes = ptr_bytes + sizeof(uint64_t) * (p.num_payloads + 1);
    TableSlot& slot = acquire_table(bytes);
    std::memset(slot.host, 0, bytes);
    std::memcpy(slot.host, p.payloads, sizeof(void*) * p.num_payloads);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
    Int8DecodeParams d = p;
    d.payloads = reinterpret_cast<const uint8_t* const*>(slot.device);
    GRADCOMP_CUDA_CHECK(launch(d, reinterpret_cast<uint64_t*>(slot.device + ptr_bytes), stream_));
    GRADCOMP_CUDA_CHECK(cudaEventRecord(slot.done, stream_));
  }

  // Status words on the device: a decoder's rejection code (decoders write nothing while it is
  // non-zero), the non-finite flag of the current bucket, and the non-finite bucket count.
  enum : int { kStatus = 0, kNonfinite = 1, kNonfiniteBuckets = 2, kFlagWords = 3 };
  struct Flags {
    int32_t status, nonfinite, nonfinite_buckets;
  };

  // Waits for the stream, then reads the status words.
  Flags read_flags() {
    raise_deferred_error();
    Flags f;
    GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(&f, flags_, sizeof f, cudaMemcpyDeviceToHost, stream_));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    throw_if_rejected(f.status);
    return f;
  }

  // A decoder's rejection code is cleared (so later decodes write again) and thrown.
  void throw_if_rejected(int32_t status) {
    if (status == 0) return;
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(flags_ + kStatus, 0, sizeof(int32_t), stream_));
    throw PayloadError(std::string("CUDA decode rejected a payload: ") +
                       payload_status_message(status));
  }

  // A failure release() had to keep, raised once.
  void raise_deferred_error() {
    const cudaError_t err = deferred_error_;
    deferred_error_ = cudaSuccess;
    GRADCOMP_CHECK(err == cudaSuccess,
                   "releasing a CUDA buffer failed: " << cudaGetErrorString(err));
  }

  // Launch tables (segment lists, payload pointers) go through a ring of pinned host and device
  // slots. A slot is reused only after the event recorded behind its last launch has passed,
  // which with kTableSlots slots is long before the host gets back to it: staging never
  // synchronizes the stream.
  static constexpr int kTableSlots = 64;
  struct TableSlot {
    char* host = nullptr;
    char* device = nullptr;
    size_t bytes = 0;
    cudaEvent_t done = nullptr;
  };

  TableSlot& acquire_table(size_t bytes) {
    TableSlot& slot = tables_[next_table_];
    next_table_ = (next_table_ + 1) % kTableSlots;
    if (slot.done == nullptr) {
      GRADCOMP_CUDA_CHECK(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    } else {
      GRADCOMP_CUDA_CHECK(cudaEventSynchronize(slot.done));
    }
    if (bytes > slot.bytes) {
      GRADCOMP_CUDA_CHECK(cudaFreeHost(slot.host));
      GRADCOMP_CUDA_CHECK(cudaFree(slot.device));
      slot.host = nullptr;
      slot.device = nullptr;
      slot.bytes = std::max<size_t>(4096, bytes * 2);
      GRADCOMP_CUDA_CHECK(cudaMallocHost(&slot.host, slot.bytes));
      GRADCOMP_CUDA_CHECK(cudaMalloc(&slot.device, slot.bytes));
    }
    return slot;
  }

  static size_t align(size_t b) { return (b + 15) / 16 * 16; }

  // Copies a decoder's segment table and payload pointer array to the device in one transfer,
  // with zeroed words for the payloads' body sums, and points the params at them and at the
  // backend's status words. The caller records slot.done after its launch.
  template <typename Params>
  TableSlot& stage_decode(Params& d) {
    const size_t seg_bytes = align(sizeof(Segment) * d.num_segments);
    const size_t ptr_bytes = align(sizeof(void*) * d.num_payloads);
    const size_t bytes = seg_bytes + ptr_bytes + sizeof(uint64_t) * (d.num_payloads + 1);
    TableSlot& slot = acquire_table(bytes);
    std::memset(slot.host, 0, bytes);
    std::memcpy(slot.host, d.segments, sizeof(Segment) * d.num_segments);
    std::memcpy(slot.host + seg_bytes, d.payloads, sizeof(void*) * d.num_payloads);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
    d.segments = reinterpret_cast<const Segment*>(slot.device);
    d.payloads = reinterpret_cast<const uint8_t* const*>(slot.device + seg_bytes);
    d.body_sums = reinterpret_cast<uint64_t*>(slot.device + seg_bytes + ptr_bytes);
    d.status = flags_ + kStatus;
    d.nonfinite = reinterpret_cast<uint32_t*>(flags_ + kNonfinite);
    return slot;
  }

  // Stages a segment table and repoints `segments` at the device copy.
  TableSlot& stage_segments(const Segment*& segments, int count) {
    const size_t bytes = sizeof(Segment) * count;
    TableSlot& slot = acquire_table(bytes);
    std::memcpy(slot.host, segments, bytes);
    GRADCOMP_CUDA_CHECK(
        cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice, stream_));
    segments = reinterpret_cast<const Segment*>(slot.device);
    return slot;
  }

  CudaBackendOptions options_;
  bool v2_;  // KernelGeneration::kV2: the kernels/v2 launchers
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  int32_t* flags_ = nullptr;
  Flags* snapshot_ = nullptr;  // pinned: the status words copied by poll_nonfinite_buckets
  cudaEvent_t snapshot_done_ = nullptr;
  bool snapshot_pending_ = false;
  cudaError_t deferred_error_ = cudaSuccess;
  std::array<TableSlot, kTableSlots> tables_;
  int next_table_ = 0;
  OuterTableCache outer_tables_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(options);
}

}  // namespace cuda
}  // namespace gradcomp
