// Compressed allreduce over a small collective interface (all-to-all, allgather).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "gradcomp/types.h"

namespace gradcomp {

// The transport the compressed collectives are written against. Buffers are host memory or
// device memory as device_memory() says; every rank calls each collective with equal sizes.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual bool device_memory() const = 0;
  // recv[w] (bytes_per_rank bytes) receives send[rank()] of rank w.
  virtual void all_to_all(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // recv[w] receives rank w's send.
  virtual void all_gather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  // Bytes this rank has put on the wire (its own slot is not counted).
  uint64_t bytes_sent() const { return bytes_sent_; }

 protected:
  uint64_t bytes_sent_ = 0;
};

// Where codec work runs: the CPU reference backend or the CUDA backend. Pointers handed to a
// backend are host pointers for segment tables and payload pointer arrays; data pointers are
// memory of the backend's kind.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual bool is_cuda() const = 0;
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  virtual void fill_zero(void* p, size_t bytes) = 0;
  virtual void copy_to_host(void* host, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host, size_t bytes) = 0;
  virtual void q4_encode(const Q4EncodeParams& p) = 0;
  virtual void q4_decode(const Q4DecodeParams& p) = 0;
  virtual void topk_encode(const TopKEncodeParams& p) = 0;
  virtual void topk_decode(const TopKDecodeParams& p) = 0;
  // Bytes of top-k workspace needed for a bucket of numel elements.
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
};

std::unique_ptr<Backend> make_cpu_backend(int num_threads = 1);

enum class Q4Algorithm : uint8_t { kTwoPhase = 0, kOnePhase = 1 };

struct CompressionConfig {
  Codec codec = Codec::kQ4;
  Q4Options q4;
  Q4Algorithm q4_algorithm = Q4Algorithm::kTwoPhase;
  TopKOptions topk;
  bool error_feedback = true;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
  void validate() const;
};

// Bytes one rank sends for one allreduce of a bucket of `numel` elements at world size W.
uint64_t compressed_allreduce_bytes_sent(const CompressionConfig& config, int64_t numel, int world);

// Per-rank state that must survive a checkpoint for an exact resume.
struct CompressionState {
  uint64_t seed = 0;
  uint32_t step = 0;
  // Residual bytes per bucket identity: phase-1 (whole bucket) and phase-2 (own chunk).
  std::map<uint64_t, std::vector<uint8_t>> residuals;
  std::map<uint64_t, std::vector<uint8_t>> chunk_residuals;
};

// Averages a bucket over all ranks through a compressed collective, in place. Keeps each
// bucket's error-feedback residuals keyed by a caller-chosen stable bucket identity.
class CompressedAllreduce {
 public:
  CompressedAllreduce(Communicator& comm, Backend& backend, const CompressionConfig& config);
  ~CompressedAllreduce();
  CompressedAllreduce(const CompressedAllreduce&) = delete;
  CompressedAllreduce& operator=(const CompressedAllreduce&) = delete;

  // Averages the flattened segments (all of one dtype) over the ranks. Returns false when the
  // result holds non-finite values; the residuals are then left as they were.
  bool allreduce(const Segment* segments, int num_segments, DType dtype, uint64_t bucket_id);

  // The same reduction, only queued: on a CUDA backend every step runs in stream order and the
  // host never waits (except for a bucket's first call, which checks the layout across ranks).
  // Which residuals to keep is decided on the device. Results are valid once the backend's
  // stream reaches this point; synchronize() reports what happened.
  void enqueue_allreduce(const Segment* segments, int num_segments, DType dtype,
                         uint64_t bucket_id);

  // Waits for queued reductions. Throws Error if a decode rejected a payload; returns how many
  // buckets came out non-finite since the last call.
  uint64_t synchronize();
  // synchronize() without waiting: false while the report is not ready (see
  // Backend::poll_nonfinite_buckets).
  bool poll(uint64_t* nonfinite_buckets);

  uint32_t step() const { return step_; }
  void set_step(uint32_t step) { step_ = step; }
  void advance_step() { ++step_; }
  const CompressionConfig& config() const { return config_; }

  CompressionState state() const;
  void load_state(const CompressionState& state);
  // Frees a bucket's buffers and residuals (for a caller whose bucket layout changed for good,
  // as DDP's does after its first iteration), so they are neither kept nor checkpointed.
  void release_bucket(uint64_t bucket_id);

 private:
  struct Bucket;
  Bucket& bucket_for(const Segment* segments, int num_segments, DType dtype, uint64_t bucket_id);
  void check_layout(const Bucket& b, uint64_t bucket_id);
  void run_q4_two_phase(Bucket& b, const Segment* segments, int num_segments, DType dtype);
  void run_q4_one_phase(Bucket& b, const Segment* segments, int num_segments, DType dtype);
  void run_topk(Bucket& b, const Segment* segments, int num_segments, DType dtype);
  math::RngKey rng(const Bucket& b, uint32_t phase) const;

  Communicator& comm_;
  Backend& backend_;
  CompressionConfig config_;
  uint32_t step_ = 0;
  std::map<uint64_t, std::unique_ptr<Bucket>> buckets_;
  CompressionState pending_;  // loaded state for buckets not yet seen
};

// Runs W ranks in one process, each on its own thread; for testing the collective algorithms.
class InProcessGroup {
 public:
  explicit InProcessGroup(int world_size, double timeout_seconds = 10.0);
  ~InProcessGroup();
  Communicator& communicator(int rank);
  int world_size() const;
  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Communicator>> comms_;
};

}  // namespace gradcomp
