// The compressed allreduce's engine: buckets and their buffers, the begin/finish of a reduction,
// residuals and their checkpoint. The schemes are in q4_two_phase.cpp, allgather_schemes.cpp
// and hierarchical_allreduce.cpp.
#include <cstring>
#include <functional>
#include <vector>

#include "allreduce_bucket.h"
#include "codec_params.h"
#include "collective_queue.h"
#include "gradcomp/format.h"
#include "layout_check.h"

namespace gradcomp {
namespace {

using Buffer = detail::BackendBuffer;
using detail::chunk_numel;
using detail::q4_chunk_size;
using detail::topk_capacity_at;

Communicator& inter_node_of(const NodeGroups& groups) {
  GRADCOMP_CHECK(groups.inter_node != nullptr && groups.intra_node != nullptr,
                 "a hierarchical allreduce needs both node groups");
  return *groups.inter_node;
}

}  // namespace

CompressedAllreduce::CompressedAllreduce(Communicator& comm, Backend& backend,
                                         const CompressionConfig& config)
    : comm_(comm), backend_(backend), config_(config) {
  config_.validate();
  GRADCOMP_CHECK(comm.device_memory() == backend.is_cuda(),
                 "communicator and backend disagree on host versus device memory");
  // Refused here, before any bucket, rather than at the first encode (the backend refuses too).
  backend.check_codec(static_cast<uint8_t>(config_.codec));
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
  const bool two_phase = block_codec(config_.codec) ? config_.q4_algorithm == Q4Algorithm::kTwoPhase
                                                    : topk_sends_q4_at(config_, step_);
  if (two_phase) {
    b->chunk = q4_chunk_size(numel, world, config_.q4.block_size);
    // On a device everything runs in stream order, so pieces would only add launches and calls.
    b->piece = backend_.is_cuda() ? b->chunk : q4_piece_size(config_, numel, world);
    b->pieces = backend_.is_cuda() ? 1 : q4_pieces(config_, numel, world);
    b->q4_slot_bytes = block_payload_bytes(config_, b->piece);
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
  if (block_codec(config_.codec) && !two_phase) {
    b->slot_bytes = block_payload_bytes(config_, numel);
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
  count_residual_memory();
  return ref;
}

void CompressedAllreduce::count_residual_memory() {
  uint64_t bytes = 0;
  for (const auto& kv : buckets_) {
    for (const Buffer* r : {kv.second->residual, kv.second->chunk_residual, kv.second->velocity})
      bytes += r[0].bytes() + r[1].bytes();
  }
  residual_memory_.store(bytes, std::memory_order_relaxed);
}

void CompressedAllreduce::check_layout(const Bucket& b, uint64_t bucket_id) {
  detail::LayoutFingerprint mine = detail::layout_fingerprint(
      config_, bucket_id, b.full_numel, b.full_numel, comm_.world_size(), b.dtype);
  mine.local_world = static_cast<uint32_t>(local_world_size());
  mine.algorithm = static_cast<uint8_t>(config_.q4_algorithm);
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
  detail::LayoutReport report{};
  report.mine = mine;
  const int local = local_world_size();
  const int node = comm_.rank(), local_rank = global_rank_ - node * local;
  auto run = [this](const std::function<void()>& collective) { blocking(collective); };
  auto in_node = [&](int w) { return node * local + w; };
  if (node_ != nullptr) detail::exchange_layout_report(*node_, backend_, report, in_node, run);
  detail::exchange_layout_report(
      comm_, backend_, report, [&](int w) { return w * local + local_rank; }, run);
  if (node_ != nullptr) detail::exchange_layout_report(*node_, backend_, report, in_node, run);
  detail::raise_layout_mismatch(report);
}

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
  count_residual_memory();
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
  count_residual_memory();
  pending_ = s;
}

}  // namespace gradcomp
