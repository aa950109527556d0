// DiLoCo's outer rounds: every H inner steps the outer gradient goes through the compressed
// allreduce and an outer Nesterov SGD moves the parameters every rank shares.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
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
  // Streaming DiLoCo's overlap (tau): a fragment's round runs on a background thread while the
  // caller's inner steps go on, and is merged overlap_steps inner steps after its sync point.
  // 0: the round blocks the step that starts it (the merge is at once). Needs
  // overlap_steps * fragments < inner_steps, so that a round is merged at or before the next
  // fragment's sync point and one round at a time uses the communicators.
  uint32_t overlap_steps = 0;
  // alpha: at the merge the fragment's parameters become alpha * local + (1 - alpha) * global,
  // local being the parameters then (overlap_steps inner steps past the sync point), global the
  // new anchor. 0: the parameters are the anchor (as without overlap).
  float mixing = 0.0f;
  // Eager updates (Kale et al. 2025; needs overlap_steps > 0 and mixing 0): at the sync point
  // each rank moves the fragment at once to its eager anchor, the outer step taken with its own
  // outer gradient (on a copy of the momentum buffer), and its inner steps go on from there; at the
  // merge the global anchor replaces the eager one: param += global - eager, keeping the tau
  // steps' local progress. The anchor and buffer every rank shares take only the global step.
  bool eager = false;
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
  // Seconds the caller's thread spent in outer steps (math, copies, the agreement, the allreduce
  // or the wait for it): the communication training sees.
  double seconds = 0.0;
  // overlap_steps > 0: of `seconds`, the part spent waiting at the merge for a round still
  // running (the exposed communication), and the seconds the rounds ran in the background.
  double wait_seconds = 0.0;
  double background_seconds = 0.0;
};

// A round whose allreduce finished but whose merge is still to come (overlap_steps > 0).
struct OuterPendingRound {
  uint32_t fragment = 0;
  uint64_t merge_step = 0;  // the inner step after which it merges
  bool finite = true;
  std::vector<float> mean;  // the allreduce's mean outer gradient
  // eager: this rank's eager anchor of the fragment (its own outer step); empty otherwise.
  std::vector<float> eager;
};

// Everything an exact resume needs, per rank. Anchors and momenta are the same on every rank.
struct OuterSyncState {
  uint32_t inner_steps = 0;  // H and the fragment count of the run that saved it (checked at load)
  uint64_t inner_step = 0;
  std::vector<uint32_t> rounds;             // per fragment
  std::vector<std::vector<float>> anchors;  // per fragment: its parameters at the last sync
  std::vector<std::vector<float>> momenta;  // per fragment: the outer optimizer's buffer
  CompressionState compression;             // the allreduce's residuals, keyed by fragment
  // overlap_steps > 0: the round in flight when the state was taken, finished first (state()
  // waits for its allreduce) and merged at its step after a load. Empty otherwise.
  std::vector<OuterPendingRound> pending;
};

