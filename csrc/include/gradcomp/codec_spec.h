// The codec a front end compresses with: the C++ face of gradcomp.Q4 / TopK / NoCompression.
#pragma once

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
};

// Top-k sparsification of the ceil(ratio * N) largest magnitudes of each bucket.
struct TopK {
  double ratio = 0.01;
  bool exact = true;
  bool error_feedback = true;
  DType value_dtype = DType::kFloat32;
  DType residual_dtype = DType::kFloat32;
  uint64_t seed = 0;
};

// A plain averaging allreduce through the same path, for A/B runs.
struct NoCompression {};

using CodecSpec = std::variant<Q4, TopK, NoCompression>;

// The engine options a spec stands for; throws Error naming a bad option.
EngineOptions engine_options(const CodecSpec& codec);

}  // namespace gradcomp
