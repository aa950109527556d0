// What a compression configuration allows and what it costs: validation and the byte formulas.
#include <algorithm>
#include <cmath>

#include "allreduce_bucket.h"
#include "gradcomp/collectives.h"
#include "gradcomp/format.h"

namespace gradcomp {

using detail::div_up;
using detail::q4_chunk_size;
using detail::topk_capacity_at;

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
  GRADCOMP_CHECK(block_codec(codec) || codec == Codec::kTopK, "unknown codec " << int(codec));
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

uint64_t block_payload_bytes(const CompressionConfig& config, int64_t numel) {
  return config.codec == Codec::kQ2 ? q2_payload_bytes(numel, config.q4.block_size)
                                    : q4_payload_bytes(numel, config.q4.block_size);
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
  if (block_codec(config.codec) && config.q4_algorithm == Q4Algorithm::kOnePhase) {
    return others * block_payload_bytes(config, numel);
  }
  // Each piece is one all-to-all and one allgather of a payload per rank.
  return 2 * others * static_cast<uint64_t>(q4_pieces(config, numel, world)) *
         block_payload_bytes(config, q4_piece_size(config, numel, world));
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
  const bool two_phase = block_codec(config.codec) ? config.q4_algorithm == Q4Algorithm::kTwoPhase
                                                   : topk_sends_q4_at(config, 0);
  if (!config.error_feedback || !two_phase) return 0;
  return static_cast<uint64_t>(q4_chunk_size(numel, world, config.q4.block_size)) *
         dtype_size(config.residual_dtype);
}

}  // namespace gradcomp
