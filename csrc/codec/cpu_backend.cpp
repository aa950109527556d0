// The CPU backend: the reference codecs behind the Backend interface, on host memory.
#include <algorithm>
#include <cstring>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/cpu.h"
#include "params_checks.h"

namespace gradcomp {
namespace {

using detail::check_backend_workspace;

// The segment table of `p` with element p.begin read from `nan` (one NaN of p.dtype): what a set
// nan_head (Q4EncodeParams, TopKEncodeParams) means, as the reduce-scatter's host path builds it.
template <typename EncodeParams>
std::vector<Segment> segments_with_nan_head(const EncodeParams& p, void* nan) {
  std::vector<Segment> out{{nan, p.begin, 1}};
  const int64_t esize = math::dtype_bytes(p.dtype);
  for (int i = 0; i < p.num_segments; ++i) {
    const Segment& s = p.segments[i];
    const int64_t end = s.offset + s.numel;
    const int64_t from = std::max(s.offset, p.begin + 1);
    if (end <= from) continue;
    out.push_back({static_cast<char*>(s.data) + (from - s.offset) * esize, from, end - from});
  }
  return out;
}

// One NaN of `dtype` in the low bytes of a word (little-endian, as the codecs read it).
uint32_t nan_word(uint8_t dtype) {
  if (dtype == math::kDtypeF32) return 0x7fc00000u;
  return dtype == math::kDtypeBF16 ? 0x7fc0u : 0x7e00u;
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads) {}
  bool is_cuda() const override { return false; }
  void* allocate(size_t bytes) override { return ::operator new(bytes == 0 ? 1 : bytes); }
  void release(void* p) noexcept override { ::operator delete(p); }
  void fill_zero(void* p, size_t bytes) override { std::memset(p, 0, bytes); }
  void copy_to_host(void* host, const void* src, size_t bytes) override {
    std::memcpy(host, src, bytes);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes) override {
    std::memcpy(dst, host, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override { std::memcpy(dst, src, bytes); }
  void q4_encode(const Q4EncodeParams& p) override {
    if (p.nan_head != nullptr && *p.nan_head != 0 && p.numel > 0 && p.segments != nullptr) {
      uint32_t nan = nan_word(p.dtype);
      const std::vector<Segment> table = segments_with_nan_head(p, &nan);
      Q4EncodeParams q = p;
      q.segments = table.data();
      q.num_segments = static_cast<int>(table.size());
      q.nan_head = nullptr;
      return q4_encode(q);
    }
    if (p.codec == format::kCodecQ2) {
      cpu::q2_encode(p, threads_);
    } else {
      cpu::q4_encode(p, threads_);
    }
  }
  void q4_decode(const Q4DecodeParams& p) override {
    Q4DecodeParams q = p;
    q.nonfinite = &nonfinite_;
    if (p.codec == format::kCodecQ2) {
      cpu::q2_decode(q, threads_);
    } else {
      cpu::q4_decode(q, threads_);
    }
  }
  void topk_encode(const TopKEncodeParams& p) override {
    detail::check_params(p, "top-k encode");
    check_backend_workspace(p.workspace, "top-k encode");
    if (p.nan_head != nullptr && *p.nan_head != 0 && p.numel > 0 && p.segments != nullptr) {
      uint32_t nan = nan_word(p.dtype);
      const std::vector<Segment> table = segments_with_nan_head(p, &nan);
      TopKEncodeParams q = p;
      q.segments = table.data();
      q.num_segments = static_cast<int>(table.size());
      q.nan_head = nullptr;
      return topk_encode(q);
    }
    cpu::topk_encode(p);
  }
  void topk_decode(const TopKDecodeParams& p) override {
    detail::check_params(p, "top-k decode");
    check_backend_workspace(p.workspace, "top-k decode");
    TopKDecodeParams q = p;
    q.nonfinite = &nonfinite_;
    cpu::topk_decode(q);
  }
  void check_payloads(const PayloadCheckParams& p) override { cpu::check_payloads(p); }
  void topk_accumulate(const TopKAccumulateParams& p) override { cpu::topk_accumulate(p); }
  void topk_mask(const TopKMaskParams& p) override { cpu::topk_mask(p); }
  void scan_nonfinite(const NonfiniteScanParams& p) override {
    NonfiniteScanParams q = p;
    if (q.nonfinite == nullptr) q.nonfinite = &nonfinite_;
    cpu::scan_nonfinite(q);
  }
  size_t topk_workspace_bytes(int64_t numel) const override {
    return cpu::topk_workspace_bytes(numel);
  }
  bool take_decode_status() override {
    const bool bad = nonfinite_ != 0;
    nonfinite_ = 0;
    return bad;
  }
  void end_bucket(const ResidualPair* pairs, int count) override {
    detail::end_bucket_params(pairs, count, "end_bucket");
    if (nonfinite_ != 0) {
      for (int i = 0; i < count; ++i)
        std::memcpy(pairs[i].candidate, pairs[i].committed, static_cast<size_t>(pairs[i].bytes));
      ++nonfinite_buckets_;
    }
    nonfinite_ = 0;
  }
  uint64_t take_nonfinite_buckets() override {
    const uint64_t n = nonfinite_buckets_;
    nonfinite_buckets_ = 0;
    return n;
  }
  bool poll_nonfinite_buckets(uint64_t* count) override {
    *count = take_nonfinite_buckets();
    return true;
  }
  void int8_encode(const Int8EncodeParams& p) override { cpu::int8_encode(p); }
  void int8_decode(const Int8DecodeParams& p) override { cpu::int8_decode(p); }
  const char* int8_unsupported() const override { return nullptr; }
  void int4_encode(const Int8EncodeParams& p) override { cpu::int4_encode(p); }
  void int4_decode(const Int8DecodeParams& p) override { cpu::int4_decode(p); }
  const char* int4_unsupported() const override { return nullptr; }
  void outer_gradient(const OuterGradientParams& p) override { cpu::outer_gradient(p); }
  void outer_step(const OuterStepParams& p) override { cpu::outer_step(p); }
  void outer_merge(const OuterMergeParams& p) override { cpu::outer_merge(p); }
  const char* outer_unsupported() const override { return nullptr; }

 private:
  int threads_;
  uint32_t nonfinite_ = 0;
  uint64_t nonfinite_buckets_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int num_threads) {
  return std::make_unique<CpuBackend>(num_threads);
}

}  // namespace gradcomp
