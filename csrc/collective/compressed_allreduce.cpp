// The compressed allreduce of one bucket: q4 two-phase and one-phase, top-k allgather, the
// buckets' residuals and their checkpoint.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <vector>

#include "backend_buffer.h"
#include "codec_params.h"
#include "collective_queue.h"
#include "gradcomp/collectives.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace {

using Buffer = detail::BackendBuffer;
using detail::q4_decode_params;
using detail::q4_encode_params;

int64_t div_up(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Chunk c of a two-phase q4 bucket covers [c * size, min(numel, (c + 1) * size)).
int64_t q4_chunk_size(int64_t numel, int world, int block) {
  return std::max<int64_t>(block, div_up(div_up(numel, world), block) * block);
}
int64_t chunk_numel(int64_t numel, int64_t chunk, int c) {
  return std::max<int64_t>(0, std::min(numel, (c + 1) * chunk) - c * chunk);
}

// What every rank must agree on before a bucket's first compressed exchange.
struct LayoutFingerprint {
  uint64_t bucket_id;
  int64_t numel;
  uint32_t world;
  uint8_t codec;
  uint8_t dtype;
  uint8_t algorithm;
  uint8_t residual_dtype;
  uint32_t param;  // q4 block size, top-k capacity
  uint8_t error_feedback;
  uint8_t momentum_masking;
  uint16_t unused;
  uint32_t warmup_steps, warmup_stages;  // top-k remedies
  uint32_t momentum_bits, clip_bits;
  uint32_t piece;                      // two-phase q4: elements of a chunk per piece (low 32 bits)
  uint32_t warmup_kind, warmup_block;  // top-k's warm-up and its q4 block size
  uint32_t local_world;                // ranks per node (1: flat)
  bool operator==(const LayoutFingerprint& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
static_assert(sizeof(LayoutFingerprint) == 64, "fingerprint is exchanged as 64 bytes");

// Pointers to the slots of a buffer holding one payload per rank.
std::vector<const uint8_t*> slots(const Buffer& buffer, uint64_t slot_bytes, int world) {
  std::vector<const uint8_t*> from(world);
  for (int w = 0; w < world; ++w) from[w] = buffer.get() + slot_bytes * w;
  return from;
}

Communicator& inter_node_of(const NodeGroups& groups) {
  GRADCOMP_CHECK(groups.inter_node != nullptr && groups.intra_node != nullptr,
                 "a hierarchical allreduce needs both node groups");
  return *groups.inter_node;
}

int64_t topk_capacity_at(const CompressionConfig& config, int64_t numel, uint32_t step) {
  TopKOptions at = config.topk;
  at.ratio = topk_ratio_at(config, step);
  return topk_capacity(numel, at);
}

}  // namespace

void TopKRemedies::validate() const {
  GRADCOMP_CHECK(warmup == TopKWarmup::kSparsity || warmup == TopKWarmup::kQ4,
                 "TopK warmup must be sparsity or q4, got " << int(warmup));
  GRADCOMP_CHECK(warmup_stages >= 1 && warmup_stages <= 64,
                 "TopK warmup_stages must be in [1, 64], got " << warmup_stages);
  GRADCOMP_CHECK(momentum >= 0.0f && momentum < 1.0f,
                 "TopK momentum must be in [0, 1), got " << momentum);
  GRADCOMP_CHECK(clip_norm >= 0.0f && std::isfinite(clip_norm),
                 "TopK clip_norm must be finite and >= 0 (0: off), got " << clip_norm);
}

void CompressionConfig::validate() const {
  GRADCOMP_CHECK(codec == Codec::kQ4 || codec == Codec::kTopK, "unknown codec " << int(codec));
  q4.validate();
  topk.validate();
  remedies.validate();
  GRADCOMP_CHECK(residual_dtype == DType::kFloat32 || residual_dtype == DType::kBFloat16,
                 "residual dtype must be float32 or bfloat16, got " << dtype_name(residual_dtype));
  GRADCOMP_CHECK(
      piece_numel >= 0 && piece_numel <= (int64_t{1} << 31),
      "piece_numel must be in [0, 2^31] (0: a bucket in one piece), got " << piece_numel);
  GRADCOMP_CHECK(remedies.momentum == 0.0f || error_feedback,
                 "TopK momentum correction needs error_feedback: the velocity's unsent part is "
                 "what error feedback accumulates");
}

bool topk_sends_q4_at(const CompressionConfig& config, uint32_t step) {
  return config.codec == Codec::kTopK && config.remedies.warmup == TopKWarmup::kQ4 &&
         step < config.remedies.warmup_steps;
}

double topk_ratio_at(const CompressionConfig& config, uint32_t step) {
  const TopKRemedies& r = config.remedies;
  if (step >= r.warmup_steps || r.warmup != TopKWarmup::kSparsity) return config.topk.ratio;
  const uint64_t stage = static_cast<uint64_t>(step) * r.warmup_stages / r.warmup_steps;
  return std::pow(config.topk.ratio,
                  static_cast<double>(stage + 1) / static_cast<double>(r.warmup_stages + 1));
}

uint64_t compressed_allreduce_bytes_sent(const CompressionConfig& config, int64_t numel, int world,
                                         uint32_t step) {
  const uint64_t others = static_cast<uint64_t>(world - 1);
  if (config.codec == Codec::kTopK && !topk_sends_q4_at(config, step)) {
    return others *
           topk_payload_bytes(topk_capacity_at(config, numel, step), config.topk.value_dtype);
  }
  if (config.codec == Codec::kQ4 && config.q4_algorithm == Q4Algorithm::kOnePhase) {
    return others * q4_payload_bytes(numel, config.q4.block_size);
  }
  // Each piece is one all-to-all and one allgather of a payload per rank.
  return 2 * others * static_cast<uint64_t>(q4_pieces(config, numel, world)) *
         q4_payload_bytes(q4_piece_size(config, numel, world), config.q4.block_size);
}

int64_t q4_piece_size(const CompressionConfig& config, int64_t numel, int world) {
  const int block = config.q4.block_size;
  const int64_t chunk = q4_chunk_size(numel, world, block);
  if (config.piece_numel <= 0) return chunk;
  // Equal pieces of whole blocks: every piece's slot is sent whole, so a short last piece
  // would send padding.
  const int64_t target = div_up(div_up(config.piece_numel, world), block) * block;
  const int64_t pieces = div_up(chunk, target);
  return div_up(div_up(chunk, pieces), block) * block;
}

int q4_pieces(const CompressionConfig& config, int64_t numel, int world) {
  return static_cast<int>(div_up(q4_chunk_size(numel, world, config.q4.block_size),
                                 q4_piece_size(config, numel, world)));
}

int64_t node_shard_numel(int64_t numel, int local_world) {
  return div_up(numel, local_world);
}

uint64_t inter_node_bytes_sent(const CompressionConfig& config, int64_t numel, int nodes,
                               int local_world, uint32_t step) {
  return compressed_allreduce_bytes_sent(config, node_shard_numel(numel, local_world), nodes, step);
}

uint64_t intra_node_bytes_sent(int64_t numel, DType dtype, int local_world, bool device_memory) {
  const uint64_t agreement =
      device_memory ? 0 : kNodeAgreementBytes * static_cast<uint64_t>(local_world - 1);
  return 2 * reduce_scatter_bytes(node_shard_numel(numel, local_world), dtype, local_world) +
         agreement;
}

uint64_t residual_bytes(const CompressionConfig& config, int64_t numel) {
  return config.error_feedback ? static_cast<uint64_t>(numel) * dtype_size(config.residual_dtype)
                               : 0;
}

uint64_t velocity_bytes(const CompressionConfig& config, int64_t numel) {
  return config.codec == Codec::kTopK && config.remedies.momentum > 0.0f
             ? static_cast<uint64_t>(numel) * 4
             : 0;
}

uint64_t chunk_residual_bytes(const CompressionConfig& config, int64_t numel, int world) {
  const bool two_phase = config.codec == Codec::kQ4 ? config.q4_algorithm == Q4Algorithm::kTwoPhase
                                                    : topk_sends_q4_at(config, 0);
  if (!config.error_feedback || !two_phase) return 0;
  return static_cast<uint64_t>(q4_chunk_size(numel, world, config.q4.block_size)) *
         dtype_size(config.residual_dtype);
}

// ---- the engine -----------------------------------------------------------------------------

struct CompressedAllreduce::Bucket {
  uint64_t id = 0;
  int64_t numel = 0;       // what is compressed: the bucket, or this rank's shard of it
  int64_t full_numel = 0;  // the bucket
  DType dtype = DType::kFloat32;
  bool layout_checked = false;
  int current = 0;                          // which residual buffer holds the committed residual
  detail::BackendBuffer residual[2];        // whole bucket (q4 phase 1 / one-phase, top-k)
  detail::BackendBuffer chunk_residual[2];  // own chunk (q4 phase 2)
  detail::BackendBuffer velocity[2];        // top-k momentum correction, fp32
  detail::BackendBuffer staged;             // top-k clipping without momentum: the clipped g
  detail::BackendBuffer send, recv, work, gathered, workspace;
  uint64_t slot_bytes = 0;     // one-phase q4 and top-k payloads
  uint64_t q4_slot_bytes = 0;  // two-phase q4: the payload of one piece of a chunk
  int64_t chunk = 0;
  int64_t piece = 0;  // two-phase q4: elements of a chunk per piece, and the pieces of a chunk
  int pieces = 1;
  // Two-phase q4: piece p of rank c's chunk is elements [c * chunk + p * piece, ...) of the
  // bucket, and its payload from rank w sits in slot p * world + w of `send` or `gathered`.
  int64_t piece_begin(int c, int p) const { return c * chunk + p * piece; }
  int64_t piece_numel(int c, int p) const {
    return std::max<int64_t>(0, std::min(piece, chunk_numel(numel, chunk, c) - p * piece));
  }
  uint8_t* q4_slot(const detail::BackendBuffer& buffer, int p, int w, int world) const {
    return buffer.get() + q4_slot_bytes * (static_cast<uint64_t>(p) * world + w);
  }
  // Hierarchical: this rank's shard and, for buckets not exchanged in place, the bucket gathered
  // from its segments (zero-padded to L shards) and every local rank's reduced shard.
  detail::BackendBuffer node_send, node_shard, node_gathered;
};

CompressedAllreduce::CompressedAllreduce(Communicator& comm, Backend& backend,
                                         const CompressionConfig& config)
    : comm_(comm), backend_(backend), config_(config) {
  config_.validate();
  GRADCOMP_CHECK(comm.device_memory() == backend.is_cuda(),
                 "communicator and backend disagree on host versus device memory");
  pending_.seed = config_.seed;
  global_rank_ = comm.rank();
}

CompressedAllreduce::CompressedAllreduce(NodeGroups groups, Backend& backend,
                                         const CompressionConfig& config)
    : CompressedAllreduce(inter_node_of(groups), backend, config) {
  GRADCOMP_CHECK(groups.intra_node->device_memory() == backend.is_cuda(),
                 "intra-node communicator and backend disagree on host versus device memory");
  const int local = groups.intra_node->world_size();
  if (local > 1) node_ = groups.intra_node;
  global_rank_ = comm_.rank() * local + groups.intra_node->rank();
}

CompressedAllreduce::~CompressedAllreduce() = default;

math::RngKey CompressedAllreduce::rng(const Bucket& b, uint32_t phase) const {
  math::RngKey key;
  key.seed = config_.seed;
  key.step = step_;
  key.bucket = static_cast<uint32_t>(b.id);
  key.rank = static_cast<uint32_t>(global_rank_);
  key.phase = phase;
  return key;
}

CompressedAllreduce::Bucket& CompressedAllreduce::bucket_for(const Segment* segments,
                                                             int num_segments, DType dtype,
                                                             uint64_t bucket_id) {
  int64_t full = 0;
  for (int i = 0; i < num_segments; ++i) full += segments[i].numel;
  auto it = buckets_.find(bucket_id);
  if (it != buckets_.end()) {
    Bucket& b = *it->second;
    GRADCOMP_CHECK(b.full_numel == full && b.dtype == dtype,
                   "bucket " << bucket_id << " on rank " << global_rank_ << " changed from "
                             << b.full_numel << " " << dtype_name(b.dtype) << " elements to "
                             << full << " " << dtype_name(dtype)
                             << "; use a new bucket identity for a new layout");
    return b;
  }
  const int local = local_world_size();
  const int64_t numel = node_ != nullptr ? node_shard_numel(full, local) : full;
  if (config_.codec == Codec::kTopK) {
    GRADCOMP_CHECK(numel <= kTopKMaxNumel, "bucket " << bucket_id << " on rank " << global_rank_
                                                     << " has " << numel
                                                     << " elements; top-k allows at most 2^31 - 1");
  }
  auto b = std::make_unique<Bucket>();
  b->id = bucket_id;
  b->numel = numel;
  b->full_numel = full;
  b->dtype = dtype;
  if (node_ != nullptr) {
    const size_t shard_bytes = static_cast<size_t>(numel) * dtype_size(dtype);
    b->node_shard = Buffer(backend_, shard_bytes);
  }
  const int world = comm_.world_size();
  const size_t rbytes = static_cast<size_t>(numel) * dtype_size(config_.residual_dtype);
  if (config_.error_feedback) {
    for (auto& r : b->residual) r = Buffer(backend_, rbytes);
  }
  uint64_t send_bytes = 0, gathered_slot = 0;
  // A top-k bucket first seen during its q4 warm-up needs the two-phase buffers too, until the
  // warm-up ends.
  const bool two_phase = config_.codec == Codec::kQ4
                             ? config_.q4_algorithm == Q4Algorithm::kTwoPhase
                             : topk_sends_q4_at(config_, step_);
  if (two_phase) {
    b->chunk = q4_chunk_size(numel, world, config_.q4.block_size);
    // On a device everything runs in stream order, so pieces would only add launches and calls.
    b->piece = backend_.is_cuda() ? b->chunk : q4_piece_size(config_, numel, world);
    b->pieces = backend_.is_cuda() ? 1 : q4_pieces(config_, numel, world);
    b->q4_slot_bytes = q4_payload_bytes(b->piece, config_.q4.block_size);
    // Piece p's payloads to (or from) every rank lie at slots [p * world, (p + 1) * world).
    send_bytes = gathered_slot = b->q4_slot_bytes * b->pieces;
    send_bytes *= world;
    b->recv = Buffer(backend_, send_bytes);
    b->work = Buffer(backend_, static_cast<size_t>(b->chunk) * 4);
    if (config_.error_feedback) {
      for (auto& r : b->chunk_residual) {
        r = Buffer(backend_, static_cast<size_t>(b->chunk) * dtype_size(config_.residual_dtype));
      }
    }
  }
  if (config_.codec == Codec::kQ4 && !two_phase) {
    b->slot_bytes = q4_payload_bytes(numel, config_.q4.block_size);
    send_bytes = gathered_slot = b->slot_bytes;
  } else if (config_.codec == Codec::kTopK) {
    // The largest payload of the schedule: the warm-up's first stage, or the final ratio.
    b->slot_bytes = topk_payload_bytes(
        std::max(topk_capacity_at(config_, numel, 0), topk_capacity_at(config_, numel, ~0u)),
        config_.topk.value_dtype);
    send_bytes = std::max(send_bytes, b->slot_bytes);
    gathered_slot = std::max(gathered_slot, b->slot_bytes);
    const size_t ws = backend_.topk_workspace_bytes(numel);
    if (ws > 0) b->workspace = Buffer(backend_, ws);
    const uint64_t vbytes = velocity_bytes(config_, numel);
    if (vbytes > 0) {
      for (auto& v : b->velocity) {
        v = Buffer(backend_, vbytes);
        backend_.fill_zero(v.get(), vbytes);
      }
    } else if (config_.remedies.clip_norm > 0.0f) {
      b->staged = Buffer(backend_, static_cast<size_t>(numel) * 4);
    }
  }
  b->send = Buffer(backend_, send_bytes);
  b->gathered = Buffer(backend_, gathered_slot * world);
  // A checkpoint saved at the last step of a q4 warm-up holds own-chunk residuals no step uses.
  if (config_.codec == Codec::kTopK && !two_phase) pending_.chunk_residuals.erase(bucket_id);
  // Residuals restored from a checkpoint before this bucket was first seen.
  auto restore = [&](std::map<uint64_t, std::vector<uint8_t>>& from, Buffer* to, const char* what) {
    auto r = from.find(bucket_id);
    if (r == from.end()) return;
    GRADCOMP_CHECK(to[0].get() != nullptr && r->second.size() == to[0].bytes(),
                   "checkpoint " << what << " for bucket " << bucket_id << " on rank "
                                 << global_rank_ << " has " << r->second.size()
                                 << " bytes, the bucket needs " << to[0].bytes());
    backend_.copy_from_host(to[0].get(), r->second.data(), r->second.size());
    from.erase(r);
  };
  restore(pending_.residuals, b->residual, "residual");
  restore(pending_.chunk_residuals, b->chunk_residual, "chunk residual");
  restore(pending_.velocities, b->velocity, "velocity");
  Bucket& ref = *b;
  buckets_[bucket_id] = std::move(b);
  return ref;
}

void CompressedAllreduce::check_layout(const Bucket& b, uint64_t bucket_id) {
  LayoutFingerprint mine;
  std::memset(&mine, 0, sizeof mine);
  mine.bucket_id = bucket_id;
  mine.numel = b.full_numel;
  mine.world = static_cast<uint32_t>(comm_.world_size());
  mine.local_world = static_cast<uint32_t>(local_world_size());
  mine.codec = static_cast<uint8_t>(config_.codec);
  mine.dtype = static_cast<uint8_t>(b.dtype);
  mine.algorithm = static_cast<uint8_t>(config_.q4_algorithm);
  mine.residual_dtype = static_cast<uint8_t>(config_.residual_dtype);
  mine.param = config_.codec == Codec::kQ4
                   ? static_cast<uint32_t>(config_.q4.block_size)
                   : static_cast<uint32_t>(topk_capacity(b.full_numel, config_.topk));
  mine.error_feedback = config_.error_feedback ? 1 : 0;
  mine.piece = static_cast<uint32_t>(b.piece);
  if (config_.codec == Codec::kTopK) {
    const TopKRemedies& r = config_.remedies;
    mine.warmup_steps = r.warmup_steps;
    mine.warmup_stages = r.warmup_stages;
    std::memcpy(&mine.momentum_bits, &r.momentum, 4);
    std::memcpy(&mine.clip_bits, &r.clip_norm, 4);
    mine.momentum_masking = r.momentum_masking ? 1 : 0;
    mine.warmup_kind = static_cast<uint32_t>(r.warmup);
    if (r.warmup == TopKWarmup::kQ4)
      mine.warmup_block = static_cast<uint32_t>(config_.q4.block_size);
  }
  // Inside the node, across nodes, and inside the node again: every rank compares with every
  // other and learns any mismatch, so all of them raise together instead of some waiting in the
  // next collective. Ranks are named by their global rank.
  struct Report {
    LayoutFingerprint mine, first, other;
    int32_t first_rank = -1, other_rank = -1;  // other_rank < 0: no mismatch found yet
  };
  Report report{};
  report.mine = mine;
  const int local = local_world_size();
  const int node = comm_.rank(), local_rank = global_rank_ - node * local;
  auto exchange = [&](Communicator& group, auto global_of) {
    const int world = group.world_size();
    std::vector<Report> all(world);
    Buffer send(backend_, sizeof report), recv(backend_, sizeof report * world);
    backend_.copy_from_host(send.get(), &report, sizeof report);
    blocking([&] { group.all_gather(send.get(), recv.get(), sizeof report); });
    backend_.copy_to_host(all.data(), recv.get(), sizeof report * world);
    for (int w = 0; w < world && report.other_rank < 0; ++w) {
      if (all[w].other_rank < 0) continue;
      report = all[w];
      report.mine = mine;
    }
    for (int w = 0; w < world && report.other_rank < 0; ++w) {
      if (all[w].mine == all[0].mine) continue;
      report.first = all[0].mine;
      report.other = all[w].mine;
      report.first_rank = global_of(0);
      report.other_rank = global_of(w);
    }
  };
  auto in_node = [&](int w) { return node * local + w; };
  if (node_ != nullptr) exchange(*node_, in_node);
  exchange(comm_, [&](int w) { return w * local + local_rank; });
  if (node_ != nullptr) exchange(*node_, in_node);
  if (report.other_rank < 0) return;
  auto describe = [](int rank, const LayoutFingerprint& f) {
    std::ostringstream o;
    o << "rank " << rank << " has bucket " << f.bucket_id << " with " << f.numel
      << " elements (dtype " << int(f.dtype) << ", codec " << int(f.codec) << ", param " << f.param
      << ", " << f.local_world << " ranks per node";
    if (f.piece != 0) o << ", pieces of " << f.piece << " elements";
    o << ")";
    return o.str();
  };
  GRADCOMP_CHECK(false, "layout mismatch at the first compressed step: "
                            << describe(report.first_rank, report.first) << ", "
                            << describe(report.other_rank, report.other)
                            << "; every rank must build identical buckets");
}

struct CompressedAllreduce::InFlight {
  uint64_t bucket_id = 0;
  Bucket* bucket = nullptr;
  std::vector<Segment> segments;  // where the mean goes
  DType dtype = DType::kFloat32;
  // What is left after the collectives: nothing (a hierarchical bucket), or a decode.
  enum class Rest { kEndBucket, kQ4TwoPhase, kQ4OnePhase, kTopK } rest = Rest::kEndBucket;
  std::vector<uint64_t> tickets;  // the collectives whose results the decode reads
  TopKDecodeParams topk;          // top-k's decode, less the payload pointers
};

bool CompressedAllreduce::overlaps_buckets() const {
  return node_ == nullptr && !backend_.is_cuda() && config_.piece_numel != 0;
}

int CompressedAllreduce::in_flight() const {
  return static_cast<int>(in_flight_.size());
}

bool CompressedAllreduce::allreduce(const Segment* segments, int num_segments, DType dtype,
                                    uint64_t bucket_id) {
  GRADCOMP_CHECK(in_flight_.empty(), "allreduce of bucket "
                                         << bucket_id << " while " << in_flight_.size()
                                         << " begun buckets are unfinished on rank "
                                         << global_rank_);
  backend_.take_nonfinite_buckets();
  begin_allreduce(segments, num_segments, dtype, bucket_id);
  finish_front();
  return backend_.take_nonfinite_buckets() == 0;
}

bool CompressedAllreduce::finish_allreduce() {
  GRADCOMP_CHECK(!in_flight_.empty(),
                 "finish_allreduce with no begun bucket on rank " << global_rank_);
  backend_.take_nonfinite_buckets();
  finish_front();
  return backend_.take_nonfinite_buckets() == 0;
}

void CompressedAllreduce::enqueue_allreduce(const Segment* segments, int num_segments, DType dtype,
                                            uint64_t bucket_id) {
  GRADCOMP_CHECK(in_flight_.empty(), "enqueue_allreduce of bucket "
                                         << bucket_id << " while begun buckets are unfinished");
  begin_allreduce(segments, num_segments, dtype, bucket_id);
  finish_front();
}

void CompressedAllreduce::begin_allreduce(const Segment* segments, int num_segments, DType dtype,
                                          uint64_t bucket_id) {
  const bool overlapping = !in_flight_.empty();
  GRADCOMP_CHECK(in_flight_.size() < 2 && (!overlapping || overlaps_buckets()),
                 "bucket " << bucket_id << " begun on rank " << global_rank_ << " while "
                           << in_flight_.size() << " begun buckets are unfinished"
                           << (overlaps_buckets() ? " (at most one may be)"
                                                  : " (this reduction does not overlap buckets)"));
  // Its buffers are on the wire; bucket_for could even replace it.
  for (const InFlight& earlier : in_flight_)
    GRADCOMP_CHECK(earlier.bucket_id != bucket_id,
                   "bucket " << bucket_id << " begun again on rank " << global_rank_
                             << " before its earlier reduction finished");
  Bucket& b = bucket_for(segments, num_segments, dtype, bucket_id);
  InFlight f;
  f.bucket_id = bucket_id;
  f.bucket = &b;
  f.segments.assign(segments, segments + num_segments);
  f.dtype = dtype;
  try {
    if (!b.layout_checked) {
      check_layout(b, bucket_id);
      b.layout_checked = true;
    }
    if (node_ == nullptr) {
      post_compressed(b, f, f.segments.data(), num_segments);
    } else {
      reduce_hierarchical(b, f.segments.data(), num_segments, dtype);
    }
  } catch (...) {
    // The collectives posted so far finish before their buffers are used again; while an earlier
    // bucket is in flight, its finish must still see their errors, so the queue waits for it.
    if (!backend_.is_cuda()) backend_.take_decode_status();
    if (in_flight_.empty()) drain_collectives();
    throw;
  }
  // A non-finite sum flags the intermediate decodes of two-phase q4 and re-encodes to NaN steps,
  // so the final decode flags it again: the flag an earlier bucket's end_bucket reads must not
  // carry this bucket's.
  if (overlapping) backend_.take_decode_status();
  in_flight_.push_back(std::move(f));
}

void CompressedAllreduce::finish_front() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  // A failed begin of a later bucket may have left collectives running on its buffers.
  struct DrainWhenIdle {
    CompressedAllreduce& self;
    ~DrainWhenIdle() {
      if (self.in_flight_.empty()) self.drain_collectives();
    }
  } drain{*this};
  try {
    finish_compressed(*f.bucket, f);
  } catch (...) {
    // As a failed begin does: the decodes that ran must not flag the next bucket.
    if (!backend_.is_cuda()) backend_.take_decode_status();
    throw;
  }
  end_bucket(*f.bucket);
}

void CompressedAllreduce::drain_collectives() noexcept {
  if (collectives_) collectives_->drain();
  if (node_collectives_) node_collectives_->drain();
}

void CompressedAllreduce::reduce_hierarchical(Bucket& b, const Segment* segments, int num_segments,
                                              DType dtype) {
  const size_t esize = dtype_size(dtype);
  const size_t shard_bytes = static_cast<size_t>(b.numel) * esize;
  // One segment of L whole shards (the usual DDP bucket) is exchanged in place; otherwise the
  // segments are gathered into a zero-padded buffer first and scattered back at the end.
  const int local = local_world_size();
  const bool in_place =
      num_segments == 1 && segments[0].offset == 0 && b.numel * local == b.full_numel;
  if (!in_place) {
    if (b.node_send.get() == nullptr) {
      b.node_send = Buffer(backend_, shard_bytes * local);
      backend_.fill_zero(b.node_send.get(), shard_bytes * local);  // the padding stays zero
      b.node_gathered = Buffer(backend_, shard_bytes * local);
    }
    for (int i = 0; i < num_segments; ++i) {
      backend_.copy(b.node_send.get() + static_cast<size_t>(segments[i].offset) * esize,
                    segments[i].data, static_cast<size_t>(segments[i].numel) * esize);
    }
  }
  const uint8_t* bucket_in =
      in_place ? static_cast<const uint8_t*>(segments[0].data) : b.node_send.get();
  uint8_t* bucket_out = in_place ? static_cast<uint8_t*>(segments[0].data) : b.node_gathered.get();
  InFlight shard;
  shard.bucket = &b;
  shard.segments = {Segment{b.node_shard.get(), 0, b.numel}};
  shard.dtype = dtype;
  detail::CollectiveQueue& node_queue = node_collectives_for(b);
  try {
    if (pipelines_node_stages(b)) {
      // Piece p of every inter-node chunk is reduced inside the node (a strided reduce-scatter of
      // that piece of every local rank's shard) while earlier pieces are encoded and on the
      // wire, and gathered back inside the node while later pieces are decoded.
      const int nodes = comm_.world_size();
      // Piece p of chunk c: its byte offset in a shard, and its elements.
      auto piece_at = [&](int c, int p) {
        return static_cast<size_t>(b.piece_begin(c, p)) * esize;
      };
      auto piece_n = [&](int c, int p) { return static_cast<size_t>(b.piece_numel(c, p)); };
      std::vector<uint64_t> reduced(b.pieces);
      for (int p = 0; p < b.pieces; ++p) {
        for (int c = 0; c < nodes; ++c) {
          const size_t at = piece_at(c, p), n = piece_n(c, p);
          if (n == 0) continue;
          uint8_t* out = b.node_shard.get() + at;
          const uint8_t* in = bucket_in + at;
          const int64_t stride = b.numel;
          reduced[p] = node_queue.post([this, in, out, n, stride, dtype] {
            node_->reduce_scatter_mean_strided(in, stride, out, static_cast<int64_t>(n), dtype);
          });
        }
      }
      std::exception_ptr rejected;
      bool node_failed = false;  // the node's reduce-scatter, not the exchange between nodes
      try {
        post_q4_two_phase(b, shard, shard.segments.data(), 1, static_cast<uint8_t>(dtype),
                          [&](int p) {
                            try {
                              node_queue.wait(reduced[p]);
                            } catch (...) {
                              node_failed = true;
                              throw;
                            }
                          });
        check_q4_two_phase(b, shard);
      } catch (...) {
        rejected = node_failed ? std::current_exception() : between_nodes(std::current_exception());
      }
      agree_in_node(b, rejected);
      decode_q4_two_phase(b, shard, [&](int p) {
        for (int c = 0; c < nodes; ++c) {
          const size_t at = piece_at(c, p), n = piece_n(c, p);
          if (n == 0) continue;
          const uint8_t* in = b.node_shard.get() + at;
          uint8_t* out = bucket_out + at;
          const size_t bytes = n * esize;
          node_queue.post([this, in, out, bytes, shard_bytes] {
            node_->all_gather_strided(in, out, bytes, shard_bytes);
          });
        }
      });
      // The last ticket: every piece's allgather is done.
      node_queue.wait(node_queue.post([] {}));
    } else {
      node_blocking(
          [&] { node_->reduce_scatter_mean(bucket_in, b.node_shard.get(), b.numel, dtype); });
      std::exception_ptr rejected;
      try {
        post_compressed(b, shard, shard.segments.data(), 1);
        finish_compressed(b, shard);
      } catch (...) {
        rejected = between_nodes(std::current_exception());
      }
      agree_in_node(b, rejected);
      node_blocking([&] { node_->all_gather(b.node_shard.get(), bucket_out, shard_bytes); });
    }
  } catch (...) {
    node_queue.drain();
    throw;
  }
  if (!in_place) {
    for (int i = 0; i < num_segments; ++i) {
      backend_.copy(segments[i].data,
                    b.node_gathered.get() + static_cast<size_t>(segments[i].offset) * esize,
                    static_cast<size_t>(segments[i].numel) * esize);
    }
  }
  // A non-finite shard was decoded only by the ranks that reduced it: the scan of the gathered
  // bucket lets every rank of the node keep its residuals alike.
  NonfiniteScanParams scan;
  scan.segments = segments;
  scan.num_segments = num_segments;
  scan.dtype = static_cast<uint8_t>(dtype);
  scan.numel = b.full_numel;
  backend_.scan_nonfinite(scan);
}

bool CompressedAllreduce::pipelines_node_stages(const Bucket& b) const {
  return node_ != nullptr && !backend_.is_cuda() && config_.codec == Codec::kQ4 &&
         config_.q4_algorithm == Q4Algorithm::kTwoPhase && config_.piece_numel != 0 && b.pieces > 1;
}

std::exception_ptr CompressedAllreduce::between_nodes(std::exception_ptr error) const {
  // The exchange's errors name its own ranks (one per node).
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    const int local = local_world_size();
    std::ostringstream o;
    o << "in the exchange between nodes, whose rank i is global rank " << local << " i + "
      << global_rank_ % local << ": " << e.what();
    return std::make_exception_ptr(Error(o.str()));
  } catch (...) {
    return error;
  }
}

