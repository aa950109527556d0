// A Backend that forwards every call to another: the base of backends that change a few calls
// (torch_ext's ProfiledBackend, the tests' stand-ins) and inherit the rest.
#pragma once

#include <memory>
#include <utility>

#include "gradcomp/backend.h"

namespace gradcomp {

class ForwardingBackend : public Backend {
 public:
  explicit ForwardingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
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
  void copy(void* dst, const void* src, size_t bytes) override { inner_->copy(dst, src, bytes); }
  void q4_encode(const Q4EncodeParams& p) override { inner_->q4_encode(p); }
  void q4_decode(const Q4DecodeParams& p) override { inner_->q4_decode(p); }
  void topk_encode(const TopKEncodeParams& p) override { inner_->topk_encode(p); }
  void topk_decode(const TopKDecodeParams& p) override { inner_->topk_decode(p); }
  void check_payloads(const PayloadCheckParams& p) override { inner_->check_payloads(p); }
  void topk_accumulate(const TopKAccumulateParams& p) override { inner_->topk_accumulate(p); }
  void topk_mask(const TopKMaskParams& p) override { inner_->topk_mask(p); }
  void scan_nonfinite(const NonfiniteScanParams& p) override { inner_->scan_nonfinite(p); }
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
  void int8_encode(const Int8EncodeParams& p) override { inner_->int8_encode(p); }
  void int8_decode(const Int8DecodeParams& p) override { inner_->int8_decode(p); }
  const char* int8_unsupported() const override { return inner_->int8_unsupported(); }
  void int4_encode(const Int8EncodeParams& p) override { inner_->int4_encode(p); }
  void int4_decode(const Int8DecodeParams& p) override { inner_->int4_decode(p); }
  const char* int4_unsupported() const override { return inner_->int4_unsupported(); }
  void outer_gradient(const OuterGradientParams& p) override { inner_->outer_gradient(p); }
  void outer_step(const OuterStepParams& p) override { inner_->outer_step(p); }
  void outer_merge(const OuterMergeParams& p) override { inner_->outer_merge(p); }
  const char* outer_unsupported() const override { return inner_->outer_unsupported(); }

 protected:
  // The backend every call not overridden goes to.
  Backend& inner() const { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace gradcomp
