// The allgather schemes: one-phase q4 and top-k (with DGC's remedies around its encode).
#include <cmath>
#include <vector>

#include "allreduce_bucket.h"
#include "codec_params.h"
#include "collective_queue.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace {

using Buffer = detail::BackendBuffer;
using detail::q4_decode_params;
using detail::q4_encode_params;
using detail::slots;
using detail::topk_capacity_at;

}  // namespace

void CompressedAllreduce::post_q4_one_phase(Bucket& b, InFlight& f, const Segment* segments,
                                            int num_segments) {
  const uint8_t code = static_cast<uint8_t>(f.dtype);
  Q4EncodeParams e =
      q4_encode_params(segments, num_segments, code, 0, b.numel, config_, rng(b, 0), b.send.get());
  set_residuals(e, b.residual, b, 0);
  backend_.q4_encode(e);
  f.rest = InFlight::Rest::kQ4OnePhase;
  f.tickets = {post_all_gather(b, b.slot_bytes)};
}

void CompressedAllreduce::finish_q4_one_phase(Bucket& b, InFlight& f) {
  const int world = comm_.world_size();
  wait_tickets(f);
  const std::vector<const uint8_t*> from = slots(b.gathered, b.slot_bytes, world);
  backend_.q4_decode(q4_decode_params(from.data(), world, b.slot_bytes, b.numel, config_,
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
    count_residual_memory();
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

}  // namespace gradcomp