void CompressedAllreduce::agree_in_node(const Bucket& b, std::exception_ptr rejected) {
  // Each local rank decodes other payloads (its own shard's), so one may reject what the others
  // accepted; they must not wait for its allgather until the transport's timeout. On a device the
  // decodes report later, through the stream (synchronize), and nothing is agreed here.
  if (backend_.is_cuda()) {
    if (rejected) std::rethrow_exception(rejected);
    return;
  }
  const int local = local_world_size();
  const int32_t mine = rejected ? 1 : 0;
  static_assert(sizeof mine == kNodeAgreementBytes, "the agreement is one word per rank");
  std::vector<int32_t> all(local);
  try {
    Buffer send(backend_, sizeof mine), recv(backend_, sizeof mine * local);
    backend_.copy_from_host(send.get(), &mine, sizeof mine);
    node_blocking([&] { node_->all_gather(send.get(), recv.get(), sizeof mine); });
    backend_.copy_to_host(all.data(), recv.get(), sizeof mine * local);
  } catch (...) {
    // The first error is the one to report; a node that cannot agree has failed anyway.
    if (rejected) std::rethrow_exception(rejected);
    throw;
  }
  if (rejected) std::rethrow_exception(rejected);
  const int node = comm_.rank();
  for (int w = 0; w < local; ++w) {
    GRADCOMP_CHECK(all[w] == 0, "bucket " << b.id << ": rank " << node * local + w
                                          << " (local rank " << w << " of node " << node
                                          << ") rejected a payload of its shard, so rank "
                                          << global_rank_ << " stops the bucket too");
  }
}

