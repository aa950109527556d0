// Where codec work runs: the Backend interface, implemented by the CPU and the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gradcomp/types.h"
#include "int8_params.h"
#include "outer_params.h"

namespace gradcomp {

// Runs the codecs on one kind of memory. Pointers handed to a backend are host pointers for
// segment tables and payload pointer arrays; data pointers are memory of the backend's kind.
// Both backends check every params struct with the same rules (params_problem, the segment
// table, a top-k workspace), so they refuse the same inputs with the same message.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual bool is_cuda() const = 0;
  // Throws Error, naming the way in, when this backend has no kernels for `codec` as configured
  // (CUDA: q2 runs only on the v2 kernels); collectives call it before their first bucket.
  virtual void check_codec(uint8_t /*codec*/) const {}
  virtual void* allocate(size_t bytes) = 0;
  // Never throws (buffers release in destructors); the CUDA backend reports a failure at its
  // next status call.
  virtual void release(void* p) noexcept = 0;
  virtual void fill_zero(void* p, size_t bytes) = 0;
  virtual void copy_to_host(void* host, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host, size_t bytes) = 0;
  // Between two buffers of the backend's memory, in stream order (CUDA: nothing waits).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void q4_encode(const Q4EncodeParams& p) = 0;
  virtual void q4_decode(const Q4DecodeParams& p) = 0;
  virtual void topk_encode(const TopKEncodeParams& p) = 0;
  virtual void topk_decode(const TopKDecodeParams& p) = 0;
  // Checks payloads whose element counts differ (header and body checksum) before any of them is
  // decoded, so a bad one leaves every output untouched: throws naming its rank (CPU), or sets
  // the status word that later decodes read and take_decode_status() reports (CUDA).
  virtual void check_payloads(const PayloadCheckParams& p) = 0;
  // DGC's remedies around a top-k encode (params.h): clipping and momentum correction before it,
  // factor masking after it. TopKAccumulateParams::scratch is the backend's to fill in.
  virtual void topk_accumulate(const TopKAccumulateParams& p) = 0;
  virtual void topk_mask(const TopKMaskParams& p) = 0;
  // Flags the segments as a non-finite result when they hold a NaN or an infinity (the flag
  // end_bucket() and take_decode_status() read). NonfiniteScanParams::nonfinite is the
  // backend's to fill in.
  virtual void scan_nonfinite(const NonfiniteScanParams& p) = 0;
  // The top-k workspace a bucket of numel elements needs: the memory TopKEncodeParams::workspace
  // and TopKDecodeParams::workspace point to (one buffer serves both).
  virtual size_t topk_workspace_bytes(int64_t numel) const = 0;
  // Waits for the backend's queued work (nothing to wait for on the CPU). Throws Error if a
  // decode rejected a payload since the last check; reports and clears whether a decode
  // produced non-finite values.
  virtual bool take_decode_status() = 0;
  // Ends one bucket's reduction in stream order, without waiting: when a decode since the last
  // end_bucket() produced non-finite values, copies each pair's committed residual over its
  // candidate (so the caller adopts the candidates either way) and counts the bucket as
  // non-finite. Clears the non-finite flag. At most EndBucketParams::kMaxPairs pairs.
  virtual void end_bucket(const ResidualPair* pairs, int count) = 0;
  // Waits for the backend's queued work; throws Error if a decode rejected a payload since the
  // last check; returns and clears the number of non-finite buckets end_bucket() counted.
  virtual uint64_t take_nonfinite_buckets() = 0;
  // The same report without waiting: returns false when it is not ready yet. On CUDA the first
  // call queues a copy of the status words and later calls pick it up once the stream has
  // passed it; buckets queued after that copy are reported by a later poll.
  virtual bool poll_nonfinite_buckets(uint64_t* count) = 0;
  // The int8 weight all-gather's codec (kernels/int8_params.h). Encode reports a non-finite row
  // in Int8EncodeParams::nonfinite_at; decode leaves a verdict per payload in
  // Int8DecodeParams::verdicts and writes no row unless every payload is well-formed and finite.
  // Neither throws for what the data holds, and on CUDA neither waits: the caller reads the
  // words back once, when it needs them.
  virtual void int8_encode(const Int8EncodeParams& p) = 0;
  virtual void int8_decode(const Int8DecodeParams& p) = 0;
  // Why this backend cannot run the int8 codec (the CUDA backend under the v1 kernels), or null.
  virtual const char* int8_unsupported() const = 0;
  // The 4-bit weight all-gather's codec (GCW4, kernels/int4_params.h) on the same params, with the
  // same contracts. A backend without it says why in int4_unsupported(), and CompressedAllGather
  // refuses it at construction, so the two operations are never reached there.
  virtual const char* int4_unsupported() const { return "it has no 4-bit weight codec"; }
  virtual void int4_encode(const Int8EncodeParams& /*p*/) {
    GRADCOMP_CHECK(false, "4-bit encode: " << int4_unsupported());
  }
  virtual void int4_decode(const Int8DecodeParams& /*p*/) {
    GRADCOMP_CHECK(false, "4-bit decode: " << int4_unsupported());
  }

  // ---- DiLoCo's outer step (kernels/outer_params.h): the outer gradient of a fragment, the
  // outer SGD step over its fp32 anchor and momentum (storing the new anchor into the
  // parameters), and the merge of a late round. The CPU's are the reference (cpu::outer_*); the
  // CUDA backend's run the v2 kernels, queued on its stream without a wait.
  virtual void outer_gradient(const OuterGradientParams& p) = 0;
  virtual void outer_step(const OuterStepParams& p) = 0;
  virtual void outer_merge(const OuterMergeParams& p) = 0;
  // Why this backend has no outer-step operations (the CUDA backend under the v1 kernels: OuterSync
  // then keeps the outer state in host memory and stages the parameters through it), or null.
  virtual const char* outer_unsupported() const = 0;
};

// The CPU backend: the reference codecs (gradcomp/cpu.h) behind the Backend interface.
std::unique_ptr<Backend> make_cpu_backend(int num_threads = 1);

}  // namespace gradcomp
