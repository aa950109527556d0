// The compressed reduce-scatter: every rank sends row r of its input, compressed, to rank r, which
// decodes and reduces the rows it receives in fp32 (FSDP's gradient reduce-scatter).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/collectives.h"
#include "gradcomp/communicator.h"
#include "gradcomp/types.h"

namespace gradcomp {

// One reduce-scatter. The input holds world_size rows of shard_numel elements; rank r's output
// receives the sum over the ranks of their row r, decoded in fp32 and divided by `divisor`
// (the world size for a mean, 1 for a sum, 1 / factor for c10d's PREMUL_SUM), in dtype.
struct ReduceScatterRequest {
  const void* input = nullptr;  // world_size * shard_numel elements of dtype
  void* output = nullptr;       // shard_numel elements of dtype
  int64_t shard_numel = 0;
  DType dtype = DType::kFloat32;
  uint64_t bucket_id = 0;  // the stable identity its residual is kept under
  float divisor = 1.0f;
};

// Bytes one rank sends in one compressed reduce-scatter: a payload of each row to each other rank
// (the all-to-all of two-phase q4's first phase, or of top-k payloads).
uint64_t compressed_reduce_scatter_bytes_sent(const CompressionConfig& config, int64_t shard_numel,
                                              int world);
// Bytes of a reduce-scatter bucket's residual (all world rows; 0 without error feedback).
uint64_t reduce_scatter_residual_bytes(const CompressionConfig& config, int64_t shard_numel,
                                       int world);

// Steps counted in rounds, for collectives whose caller reduces each bucket once per training step
// in any order (FSDP's modules): a bucket reduced again in the current round starts the next
// step. A reduction that fails is not done(), so redoing it stays in its step.
class StepRounds {
 public:
  // The step a reduction of `bucket` belongs to, starting the next one when it repeats.
  uint32_t step_for(uint64_t bucket) {
    if (round_.count(bucket) != 0) {
      ++step_;
      round_.clear();
    }
    return step_;
  }
  void done(uint64_t bucket) { round_.insert(bucket); }
  // The step the next new round uses, as a checkpoint records it.
  uint32_t next() const { return round_.empty() ? step_ : step_ + 1; }
  void restart(uint32_t next_step) {
    step_ = next_step;
    round_.clear();
  }

 private:
  uint32_t step_ = 0;
  std::set<uint64_t> round_;  // buckets reduced in the current step
};

// Reduce-scatters buckets through q4 or top-k payloads, with an error-feedback residual per bucket
// (each row is compressed on its own: q4 blocks start at the row's first element, random bits are
// keyed by the row; top-k keeps the k = ratio * shard_numel largest of each row). The codecs and
// their error feedback are the allreduce's (CompressionConfig); the allreduce's piece and
// algorithm settings do not apply, and top-k's remedies (warm-up, momentum, clipping) are refused.
//
// Steps: the random bits of a bucket's call are keyed by a step counter that advances when a
// bucket already reduced in the current step is reduced again, so a training step that reduces
// each bucket once (FSDP: each module's gradients) is one step.
//
// Non-finite values: when a rank's input holds a NaN or an infinity, the first element of every
// row it sends is sent as NaN, so every rank's output holds a non-finite block and every rank
// keeps its residual as it was (the step is skipped alike everywhere, as an allreduce's is).
class CompressedReduceScatter {
 public:
  CompressedReduceScatter(Communicator& comm, Backend& backend, const CompressionConfig& config);
  ~CompressedReduceScatter();
  CompressedReduceScatter(const CompressedReduceScatter&) = delete;
  CompressedReduceScatter& operator=(const CompressedReduceScatter&) = delete;

  // Returns false when the output holds non-finite values (the residual is then left as it was).
  // A payload that fails its checks raises an Error naming the sending rank, with the output and
  // the residual untouched. On a CUDA backend it waits for the device three times (clearing the
  // status words, the input's non-finite check, the result's verdict).
  //
  // With the v2 kernels on CUDA (q4 and top-k) it does not wait after a bucket's first call (which
  // allocates and checks the layout): the input's non-finite check is a device flag the encodes
  // read, and the verdict is the device's (a rejected payload or a non-finite result keeps the
  // residual, a rejected one writes no output). It then returns true; the
  // non-finite buckets are counted by nonfinite_buckets() once read. A rejected payload
  // raises its error (naming the bucket and the sending rank) from a later call: the first whose
  // non-blocking read finds the verdict, at the latest the next call of the same bucket (which
  // waits for it), or flush(). The round counter then goes back to before the rejected call, as
  // if it had raised itself: redoing the bucket stays in its step.
  bool reduce_scatter(const ReduceScatterRequest& request);
  // Waits for the device's verdicts on every call so far and raises a rejected payload's error
  // (nothing to do but under v2 on CUDA). load_state() calls it first.
  void flush();
  // Non-finite results since construction, each counted when its verdict is read: by the call
  // itself where it returns false, under v2 on CUDA by the later call or flush() that reads it.
  // Front ends read it after each call and after flush(): the difference is what arrived.
  uint64_t nonfinite_buckets() const { return nonfinite_buckets_; }

  // The step the next new round of buckets uses, as a checkpoint records it.
  uint32_t next_step() const;
  const CompressionConfig& config() const { return config_; }
  int world_size() const { return comm_.world_size(); }
  CompressionState state() const;
  // Residuals of buckets not yet seen are restored at their first call (their sizes checked then).
  void load_state(const CompressionState& state);
  // The element count (world * shard) of a bucket this reduce-scatter has reduced, or -1.
  int64_t bucket_numel(uint64_t bucket_id) const;
  // Bytes of the residuals held now (both buffers of each).
  uint64_t residual_memory() const;

 private:
  struct Bucket;
  Bucket& bucket_for(const ReduceScatterRequest& request);
  void check_layout(const Bucket& b);
  // The error of a payload the device rejected, naming its sending rank.
  std::string rejection_naming_rank(const Bucket& b, const std::string& device_message);
  // The host's check of a bucket's received payloads: the error naming the sender, or "".
  std::string host_rejection(const Bucket& b);
  // v2 on CUDA: reads the verdicts of unread calls, waiting for them or only when they are
  // ready; a rejection raises (rejection_of_unread) after putting the round counter back.
  void read_verdicts(bool wait);
  std::string rejection_of_unread(const std::string& device_message);

  // A call whose verdict the host has not read yet, and the round counter before it.
  struct UnreadCall {
    uint64_t bucket;
    StepRounds rounds_before;
  };

  Communicator& comm_;
  Backend& backend_;
  CompressionConfig config_;
  StepRounds rounds_;
  std::map<uint64_t, std::unique_ptr<Bucket>> buckets_;
  CompressionState pending_;  // loaded residuals of buckets not yet seen
  // v2 on CUDA: the poison and the verdict are decided on the device; the host never waits
  // inside a call (but to read a repeated bucket's earlier verdict).
  bool device_decides_ = false;
  std::vector<UnreadCall> unread_;  // in call order
  size_t snapshot_covers_ = 0;      // unread calls the backend's queued status copy covers
  uint64_t nonfinite_buckets_ = 0;  // read so far, on either path
};

}  // namespace gradcomp