void CompressedAllreduce::post_compressed(Bucket& b, InFlight& f, const Segment* segments,
                                          int num_segments) {
  if (config_.codec == Codec::kTopK) {
    post_topk(b, f, segments, num_segments);
  } else if (config_.q4_algorithm == Q4Algorithm::kTwoPhase) {
    post_q4_two_phase(b, f, segments, num_segments, static_cast<uint8_t>(f.dtype));
  } else {
    post_q4_one_phase(b, f, segments, num_segments);
  }
}

void CompressedAllreduce::finish_compressed(Bucket& b, InFlight& f) {
  switch (f.rest) {
    case InFlight::Rest::kQ4TwoPhase:
      return finish_q4_two_phase(b, f);
    case InFlight::Rest::kQ4OnePhase:
      return finish_q4_one_phase(b, f);
    case InFlight::Rest::kTopK:
      return finish_topk(b, f);
    case InFlight::Rest::kEndBucket:
      return;
  }
}

void CompressedAllreduce::wait_tickets(const InFlight& f) {
  detail::CollectiveQueue& queue = *collectives_;
  for (uint64_t t : f.tickets) queue.wait(t);
}

void CompressedAllreduce::end_bucket(Bucket& b) {
  // A non-finite result (on every rank alike: all decoded the same payloads) leaves the
  // committed residuals in place; end_bucket copies them over the candidates on the device, so
  // adopting the candidates is right either way and needs no host decision.
  ResidualPair pairs[EndBucketParams::kMaxPairs];
  int count = 0;
  if (config_.error_feedback) {
    for (Buffer* r : {b.residual, b.chunk_residual, b.velocity}) {
      if (r[0].get() == nullptr) continue;
      pairs[count].candidate = r[b.current ^ 1].get();
      pairs[count].committed = r[b.current].get();
      pairs[count].bytes = r[0].bytes();
      ++count;
    }
  }
  backend_.end_bucket(pairs, count);
  if (config_.error_feedback) b.current ^= 1;
}

