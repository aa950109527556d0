// The layout agreement every rank reaches before a bucket's first compressed exchange.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>

#include "gradcomp/backend.h"
#include "gradcomp/collectives.h"
#include "gradcomp/communicator.h"

namespace gradcomp {
namespace detail {

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
  uint16_t collective;                   // 0: allreduce, 1: reduce-scatter
  uint32_t warmup_steps, warmup_stages;  // top-k remedies
  uint32_t momentum_bits, clip_bits;
  uint32_t piece;                      // two-phase q4: elements of a chunk per piece (low 32 bits)
  uint32_t warmup_kind, warmup_block;  // top-k's warm-up and its q4 block size
  uint32_t local_world;                // ranks per node (1: flat)
  bool operator==(const LayoutFingerprint& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
static_assert(sizeof(LayoutFingerprint) == 64, "fingerprint is exchanged as 64 bytes");

// The fields every collective fills alike (the rest zero): `numel` elements in all, the codec's
// parameter (q4 block size, or the top-k capacity of `codec_numel` elements).
LayoutFingerprint layout_fingerprint(const CompressionConfig& config, uint64_t bucket_id,
                                     int64_t numel, int64_t codec_numel, int world, DType dtype);

// A rank's fingerprint and the first mismatch any rank has seen so far.
struct LayoutReport {
  LayoutFingerprint mine, first, other;
  int32_t first_rank = -1, other_rank = -1;  // other_rank < 0: no mismatch found yet
};

// Allgathers the reports over `group` (through `run`, which runs one collective and waits) and
// folds in what the group's ranks saw: a mismatch another rank already found, or one between the
// group's fingerprints. `global_of` names the group's ranks by their global rank.
void exchange_layout_report(Communicator& group, Backend& backend, LayoutReport& report,
                            const std::function<int(int)>& global_of,
                            const std::function<void(const std::function<void()>&)>& run);

// Throws the Error naming both ranks' layouts when the report holds a mismatch.
void raise_layout_mismatch(const LayoutReport& report);

}  // namespace detail
}  // namespace gradcomp
