// The compressed allreduce of one bucket: q4 two-phase or one-phase, top-k allgather.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/communicator.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {
class BackendBuffer;
class CollectiveQueue;
}  // namespace detail

enum class Q4Algorithm : uint8_t { kTwoPhase = 0, kOnePhase = 1 };

// Deep Gradient Compression's remedies for top-k (Lin et al. 2018; docs/algorithms.md).
// What top-k's warm-up sends before `ratio` is reached.
enum class TopKWarmup : uint8_t {
  // DGC's exponential schedule: for step t < warmup_steps the density is
  // ratio^((s + 1) / (stages + 1)) in stage s = t * warmup_stages / warmup_steps.
  kSparsity = 0,
  // The whole bucket, q4-quantized (two-phase, CompressionConfig::q4, same error feedback), for
  // t < warmup_steps: Adam's moments see every coordinate while they settle (docs/algorithms.md).
  kQ4 = 1,
};

struct TopKRemedies {
  uint32_t warmup_steps = 0;
  uint32_t warmup_stages = 4;  // kSparsity only
  TopKWarmup warmup = TopKWarmup::kSparsity;
  // Momentum correction: the velocity u = momentum * u + g is accumulated and sparsified in
  // place of g; the optimizer must then apply no momentum of its own. 0: off.
  float momentum = 0.0f;
  bool momentum_masking = true;  // clear the sent coordinates from the velocity as well
  // Local clipping: each rank scales a bucket's gradient to a norm of at most
  // clip_norm / sqrt(world size) before accumulating it. 0: off.
  float clip_norm = 0.0f;
  bool any() const { return momentum > 0.0f || clip_norm > 0.0f; }
  void validate() const;
};

struct CompressionConfig {
  Codec codec = Codec::kQ4;
  Q4Options q4;
  Q4Algorithm q4_algorithm = Q4Algorithm::kTwoPhase;
  TopKOptions topk;
  TopKRemedies remedies;  // top-k only
  bool error_feedback = true;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
  // Two-phase q4 (and top-k's q4 warm-up) runs a bucket as pieces of about this many elements:
  // the next piece is encoded while one is on the wire, its mean re-encoded while later ones
  // are. The result is the same for any piece size (blocks and random bits are keyed by the
  // element's place in the bucket); each piece adds one payload header per rank and phase.
  // Non-zero also lets consecutive buckets overlap (CompressedAllreduce::overlaps_buckets).
  // 0: each bucket in one piece, one after another.
  static constexpr int64_t kDefaultPieceNumel = int64_t{1} << 21;
  int64_t piece_numel = kDefaultPieceNumel;
  // The CUDA kernels a CUDA backend made for this configuration launches (types.h).
  KernelGeneration kernels = KernelGeneration::kDefault;
  void validate() const;
};

// Whether a codec sends blocks of scaled codes (q4, q2): the two-phase and one-phase schemes,
// CompressionConfig::q4's block size and rounding, error feedback per element.
inline bool block_codec(Codec codec) {
  return codec == Codec::kQ4 || codec == Codec::kQ2;
}
// The wire codec of a configuration's block payloads: q2 for Codec::kQ2, q4 otherwise (top-k's
// q4 warm-up included).
inline uint8_t block_wire_codec(const CompressionConfig& config) {
  return config.codec == Codec::kQ2 ? format::kCodecQ2 : format::kCodecQ4;
}
// Bytes of one block payload of `numel` elements under `config` (q4_payload_bytes or
// q2_payload_bytes).
uint64_t block_payload_bytes(const CompressionConfig& config, int64_t numel);

// The top-k ratio at `step` under the sparsity warm-up.
double topk_ratio_at(const CompressionConfig& config, uint32_t step);
// Whether a top-k configuration sends q4 at `step` (its q4 warm-up).
bool topk_sends_q4_at(const CompressionConfig& config, uint32_t step);

// Bytes one rank sends for one allreduce of a bucket of `numel` elements at world size W.
uint64_t compressed_allreduce_bytes_sent(const CompressionConfig& config, int64_t numel, int world,
                                         uint32_t step = ~0u);

// Two-phase q4: the elements of one rank's chunk in one piece, and the pieces of a chunk.
int64_t q4_piece_size(const CompressionConfig& config, int64_t numel, int world);
int q4_pieces(const CompressionConfig& config, int64_t numel, int world);