uint64_t CompressedAllreduce::synchronize() {
  return backend_.take_nonfinite_buckets();
}

bool CompressedAllreduce::poll(uint64_t* nonfinite_buckets) {
  return backend_.poll_nonfinite_buckets(nonfinite_buckets);
}

void CompressedAllreduce::set_residuals(Q4EncodeParams& e, Buffer* residual, const Bucket& b,
                                        int64_t offset) const {
  if (!config_.error_feedback) return;
  const size_t at = static_cast<size_t>(offset) * dtype_size(config_.residual_dtype);
  e.residual_in = residual[b.current].get() + at;
  e.residual_out = residual[b.current ^ 1].get() + at;
  e.residual_dtype = static_cast<uint8_t>(config_.residual_dtype);
}

void CompressedAllreduce::post_q4_two_phase(Bucket& b, InFlight& f, const Segment* source,
                                            int num_source, uint8_t source_dtype,
                                            const std::function<void(int)>& before_piece) {
  const int world = comm_.world_size();
  const int rank = comm_.rank();
  const uint64_t slot_bytes = b.q4_slot_bytes;
  const int pieces = b.pieces;
  detail::CollectiveQueue& queue = collectives_for(b);
  std::vector<uint64_t> scattered(pieces);
  f.rest = InFlight::Rest::kQ4TwoPhase;
  f.tickets.assign(pieces, 0);

  auto scatter = [&](int p) {
    if (before_piece) before_piece(p);
    for (int c = 0; c < world; ++c) {
      Q4EncodeParams e = q4_encode_params(source, num_source, source_dtype, b.piece_begin(c, p),
                                          b.piece_numel(c, p), config_.q4, rng(b, 0),
                                          b.q4_slot(b.send, p, c, world));
      set_residuals(e, b.residual, b, e.begin);
      backend_.q4_encode(e);
    }
    uint8_t* send = b.q4_slot(b.send, p, 0, world);
    uint8_t* recv = b.q4_slot(b.recv, p, 0, world);
    scattered[p] =
        queue.post([this, send, recv, slot_bytes] { comm_.all_to_all(send, recv, slot_bytes); });
  };
  // Sum my piece from every rank in fp32, then re-encode it with my own chunk residual (into the
  // piece's send slots, free once its all-to-all is done). A non-finite sum re-encodes to NaN
  // steps, so the final decode flags it on every rank.
  Segment work{b.work.get(), rank * b.chunk, b.chunk};
  auto gather = [&](int p) {
    queue.wait(scattered[p]);
    const int64_t mine = b.piece_numel(rank, p);
    std::vector<const uint8_t*> from(world);
    for (int w = 0; w < world; ++w) from[w] = b.q4_slot(b.recv, p, w, world);
    backend_.q4_decode(q4_decode_params(from.data(), world, slot_bytes, mine, config_.q4, &work, 1,
                                        math::kDtypeF32, b.piece_begin(rank, p), 1.0f));
    uint8_t* send = b.q4_slot(b.send, p, 0, world);
    Q4EncodeParams e = q4_encode_params(&work, 1, math::kDtypeF32, b.piece_begin(rank, p), mine,
                                        config_.q4, rng(b, 1), send);
    set_residuals(e, b.chunk_residual, b, p * b.piece);
    backend_.q4_encode(e);
    uint8_t* into = b.q4_slot(b.gathered, p, 0, world);
    f.tickets[p] =
        queue.post([this, send, into, slot_bytes] { comm_.all_gather(send, into, slot_bytes); });
  };
  // Every rank posts the same order: all-to-all 0, then all-to-all p + 1 before allgather p.
  scatter(0);
  for (int p = 1; p < pieces; ++p) {
    scatter(p);
    gather(p - 1);
  }
  gather(pieces - 1);
}

