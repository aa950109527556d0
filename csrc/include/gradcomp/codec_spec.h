// The codec a front end compresses with: the C++ face of gradcomp.Q4 / TopK / NoCompression.
#pragma once

#include <string>
#include <variant>

#include "gradcomp/engine.h"

namespace gradcomp {

// 4-bit block quantization (docs/algorithms.md); the defaults are the Python spec's.
struct Q4 {
  int block_size = 64;
  Rounding rounding = Rounding::kStochastic;
  Q4Algorithm algorithm = Q4Algorithm::kTwoPhase;
  bool error_feedback = true;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
  // Two-phase: elements per pipeline piece, and consecutive buckets overlapped
  // (CompressionConfig::piece_numel; 0: each bucket whole, one after another).
  int64_t piece_numel = CompressionConfig::kDefaultPieceNumel;
  KernelGeneration kernels = KernelGeneration::kDefault;  // CUDA only (types.h)
};

// Top-k sparsification of the ceil(ratio * N) largest magnitudes of each bucket, with DGC's
// remedies (TopKRemedies in collectives.h; docs/algorithms.md): a sparsity warm-up, momentum
// correction with factor masking (then the optimizer must be SGD without momentum:
// check_optimizer in gradcomp/torch.h), and local gradient clipping.
struct TopK {
  double ratio = 0.01;
  bool exact = true;
  bool error_feedback = true;
  DType value_dtype = DType::kFloat32;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
  uint32_t warmup_steps = 0;
  uint32_t warmup_stages = 4;
  TopKWarmup warmup = TopKWarmup::kSparsity;  // kQ4: q4 for the first warmup_steps
  float momentum = 0.0f;
  bool momentum_masking = true;
  float clip_norm = 0.0f;
  // The q4 warm-up's pipeline pieces, and consecutive buckets overlapped (as Q4's; 0: each
  // bucket whole, one after another).
  int64_t piece_numel = CompressionConfig::kDefaultPieceNumel;
  KernelGeneration kernels = KernelGeneration::kDefault;  // CUDA only (types.h)
};

// 2-bit block quantization with error feedback (docs/algorithms.md), meant for DiLoCo's outer
// gradients: about 2.25 bits per element at block size 64. On CUDA only the v2 kernels run it
// (kernels = kV2, or GRADCOMP_KERNELS=v2; v1 refuses it by name); its accuracy in per-step
// training is not measured.
struct Q2 {
  int block_size = 64;
  Rounding rounding = Rounding::kStochastic;
  bool error_feedback = true;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
  int64_t piece_numel = CompressionConfig::kDefaultPieceNumel;  // as Q4's
  KernelGeneration kernels = KernelGeneration::kDefault;        // CUDA only (types.h)
};

// A plain averaging allreduce through the same path, for A/B runs.
struct NoCompression {};

using CodecSpec = std::variant<Q4, TopK, NoCompression, Q2>;

// The engine options a spec stands for; throws Error naming a bad option.
EngineOptions engine_options(const CodecSpec& codec);

// "q4", "topk", "q2" or "none": the codec label of metrics.
const char* codec_spec_name(const CodecSpec& codec);

// Throws Error naming Q2 when a per-step front end (`front_end`: the DDP hook, GradSync, FSDP) is
// given it: Q2 is meant for DiLoCo's outer gradients, and its accuracy in per-step training is
// not measured.
void check_per_step_codec(const CodecSpec& codec, const char* front_end);

// What every front end warns when `codec` meets an adaptive optimizer (Adam, AdamW, Adagrad,
// RMSprop and their kin): top-k's remedies did not hold across models there (docs/benchmarks.md,
// "Top-k with Adam"). Empty for codecs without that problem.
std::string adaptive_optimizer_warning(const CodecSpec& codec);

}  // namespace gradcomp
