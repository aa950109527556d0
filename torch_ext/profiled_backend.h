// A Backend that names each codec call as a profiler phase (encode, decode, checks), so the
// timelines of the torch front ends show where a bucket's time goes between its collectives.
#pragma once

#include <memory>
#include <utility>

#include "gradcomp/backend.h"
#include "profiler_ranges.h"

namespace gradcomp {
namespace torch_ext {

// Forwards every call to `inner`. On CUDA the ranges cover the time to queue the work.
class ProfiledBackend final : public Backend {
 public:
  explicit ProfiledBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  bool is_cuda() const override { return inner_->is_cuda(); }
  void check_codec(uint8_t codec) const override { inner_->check_codec(codec); }
  void* allocate(size_t bytes) override { return inner_->allocate(bytes); }
  void release(void* p) noexcept override { inner_->release(p); }
  void fill_zero(void* p, size_t bytes) override { inner_->fill_zero(p, bytes); }
  void copy_to_host(void* host, const void* src, size_t bytes) override {
    inner_->copy_to_host(host, src, bytes);
  }
  void copy_from_host(void* dst, const void* host, size_t bytes) override {
    inner_->copy_from_host(dst, host, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    GRADCOMP_PHASE("gradcomp::copy");
    inner_->copy(dst, src, bytes);
  }
  void q4_encode(const Q4EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::q4_encode");
    inner_->q4_encode(p);
  }
  void q4_decode(const Q4DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::q4_decode");
    inner_->q4_decode(p);
  }
  void topk_encode(const TopKEncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_encode");
    inner_->topk_encode(p);
  }
  void topk_decode(const TopKDecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_decode");
    inner_->topk_decode(p);
  }
  void check_payloads(const PayloadCheckParams& p) override {
    GRADCOMP_PHASE("gradcomp::check_payloads");
    inner_->check_payloads(p);
  }
  void topk_accumulate(const TopKAccumulateParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_accumulate");
    inner_->topk_accumulate(p);
  }
  void topk_mask(const TopKMaskParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_mask");
    inner_->topk_mask(p);
  }
  void scan_nonfinite(const NonfiniteScanParams& p) override {
    GRADCOMP_PHASE("gradcomp::scan_nonfinite");
    inner_->scan_nonfinite(p);
  }
  size_t topk_workspace_bytes(int64_t numel) const override {
    return inner_->topk_workspace_bytes(numel);
  }
  bool take_decode_status() override { return inner_->take_decode_status(); }
  void end_bucket(const ResidualPair* pairs, int count) override {
    inner_->end_bucket(pairs, count);
  }
  uint64_t take_nonfinite_buckets() override { return inner_->take_nonfinite_buckets(); }
  bool poll_nonfinite_buckets(uint64_t* count) override {
    return inner_->poll_nonfinite_buckets(count);
  }
  void int8_encode(const Int8EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int8_encode");
    inner_->int8_encode(p);
  }
  void int8_decode(const Int8DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int8_decode");
    inner_->int8_decode(p);
  }
  const char* int8_unsupported() const override { return inner_->int8_unsupported(); }
  void int4_encode(const Int8EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int4_encode");
    inner_->int4_encode(p);
  }
  void int4_decode(const Int8DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int4_decode");
    inner_->int4_decode(p);
  }
  const char* int4_unsupported() const override { return inner_->int4_unsupported(); }
  void outer_gradient(const OuterGradientParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_gradient");
    inner_->outer_gradient(p);
  }
  void outer_step(const OuterStepParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_step");
    inner_->outer_step(p);
  }
  void outer_merge(const OuterMergeParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_merge");
    inner_->outer_merge(p);
  }
  const char* outer_unsupported() const override { return inner_->outer_unsupported(); }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace torch_ext
}  // namespace gradcomp