void CompressedAllreduce::finish_q4_two_phase(Bucket& b, InFlight& f) {
  check_q4_two_phase(b, f);
  decode_q4_two_phase(b, f, nullptr);
}

void CompressedAllreduce::check_q4_two_phase(Bucket& b, InFlight& f) {
  const int world = comm_.world_size();
  wait_tickets(f);
  // Every payload is checked before any is decoded, so a bad one leaves the bucket as it was
  // (the bucket was the input of the encodes until the last of them).
  std::vector<const uint8_t*> payloads(world);
  std::vector<int64_t> sizes(world);
  for (int p = 0; p < b.pieces; ++p) {
    for (int w = 0; w < world; ++w) {
      payloads[w] = b.q4_slot(b.gathered, p, w, world);
      sizes[w] = b.piece_numel(w, p);
    }
    PayloadCheckParams check;  // one piece's payloads, in rank order (errors name the rank)
    check.payloads = payloads.data();
    check.num_payloads = world;
    check.payload_bytes = b.q4_slot_bytes;
    check.numel = sizes.data();
    check.codec = format::kCodecQ4;
    check.param = static_cast<uint32_t>(config_.q4.block_size);
    backend_.check_payloads(check);
  }
}

void CompressedAllreduce::decode_q4_two_phase(Bucket& b, InFlight& f,
                                              const std::function<void(int)>& after_piece) {
  const int world = comm_.world_size();
  const uint8_t code = static_cast<uint8_t>(f.dtype);
  const int num_segments = static_cast<int>(f.segments.size());
  for (int p = 0; p < b.pieces; ++p) {
    for (int w = 0; w < world; ++w) {
      const uint8_t* payload = b.q4_slot(b.gathered, p, w, world);
      backend_.q4_decode(q4_decode_params(&payload, 1, b.q4_slot_bytes, b.piece_numel(w, p),
                                          config_.q4, f.segments.data(), num_segments, code,
                                          b.piece_begin(w, p), static_cast<float>(world)));
    }
    if (after_piece) after_piece(p);
  }
}

