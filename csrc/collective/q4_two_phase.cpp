// Two-phase q4: encode W chunks, all-to-all, sum one's own chunk in fp32, re-encode, allgather.
#include <functional>
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

}  // namespace

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
      Q4EncodeParams e =
          q4_encode_params(source, num_source, source_dtype, b.piece_begin(c, p),
                           b.piece_numel(c, p), config_, rng(b, 0), b.q4_slot(b.send, p, c, world));
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
    backend_.q4_decode(q4_decode_params(from.data(), world, slot_bytes, mine, config_, &work, 1,
                                        math::kDtypeF32, b.piece_begin(rank, p), 1.0f));
    uint8_t* send = b.q4_slot(b.send, p, 0, world);
    Q4EncodeParams e = q4_encode_params(&work, 1, math::kDtypeF32, b.piece_begin(rank, p), mine,
                                        config_, rng(b, 1), send);
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
    backend_.check_payloads(
        detail::q4_check_params(payloads.data(), world, b.q4_slot_bytes, sizes.data(), config_));
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
                                          config_, f.segments.data(), num_segments, code,
                                          b.piece_begin(w, p), static_cast<float>(world)));
    }
    if (after_piece) after_piece(p);
  }
}

}  // namespace gradcomp