// A hierarchical reduction's two groups (docs/algorithms.md). Ranks are node-major: global rank
// = node * L + local rank, with L = intra_node->world_size(); intra_node holds the node's L ranks
// in local-rank order, inter_node this local rank on every node in node order.
struct NodeGroups {
  Communicator* intra_node = nullptr;
  Communicator* inter_node = nullptr;
};

// The elements of a bucket one local rank compresses across nodes: ceil(numel / L) (the last
// local ranks' shards are padded with zeros).
int64_t node_shard_numel(int64_t numel, int local_world);
// Bytes one rank sends in one hierarchical allreduce: across nodes, the compressed allreduce of
// its shard among `nodes` ranks; inside the node, the reduce-scatter and allgather of the shards
// in the bucket dtype and, on host memory, the node's agreement that every local rank accepted
// its payloads (kNodeAgreementBytes from each rank).
uint64_t inter_node_bytes_sent(const CompressionConfig& config, int64_t numel, int nodes,
                               int local_world, uint32_t step = ~0u);
constexpr uint64_t kNodeAgreementBytes = 4;
uint64_t intra_node_bytes_sent(int64_t numel, DType dtype, int local_world,
                               bool device_memory = false);

// Bytes of a bucket's residuals (phase 1 / whole bucket, and the own-chunk residual of two-phase
// q4; 0 when the configuration keeps none), for checking checkpoints.
uint64_t residual_bytes(const CompressionConfig& config, int64_t numel);
uint64_t chunk_residual_bytes(const CompressionConfig& config, int64_t numel, int world);
uint64_t velocity_bytes(const CompressionConfig& config, int64_t numel);

// Per-rank state that must survive a checkpoint for an exact resume.
struct CompressionState {
  uint64_t seed = 0;
  uint32_t step = 0;
  // Residual bytes per bucket identity: phase-1 (whole bucket) and phase-2 (own chunk).
  std::map<uint64_t, std::vector<uint8_t>> residuals;
  std::map<uint64_t, std::vector<uint8_t>> chunk_residuals;
  // Top-k momentum correction: the fp32 velocity per bucket.
  std::map<uint64_t, std::vector<uint8_t>> velocities;
};

// Averages a bucket over all ranks through a compressed collective, in place. Keeps each
// bucket's error-feedback residuals keyed by a caller-chosen stable bucket identity.
class CompressedAllreduce {
 public:
  // Flat: every rank compresses its whole bucket and exchanges it with every other rank.
  CompressedAllreduce(Communicator& comm, Backend& backend, const CompressionConfig& config);
  // Hierarchical: a mean reduce-scatter inside the node, the compressed allreduce of this rank's
  // shard across nodes (residuals and random bits keyed by the global rank, so each shard has
  // its own), an allgather inside the node. With one rank per node it is the flat scheme.
  CompressedAllreduce(NodeGroups groups, Backend& backend, const CompressionConfig& config);
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

  // The same reduction in two halves, so consecutive buckets overlap (overlaps_buckets(): host
  // memory, the flat scheme, piece_numel != 0): begin_allreduce encodes the bucket and posts its
  // collectives, returning before the last of them finish, and the next bucket's encode runs
  // while they are on the wire; finish_allreduce waits for the oldest begun bucket, decodes it
  // and returns what allreduce returns. At most two buckets are begun and unfinished (one
  // without overlap). Every rank begins the same buckets in the same order; when each finishes
  // them is its own. A bucket whose begin throws is not begun. The result is the same bytes as
  // allreduce's.
  bool overlaps_buckets() const;
  void begin_allreduce(const Segment* segments, int num_segments, DType dtype, uint64_t bucket_id);
  bool finish_allreduce();
  int in_flight() const;

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
  // Takes back a bucket's last completed reduction: its residuals return to what they were
  // before it (for a caller whose step failed after this bucket had completed). Only right once
  // per completed reduction.
  void revert_bucket(uint64_t bucket_id);
  // The element count of a bucket this allreduce has reduced, or -1.
  int64_t bucket_numel(uint64_t bucket_id) const;
  // Ranks per node (1: flat) and this rank's place among all ranks.
  int local_world_size() const { return node_ != nullptr ? node_->world_size() : 1; }
  int global_rank() const { return global_rank_; }
  // Runs posted collectives off the calling thread in `carry`'s context (the profiler's), so
  // pieces overlap; set before the first reduction.
  void set_context_carrier(std::function<std::function<void()>(std::function<void()>)> carry);
  // Seconds the calling thread has spent in collectives or waiting for them, over all reductions
  // (what is not codec work).
  double blocked_seconds() const;
  // Bytes of the residuals and velocities held now (both buffers of each); any thread may ask.
  uint64_t residual_memory() const { return residual_memory_.load(std::memory_order_relaxed); }