detail::CollectiveQueue& CompressedAllreduce::collectives_for(const Bucket& b) {
  if (!collectives_) collectives_ = std::make_unique<detail::CollectiveQueue>();
  // On a device the stream orders everything; a bucket in one piece, when buckets do not
  // overlap, has nothing to overlap with.
  const bool overlap = b.pieces > 1 || overlaps_buckets();
  if (overlap && !backend_.is_cuda() && !collectives_->threaded()) collectives_->start(carry_);
  return *collectives_;
}

void CompressedAllreduce::blocking(const std::function<void()>& collective) {
  if (!collectives_) collectives_ = std::make_unique<detail::CollectiveQueue>();
  detail::CollectiveQueue& queue = *collectives_;
  try {
    queue.wait(queue.post(collective));
  } catch (...) {
    // A bucket in flight must still see the error when it waits for its own collectives.
    if (in_flight_.empty()) queue.drain();
    throw;
  }
}

detail::CollectiveQueue& CompressedAllreduce::node_collectives_for(const Bucket& b) {
  if (!node_collectives_) node_collectives_ = std::make_unique<detail::CollectiveQueue>();
  if (pipelines_node_stages(b) && !node_collectives_->threaded()) node_collectives_->start(carry_);
  return *node_collectives_;
}

void CompressedAllreduce::node_blocking(const std::function<void()>& collective) {
  if (!node_collectives_) node_collectives_ = std::make_unique<detail::CollectiveQueue>();
  detail::CollectiveQueue& queue = *node_collectives_;
  queue.wait(queue.post(collective));
}