// Runs the outer rounds over the parameters it is given (their memory must stay where it is).
// Construction records the start-of-round parameters, which must be the same on every rank (the
// front ends broadcast them first). The outer state (anchors, momentum buffers) is fp32 whatever
// the parameters' dtype, in the memory of the backend that runs the outer step (Backend::outer_*):
// host memory on the CPU; device memory on CUDA under the v2 kernels (the outer gradient, step and
// merge are kernels on the backend's stream); host memory on CUDA under v1, where each sync
// copies the fragment's parameters to the host and back and only the allreduce runs on the device.
// state() and load_state() copy it to and from the host, in the same bytes either way.
//
// A sync: g = anchor - param (fp32, per element) -> the compressed allreduce's mean of g (random
// bits keyed by the fragment's round; residuals kept across rounds) -> buf = mu * buf + g;
// anchor -= lr * (g + mu * buf) (Nesterov) -> param = anchor, rounded to the parameter's dtype.
// When the mean is not finite (a rank diverged), every rank resets the fragment's parameters to
// its anchor, and the anchor, the buffer and the residuals stay as they were (the diverged rank's
// inner optimizer state is the program's to restore).
//
// With overlap_steps = tau > 0 the sync point computes g and starts the allreduce on a thread
// of this object, which also takes the outer step (into copies of the anchor and buffer, so that
// state() can still save the round's start); the merge tau inner steps later (in step()) waits
// for it, swaps the stepped anchor in and sets param = alpha * param + (1 - alpha) * anchor. A
// non-finite mean found at the merge resets the fragment to its anchor on every rank, as above.
// With eager the sync point also sets param = eager (this rank's outer step on its own g) and the
// merge sets param += anchor - eager instead of the mix (docs/algorithms.md). A failed round (a
// transport error, a peer gone, a bad payload) raises at the merge, on every rank, naming the
// fragment and round; the object is then spent until a state is loaded. Nothing else
// may use the communicators while a round is in flight: the agreement runs before it starts.
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
  // Syncs one fragment now, whatever the step count, blocking (no overlap). Refused while a
  // round is in flight.
  void sync_fragment(uint32_t fragment);
  // Waits for the round in flight, if any, and merges it now (before its step): for the end of
  // training. Returns whether there was one.
  bool flush();

  // Runs first on every background round's thread (overlap_steps > 0), before it uses the
  // backend or the communicators: on CUDA a front end makes the backend's device and stream
  // current there (c10d orders its collectives after the current stream). Set it before the
  // first step.
  void set_round_thread_setup(std::function<void()> setup) {
    round_thread_setup_ = std::move(setup);
  }

  const OuterSyncOptions& options() const { return options_; }
  uint32_t fragments() const;
  // The parameter indices of a fragment (a contiguous range of the parameter list).
  std::vector<int64_t> fragment_params(uint32_t fragment) const;
  // Whether a fragment syncs after inner step t (counted from 1).
  bool due(uint32_t fragment, uint64_t t) const;
  // Safe from another thread while a sync runs (a metrics scrape): the counters have a lock of
  // their own, never held across a collective.
  OuterSyncStats stats() const;

  // With a round in flight, waits for its allreduce first (the merge stays at its step).
  OuterSyncState state();
  // Refuses a state of another layout (H, fragment count or sizes, residual sizes) or with
  // non-finite anchors or momenta with an Error, changing nothing. The parameters are left as
  // they are: restore them (the model's checkpoint) as well.
  void load_state(const OuterSyncState& state);

 private:
  struct Fragment;
  struct Staged;
  void init(std::vector<OuterParam> params);
  // The backend running the outer step and holding the outer state: the backend, or (CUDA under
  // v1, Backend::outer_unsupported) a CPU backend over host copies.
  Backend& outer() { return host_ ? *host_ : backend_; }
  // The fragment's tensors where outer() reads them: the parameters themselves, or host copies
  // (read from the device when `read`), written back by unstage().
  Staged stage(const Fragment& f, bool read) const;
  void unstage(const Fragment& f, const Staged& s) const;
  // The mean in the gradient buffer where outer() reads it (`host` holds a staged copy).
  const float* mean_for_outer(const Fragment& f, std::vector<float>& host) const;
  // Stores the anchor into the parameters (kStore), or mixes or eager-corrects them with it.
  void merge_into_params(const Fragment& f, OuterMerge mode);
  // Raises unless every rank is about to sync `fragment` at the same inner step and round.
  void agree(uint32_t fragment, uint64_t inner_step);
  // The outer gradient of a fragment into its gradient buffer, and the allreduce of it.
  void prepare(Fragment& f);
  bool reduce(uint32_t index);
  // The outer step of a fragment from the mean in its gradient buffer into anchor_out and
  // momentum_out (null: dropped), storing the new anchor into the parameters when `store`.
  void outer_step(const Fragment& f, float* anchor_out, float* momentum_out, bool store);
  // The outer step with the mean in the gradient buffer, or the one the round's thread took
  // (stepped), or the reset; and the merge.
  void apply(uint32_t index, bool finite, bool stepped);
  void count_round(const Fragment& f, uint64_t sent_before, bool finite);
  // Overlap (outer_sync_overlap.cpp): start a round on the thread, wait for it, merge it.
  struct InFlight;
  void start_round(uint32_t index);
  // eager: this rank's outer step on its own g (in the gradient buffer), into the parameters.
  void take_eager_step(Fragment& f);
  void finish_round();
  void merge_round();
  // The buffers a round uses (its copies of the outer state, the agreement's), kept from round
  // to round.
  struct RoundBuffers;

  Backend& backend_;
  std::unique_ptr<Backend> host_;  // CUDA under v1: the outer step's CPU backend
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
  std::function<void()> round_thread_setup_;
  std::unique_ptr<InFlight> in_flight_;  // the round on the thread or awaiting its merge
  std::unique_ptr<RoundBuffers> round_buffers_;
  std::string failed_;           // a background round's error: set until a state is loaded
  mutable std::mutex stats_mu_;  // stats_ only
  OuterSyncStats stats_;
};

}  // namespace gradcomp
