// The compressed allreduce's per-bucket buffers and in-flight reductions, shared by its scheme
// files.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend_buffer.h"
#include "gradcomp/collectives.h"
#include "gradcomp/format.h"

namespace gradcomp {
namespace detail {

inline int64_t div_up(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Chunk c of a two-phase q4 bucket covers [c * size, min(numel, (c + 1) * size)).
inline int64_t q4_chunk_size(int64_t numel, int world, int block) {
  return std::max<int64_t>(block, div_up(div_up(numel, world), block) * block);
}
inline int64_t chunk_numel(int64_t numel, int64_t chunk, int c) {
  return std::max<int64_t>(0, std::min(numel, (c + 1) * chunk) - c * chunk);
}

// Pointers to the slots of a buffer holding one payload per rank.
inline std::vector<const uint8_t*> slots(const BackendBuffer& buffer, uint64_t slot_bytes,
                                         int world) {
  std::vector<const uint8_t*> from(world);
  for (int w = 0; w < world; ++w) from[w] = buffer.get() + slot_bytes * w;
  return from;
}

// Top-k's capacity at `step` of its sparsity warm-up.
inline int64_t topk_capacity_at(const CompressionConfig& config, int64_t numel, uint32_t step) {
  TopKOptions at = config.topk;
  at.ratio = topk_ratio_at(config, step);
  return topk_capacity(numel, at);
}

}  // namespace detail

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
    return std::max<int64_t>(0, std::min(piece, detail::chunk_numel(numel, chunk, c) - p * piece));
  }
  uint8_t* q4_slot(const detail::BackendBuffer& buffer, int p, int w, int world) const {
    return buffer.get() + q4_slot_bytes * (static_cast<uint64_t>(p) * world + w);
  }
  // Hierarchical: this rank's shard and, for buckets not exchanged in place, the bucket gathered
  // from its segments (zero-padded to L shards) and every local rank's reduced shard.
  detail::BackendBuffer node_send, node_shard, node_gathered;
};

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

}  // namespace gradcomp