void CompressedAllreduce::set_context_carrier(
    std::function<std::function<void()>(std::function<void()>)> carry) {
  GRADCOMP_CHECK((!collectives_ || !collectives_->threaded()) &&
                     (!node_collectives_ || !node_collectives_->threaded()),
                 "set_context_carrier after the collectives' thread started");
  carry_ = std::move(carry);
}

double CompressedAllreduce::blocked_seconds() const {
  return (collectives_ ? collectives_->blocked_seconds() : 0.0) +
         (node_collectives_ ? node_collectives_->blocked_seconds() : 0.0);
}

void CompressedAllreduce::post_q4_one_phase(Bucket& b, InFlight& f, const Segment* segments,
                                            int num_segments) {
  const uint8_t code = static_cast<uint8_t>(f.dtype);
  Q4EncodeParams e = q4_encode_params(segments, num_segments, code, 0, b.numel, config_.q4,
                                      rng(b, 0), b.send.get());
  set_residuals(e, b.residual, b, 0);
  backend_.q4_encode(e);
  f.rest = InFlight::Rest::kQ4OnePhase;
  f.tickets = {post_all_gather(b, b.slot_bytes)};
}

void CompressedAllreduce::finish_q4_one_phase(Bucket& b, InFlight& f) {
  const int world = comm_.world_size();
  wait_tickets(f);
  const std::vector<const uint8_t*> from = slots(b.gathered, b.slot_bytes, world);
  backend_.q4_decode(q4_decode_params(from.data(), world, b.slot_bytes, b.numel, config_.q4,
                                      f.segments.data(), static_cast<int>(f.segments.size()),
                                      static_cast<uint8_t>(f.dtype), 0, static_cast<float>(world)));
}

