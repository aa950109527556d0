// Codec specs to engine options: the one mapping both front ends use.
#include "gradcomp/codec_spec.h"

namespace gradcomp {

EngineOptions engine_options(const CodecSpec& codec) {
  EngineOptions o;
  CompressionConfig& c = o.config;
  if (const Q4* q4 = std::get_if<Q4>(&codec)) {
    c.codec = Codec::kQ4;
    c.q4.block_size = q4->block_size;
    c.q4.rounding = q4->rounding;
    c.q4_algorithm = q4->algorithm;
    c.error_feedback = q4->error_feedback;
    c.residual_dtype = q4->residual_dtype;
    c.seed = q4->seed;
    c.piece_numel = q4->piece_numel;
    c.kernels = q4->kernels;
  } else if (const TopK* topk = std::get_if<TopK>(&codec)) {
    c.codec = Codec::kTopK;
    c.topk.ratio = topk->ratio;
    c.topk.exact = topk->exact;
    c.topk.value_dtype = topk->value_dtype;
    c.error_feedback = topk->error_feedback;
    c.residual_dtype = topk->residual_dtype;
    c.seed = topk->seed;
    c.remedies.warmup_steps = topk->warmup_steps;
    c.remedies.warmup_stages = topk->warmup_stages;
    c.remedies.warmup = topk->warmup;
    c.remedies.momentum = topk->momentum;
    c.remedies.momentum_masking = topk->momentum_masking;
    c.remedies.clip_norm = topk->clip_norm;
    c.piece_numel = topk->piece_numel;
    c.kernels = topk->kernels;
  } else if (const Q2* q2 = std::get_if<Q2>(&codec)) {
    c.codec = Codec::kQ2;
    c.q4.block_size = q2->block_size;
    c.q4.rounding = q2->rounding;
    c.error_feedback = q2->error_feedback;
    c.residual_dtype = q2->residual_dtype;
    c.seed = q2->seed;
    c.piece_numel = q2->piece_numel;
    c.kernels = q2->kernels;
  } else {
    o.compress = false;
    c.error_feedback = false;
  }
  if (o.compress) c.validate();
  return o;
}

void check_per_step_codec(const CodecSpec& codec, const char* front_end) {
  GRADCOMP_CHECK(!std::holds_alternative<Q2>(codec),
                 front_end << " does not take Q2: Q2 is meant for DiLoCo's outer gradients "
                              "(gradcomp::DiLoCo, gradcomp.torch.diloco); its accuracy in "
                              "per-step training is not measured. Use Q4");
}

std::string adaptive_optimizer_warning(const CodecSpec& codec) {
  if (!std::holds_alternative<TopK>(codec)) return std::string();
  return "TopK with an adaptive optimizer (Adam, AdamW, Adagrad, RMSprop, ...) trains to a "
         "measurably worse loss: a coordinate top-k sends once in many steps arrives with its "
         "accumulated sum, and the optimizer's per-coordinate scale turns it into a step of "
         "several "
         "learning rates. Warm-ups narrowed the gap on one model and not on another (+16 % loss on "
         "a second transformer). Use Q4 (within 1 % of dense with AdamW) or DiLoCo "
         "(gradcomp.torch.diloco / gradcomp::DiLoCo: the inner optimizer never sees compressed "
         "gradients); docs/benchmarks.md, \"Top-k with Adam\"";
}

const char* codec_spec_name(const CodecSpec& codec) {
  if (std::holds_alternative<Q4>(codec)) return "q4";
  if (std::holds_alternative<TopK>(codec)) return "topk";
  if (std::holds_alternative<Q2>(codec)) return "q2";
  return "none";
}

}  // namespace gradcomp
