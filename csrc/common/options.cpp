// Validation of the codec options (types.h), and the top-k counts they imply.
#include <cmath>
#include <cstdlib>

#include "gradcomp/types.h"

namespace gradcomp {

void Q4Options::validate() const {
  const char* problem = q4_block_problem(static_cast<uint32_t>(block_size));
  GRADCOMP_CHECK(problem == nullptr, "Q4 block_size " << block_size << ": " << problem);
  GRADCOMP_CHECK(rounding == Rounding::kStochastic || rounding == Rounding::kNearest,
                 "Q4 rounding must be stochastic or nearest");
}

void TopKOptions::validate() const {
  GRADCOMP_CHECK(std::isfinite(ratio) && ratio > 0.0 && ratio <= 1.0,
                 "TopK ratio must be in (0, 1], got " << ratio);
  GRADCOMP_CHECK(
      std::isfinite(capacity_factor) && capacity_factor >= 1.0 && capacity_factor <= 16.0,
      "TopK capacity_factor must be in [1, 16], got " << capacity_factor);
  GRADCOMP_CHECK(math::dtype_valid(static_cast<uint8_t>(value_dtype)),
                 "TopK value_dtype must be float32, float16 or bfloat16");
}

KernelGeneration parse_kernel_generation(const std::string& name, const char* what) {
  if (name == "v1") return KernelGeneration::kV1;
  if (name == "v2") return KernelGeneration::kV2;
  GRADCOMP_CHECK(name == "default" || name.empty(),
                 what << " must be 'default', 'v1' or 'v2', got '" << name << "'");
  return KernelGeneration::kDefault;
}

KernelGeneration resolve_kernel_generation(KernelGeneration requested) {
  if (requested != KernelGeneration::kDefault) return requested;
  const char* env = std::getenv("GRADCOMP_KERNELS");
  const KernelGeneration g = parse_kernel_generation(env != nullptr ? env : "",
                                                     "the environment variable GRADCOMP_KERNELS");
  return g == KernelGeneration::kDefault ? KernelGeneration::kV1 : g;
}

const char* kernel_generation_name(KernelGeneration g) {
  switch (g) {
    case KernelGeneration::kV1:
      return "v1";
    case KernelGeneration::kV2:
      return "v2";
    default:
      return "default";
  }
}

int64_t topk_k(int64_t numel, double ratio) {
  GRADCOMP_CHECK(numel >= 0, "element count must be >= 0, got " << numel);
  if (numel == 0) return 0;
  double k = std::ceil(ratio * static_cast<double>(numel));
  int64_t ki = k < 1.0 ? 1 : static_cast<int64_t>(k);
  return ki > numel ? numel : ki;
}

int64_t topk_capacity(int64_t numel, const TopKOptions& options) {
  int64_t k = topk_k(numel, options.ratio);
  if (options.exact) return k;
  int64_t cap = static_cast<int64_t>(std::ceil(options.capacity_factor * static_cast<double>(k)));
  return cap > numel ? numel : cap;
}

}  // namespace gradcomp
