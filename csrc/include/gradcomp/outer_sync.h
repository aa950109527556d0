// DiLoCo's outer rounds: every H inner steps the outer gradient goes through the compressed
// allreduce and an outer Nesterov SGD moves the parameters every rank shares.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/collectives.h"
#include "gradcomp/communicator.h"
#include "gradcomp/types.h"

namespace gradcomp {

struct OuterSyncOptions {
  // H: inner steps per round. Each fragment syncs once every H inner steps.
  uint32_t inner_steps = 100;
  // The outer optimizer: SGD on the averaged outer gradient (DiLoCo's defaults).
  float outer_lr = 0.7f;
  float outer_momentum = 0.9f;
  bool nesterov = true;
  // Streaming: the parameters split, in order, into this many fragments of about equal size;
  // fragment f syncs after inner steps t with t mod H = f * H / fragments (so the rounds of the
  // fragments are staggered and each exchange moves 1 / fragments of the model). 1: all at once.
  uint32_t fragments = 1;
  void validate() const;
};

// One parameter tensor: contiguous memory of the backend's kind.
struct OuterParam {
  void* data = nullptr;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

struct OuterSyncStats {
  uint64_t inner_steps = 0;
  uint64_t rounds = 0;            // fragment syncs done
  uint64_t nonfinite_rounds = 0;  // syncs whose mean was not finite (parameters reset instead)
  uint64_t bytes_sent = 0;  // by this rank, as its communicators counted them (agreement included)
  uint64_t uncompressed_bytes = 0;  // what an fp32 ring allreduce of the same rounds would send
  double seconds = 0.0;             // spent in outer steps (math, copies, the allreduce)
};

// Everything an exact resume needs, per rank. Anchors and momenta are the same on every rank.
struct OuterSyncState {
  uint32_t inner_steps = 0;  // H and the fragment count of the run that saved it (checked at load)
  uint64_t inner_step = 0;
  std::vector<uint32_t> rounds;             // per fragment
  std::vector<std::vector<float>> anchors;  // per fragment: its parameters at the last sync
  std::vector<std::vector<float>> momenta;  // per fragment: the outer optimizer's buffer
  CompressionState compression;             // the allreduce's residuals, keyed by fragment
};

// Runs the outer rounds over the parameters it is given (their memory must stay where it is).
// Construction records the start-of-round parameters, which must be the same on every rank (the
// front ends broadcast them first). The outer state (anchors, momentum buffers) lives in host
// memory in fp32 whatever the parameters' dtype or memory; on a CUDA backend each sync copies the
// fragment's parameters to the host and back, and only the allreduce runs on the device.
//
// A sync: g = anchor - param (fp32, per element) -> the compressed allreduce's mean of g (random
// bits keyed by the fragment's round; residuals kept across rounds) -> buf = mu * buf + g;
// anchor -= lr * (g + mu * buf) (Nesterov) -> param = anchor, rounded to the parameter's dtype.
// When the mean is not finite (a rank diverged), every rank resets the fragment's parameters to
// its anchor, and the anchor, the buffer and the residuals stay as they were (the diverged rank's
// inner optimizer state is the program's to restore).
//
// Before each sync the ranks agree that they are at the same inner step, fragment and round,
// with the same H and fragment count (a small allgather; inside and then across nodes when
// hierarchical): ranks started with other settings, or resumed from different checkpoints, get
// an Error naming both positions instead of averaging different rounds.
class OuterSync {
 public:
  OuterSync(Communicator& comm, Backend& backend, const CompressionConfig& config,
            const OuterSyncOptions& options, std::vector<OuterParam> params);
  // Hierarchical allreduce across nodes (CompressedAllreduce's node groups).
  OuterSync(NodeGroups groups, Backend& backend, const CompressionConfig& config,
            const OuterSyncOptions& options, std::vector<OuterParam> params);
  ~OuterSync();
  OuterSync(const OuterSync&) = delete;
  OuterSync& operator=(const OuterSync&) = delete;

  // Counts one inner step (call it after the inner optimizer's step) and syncs the fragments due.
  // Returns how many fragments synced.
  int step();
  // Syncs one fragment now, whatever the step count.
  void sync_fragment(uint32_t fragment);

  const OuterSyncOptions& options() const { return options_; }
  uint32_t fragments() const;
  // The parameter indices of a fragment (a contiguous range of the parameter list).
  std::vector<int64_t> fragment_params(uint32_t fragment) const;
  // Whether a fragment syncs after inner step t (counted from 1).
  bool due(uint32_t fragment, uint64_t t) const;
  // Safe from another thread while a sync runs (a metrics scrape): the counters have a lock of
  // their own, never held across a collective.
  OuterSyncStats stats() const;

  OuterSyncState state() const;
  // Refuses a state of another layout (H, fragment count or sizes, residual sizes) or with
  // non-finite anchors or momenta with an Error, changing nothing. The parameters are left as
  // they are: restore them (the model's checkpoint) as well.
  void load_state(const OuterSyncState& state);

 private:
  struct Fragment;
  void init(std::vector<OuterParam> params);
  // The fragment's parameters in fp32 on the host, or written back from it.
  void read_params(const Fragment& f, float* out) const;
  void write_params(const Fragment& f, const std::vector<float>& values);
  // Raises unless every rank is about to sync `fragment` at the same inner step and round.
  void agree(uint32_t fragment);

  Backend& backend_;
  OuterSyncOptions options_;
  std::unique_ptr<CompressedAllreduce> allreduce_;
  // The groups the ranks' agreement before a sync goes through: all ranks, or the node's and
  // then this local rank's across nodes.
  std::vector<std::pair<Communicator*, const char*>> agreement_;
  std::vector<OuterParam> params_;
  std::vector<Fragment> fragments_;
  int world_ = 1;
  int nodes_ = 0;  // hierarchical: the node count; 0: flat
  // Every communicator a sync sends through (flat: one; hierarchical: the node's and across nodes).
  std::vector<Communicator*> comms_;
  uint64_t inner_step_ = 0;
  mutable std::mutex stats_mu_;  // stats_ only
  OuterSyncStats stats_;
};

}  // namespace gradcomp
