// A Backend that names each codec call as a profiler phase (encode, decode, checks), so the
// timelines of the torch front ends show where a bucket's time goes between its collectives.
#pragma once

#include <memory>
#include <utility>

#include "gradcomp/forwarding_backend.h"
#include "profiler_ranges.h"

namespace gradcomp {
namespace torch_ext {

// Forwards every call to `inner`, the codec calls inside a range. On CUDA the ranges cover the
// time to queue the work.
class ProfiledBackend final : public ForwardingBackend {
 public:
  explicit ProfiledBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}
  void copy(void* dst, const void* src, size_t bytes) override {
    GRADCOMP_PHASE("gradcomp::copy");
    inner().copy(dst, src, bytes);
  }
  void q4_encode(const Q4EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::q4_encode");
    inner().q4_encode(p);
  }
  void q4_decode(const Q4DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::q4_decode");
    inner().q4_decode(p);
  }
  void topk_encode(const TopKEncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_encode");
    inner().topk_encode(p);
  }
  void topk_decode(const TopKDecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_decode");
    inner().topk_decode(p);
  }
  void check_payloads(const PayloadCheckParams& p) override {
    GRADCOMP_PHASE("gradcomp::check_payloads");
    inner().check_payloads(p);
  }
  void topk_accumulate(const TopKAccumulateParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_accumulate");
    inner().topk_accumulate(p);
  }
  void topk_mask(const TopKMaskParams& p) override {
    GRADCOMP_PHASE("gradcomp::topk_mask");
    inner().topk_mask(p);
  }
  void scan_nonfinite(const NonfiniteScanParams& p) override {
    GRADCOMP_PHASE("gradcomp::scan_nonfinite");
    inner().scan_nonfinite(p);
  }
  void int8_encode(const Int8EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int8_encode");
    inner().int8_encode(p);
  }
  void int8_decode(const Int8DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int8_decode");
    inner().int8_decode(p);
  }
  void int4_encode(const Int8EncodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int4_encode");
    inner().int4_encode(p);
  }
  void int4_decode(const Int8DecodeParams& p) override {
    GRADCOMP_PHASE("gradcomp::int4_decode");
    inner().int4_decode(p);
  }
  void outer_gradient(const OuterGradientParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_gradient");
    inner().outer_gradient(p);
  }
  void outer_step(const OuterStepParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_step");
    inner().outer_step(p);
  }
  void outer_merge(const OuterMergeParams& p) override {
    GRADCOMP_PHASE("gradcomp::outer_merge");
    inner().outer_merge(p);
  }
};

}  // namespace torch_ext
}  // namespace gradcomp