 private:
  struct Bucket;
  Bucket& bucket_for(const Segment* segments, int num_segments, DType dtype, uint64_t bucket_id);
  void check_layout(const Bucket& b, uint64_t bucket_id);
  struct InFlight;
  // Runs the bucket's encodes and posts its collectives (flat), or reduces it whole up to
  // end_bucket (hierarchical); the decode and end_bucket are finish_front()'s.
  void finish_front();
  void reduce_hierarchical(Bucket& b, const Segment* segments, int num_segments, DType dtype);
  // The compressed exchange of a bucket, or of this rank's shard of it, over comm_: post_* encodes
  // and posts the collectives, finish_* waits for them and decodes the mean into f.segments.
  void post_compressed(Bucket& b, InFlight& f, const Segment* segments, int num_segments);
  void finish_compressed(Bucket& b, InFlight& f);
  // Keeps or adopts the bucket's candidate residuals as the result's non-finite flag says.
  void end_bucket(Bucket& b);
  // Encodes `source` (the bucket itself, or top-k's accumulated gradient).
  void post_q4_two_phase(Bucket& b, InFlight& f, const Segment* source, int num_source,
                         uint8_t source_dtype,
                         const std::function<void(int)>& before_piece = nullptr);
  void finish_q4_two_phase(Bucket& b, InFlight& f);
  // finish_q4_two_phase's halves: every payload checked (throws, writing nothing), then the
  // pieces decoded one after another.
  void check_q4_two_phase(Bucket& b, InFlight& f);
  void decode_q4_two_phase(Bucket& b, InFlight& f, const std::function<void(int)>& after_piece);
  // Hierarchical: whether the intra-node stages run piece by piece beside the inter-node ones
  // (host memory, two-phase q4 in pieces); the node's queue for them; and the node's agreement,
  // before its allgather, on whether any local rank rejected a payload (rethrows `rejected`).
  bool pipelines_node_stages(const Bucket& b) const;
  detail::CollectiveQueue& node_collectives_for(const Bucket& b);
  void node_blocking(const std::function<void()>& collective);
  void agree_in_node(const Bucket& b, std::exception_ptr rejected);
  // An error of the exchange between nodes, told which global ranks its ranks are.
  std::exception_ptr between_nodes(std::exception_ptr error) const;
  void post_q4_one_phase(Bucket& b, InFlight& f, const Segment* segments, int num_segments);
  void finish_q4_one_phase(Bucket& b, InFlight& f);
  void post_topk(Bucket& b, InFlight& f, const Segment* segments, int num_segments);
  void finish_topk(Bucket& b, InFlight& f);
  void wait_tickets(const InFlight& f);
  // Posts the allgather of the bucket's `bytes` send payload into its gathered slots.
  uint64_t post_all_gather(const Bucket& b, uint64_t bytes);
  // Points a q4 encode at the bucket's committed residual (in) and candidate (out), `offset`
  // elements in; nothing without error feedback.
  void set_residuals(Q4EncodeParams& e, detail::BackendBuffer* residual, const Bucket& b,
                     int64_t offset) const;
  math::RngKey rng(const Bucket& b, uint32_t phase) const;
  // The queue the bucket's collectives go through: threaded for pieces on host memory.
  detail::CollectiveQueue& collectives_for(const Bucket& b);
  // Runs one collective and waits for it, counted as blocked time.
  void blocking(const std::function<void()>& collective);
  // Waits for every posted collective and forgets their errors (their buffers are free).
  void drain_collectives() noexcept;
  // Recounts residual_memory() after buckets change.
  void count_residual_memory();

  Communicator& comm_;            // all ranks (flat) or the inter-node group
  Communicator* node_ = nullptr;  // the intra-node group of a hierarchical reduction
  int global_rank_ = 0;
  Backend& backend_;
  CompressionConfig config_;
  uint32_t step_ = 0;
  std::map<uint64_t, std::unique_ptr<Bucket>> buckets_;
  CompressionState pending_;  // loaded state for buckets not yet seen
  std::function<std::function<void()>(std::function<void()>)> carry_;
  std::unique_ptr<detail::CollectiveQueue> collectives_;
  std::unique_ptr<detail::CollectiveQueue> node_collectives_;  // hierarchical: the node's
  // Begun buckets, oldest first (a list: InFlight is incomplete here).
  std::list<InFlight> in_flight_;
  std::atomic<uint64_t> residual_memory_{0};
};

}  // namespace gradcomp