void CompressedAllreduce::post_topk(Bucket& b, InFlight& f, const Segment* segments,
                                    int num_segments) {
  const int world = comm_.world_size();
  const DType dtype = f.dtype;
  const TopKRemedies& remedies = config_.remedies;
  TopKEncodeParams e;
  e.segments = segments;
  e.num_segments = num_segments;
  e.dtype = static_cast<uint8_t>(dtype);
  // DGC: what is sparsified is the clipped gradient, or the velocity it is accumulated into.
  Segment accumulated{nullptr, 0, b.numel};
  if (remedies.any()) {
    TopKAccumulateParams a;
    a.segments = segments;
    a.num_segments = num_segments;
    a.dtype = e.dtype;
    a.numel = b.numel;
    a.momentum = remedies.momentum;
    if (remedies.momentum > 0.0f) {
      a.velocity_in = reinterpret_cast<const float*>(b.velocity[b.current].get());
      a.out = reinterpret_cast<float*>(b.velocity[b.current ^ 1].get());
    } else {
      a.out = reinterpret_cast<float*>(b.staged.get());
    }
    a.clip_threshold =
        static_cast<float>(remedies.clip_norm / std::sqrt(static_cast<double>(world)));
    a.scratch = reinterpret_cast<float*>(b.workspace.get());
    backend_.topk_accumulate(a);
    accumulated.data = a.out;
    e.segments = &accumulated;
    e.num_segments = 1;
    e.dtype = math::kDtypeF32;
  }
  if (topk_sends_q4_at(config_, step_)) {
    // Nothing is masked: every coordinate was sent, and the velocity carries the momentum on.
    post_q4_two_phase(b, f, e.segments, e.num_segments, e.dtype);
    return;
  }
  if (b.chunk_residual[0].get() != nullptr || b.recv.get() != nullptr) {
    // The q4 warm-up is over: its own-chunk residuals (re-encoding error of the sums) and
    // buffers go, so checkpoints no longer carry them.
    for (auto& r : b.chunk_residual) r = Buffer();
    b.recv = Buffer();
    b.work = Buffer();
  }
  e.numel = b.numel;
  if (config_.error_feedback) {
    e.residual_in = b.residual[b.current].get();
    e.residual_out = b.residual[b.current ^ 1].get();
    e.residual_dtype = static_cast<uint8_t>(config_.residual_dtype);
  }
  const double ratio = topk_ratio_at(config_, step_);
  e.k = topk_k(b.numel, ratio);
  e.capacity = static_cast<uint32_t>(topk_capacity_at(config_, b.numel, step_));
  e.exact = config_.topk.exact;
  e.value_dtype = static_cast<uint8_t>(config_.topk.value_dtype);
  e.payload = b.send.get();
  e.workspace = b.workspace.get();
  backend_.topk_encode(e);
  if (remedies.momentum > 0.0f && remedies.momentum_masking) {
    TopKMaskParams m;
    m.payload = b.send.get();
    m.capacity = e.capacity;
    m.numel = b.numel;
    m.target = reinterpret_cast<float*>(b.velocity[b.current ^ 1].get());
    backend_.topk_mask(m);
  }
  // This step's payloads: smaller than the slots while the warm-up has not reached the ratio.
  const uint64_t step_bytes = topk_payload_bytes(e.capacity, config_.topk.value_dtype);
  f.rest = InFlight::Rest::kTopK;
  TopKDecodeParams& d = f.topk;
  d.num_payloads = world;
  d.payload_bytes = step_bytes;
  d.numel = b.numel;
  d.capacity = e.capacity;
  d.value_dtype = e.value_dtype;
  d.dtype = static_cast<uint8_t>(dtype);
  d.divisor = static_cast<float>(world);
  d.workspace = b.workspace.get();
  f.tickets = {post_all_gather(b, step_bytes)};
}

uint64_t CompressedAllreduce::post_all_gather(const Bucket& b, uint64_t bytes) {
  const uint8_t* send = b.send.get();
  uint8_t* into = b.gathered.get();
  return collectives_for(b).post(
      [this, send, into, bytes] { comm_.all_gather(send, into, bytes); });
}

void CompressedAllreduce::finish_topk(Bucket& b, InFlight& f) {
  wait_tickets(f);
  TopKDecodeParams d = f.topk;
  const std::vector<const uint8_t*> from = slots(b.gathered, d.payload_bytes, d.num_payloads);
  d.payloads = from.data();
  d.segments = f.segments.data();
  d.num_segments = static_cast<int>(f.segments.size());
  backend_.topk_decode(d);
}

CompressionState CompressedAllreduce::state() const {
  CompressionState s = pending_;
  s.seed = config_.seed;
  s.step = step_;
  for (const auto& kv : buckets_) {
    const Bucket& b = *kv.second;
    auto save = [&](const Buffer& buf, std::map<uint64_t, std::vector<uint8_t>>& to) {
      if (buf.get() == nullptr) return;
      std::vector<uint8_t> bytes(buf.bytes());
      backend_.copy_to_host(bytes.data(), buf.get(), bytes.size());
      to[kv.first] = std::move(bytes);
    };
    save(b.residual[b.current], s.residuals);
    save(b.chunk_residual[b.current], s.chunk_residuals);
    save(b.velocity[b.current], s.velocities);
  }
  return s;
}

void CompressedAllreduce::revert_bucket(uint64_t bucket_id) {
  GRADCOMP_CHECK(in_flight_.empty(), "bucket " << bucket_id << " changed on rank " << global_rank_
                                               << " while " << in_flight_.size()
                                               << " begun buckets are unfinished");
  auto it = buckets_.find(bucket_id);
  if (it != buckets_.end() && config_.error_feedback) it->second->current ^= 1;
}

int64_t CompressedAllreduce::bucket_numel(uint64_t bucket_id) const {
  auto it = buckets_.find(bucket_id);
  return it == buckets_.end() ? -1 : it->second->full_numel;
}

void CompressedAllreduce::release_bucket(uint64_t bucket_id) {
  GRADCOMP_CHECK(in_flight_.empty(), "bucket " << bucket_id << " changed on rank " << global_rank_
                                               << " while " << in_flight_.size()
                                               << " begun buckets are unfinished");
  buckets_.erase(bucket_id);
  pending_.residuals.erase(bucket_id);
  pending_.chunk_residuals.erase(bucket_id);
  pending_.velocities.erase(bucket_id);
}

void CompressedAllreduce::load_state(const CompressionState& s) {
  GRADCOMP_CHECK(in_flight_.empty(), "load_state on rank " << global_rank_ << " while "
                                                           << in_flight_.size()
                                                           << " begun buckets are unfinished");
  GRADCOMP_CHECK(s.seed == config_.seed, "checkpoint seed "
                                             << s.seed << " differs from the configured seed "
                                             << config_.seed << " on rank " << global_rank_);
  step_ = s.step;
  buckets_.clear();
  pending_ = s;
}

}  // namespace gradcomp
