// Error construction and option validation for the core library.
#include <cmath>

#include "gradcomp/format.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {

void throw_error(const char* file, int line, const std::string& message) {
  std::ostringstream os;
  os << "gradcomp: " << message << " [" << file << ":" << line << "]";
  throw Error(os.str());
}

}  // namespace detail

const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

void Q4Options::validate() const {
  GRADCOMP_CHECK(block_size >= 16 && block_size <= 256 && (block_size & (block_size - 1)) == 0,
                 "Q4 block_size must be a power of two in [16, 256], got " << block_size);
  GRADCOMP_CHECK(rounding == Rounding::kStochastic || rounding == Rounding::kNearest,
                 "Q4 rounding must be stochastic or nearest");
}

void TopKOptions::validate() const {
  GRADCOMP_CHECK(std::isfinite(ratio) && ratio > 0.0 && ratio <= 1.0,
                 "TopK ratio must be in (0, 1], got " << ratio);
  GRADCOMP_CHECK(
      std::isfinite(capacity_factor) && capacity_factor >= 1.0 && capacity_factor <= 16.0,
      "TopK capacity_factor must be in [1, 16], got " << capacity_factor);
  GRADCOMP_CHECK(value_dtype == DType::kFloat32 || value_dtype == DType::kFloat16 ||
                     value_dtype == DType::kBFloat16,
                 "TopK value_dtype must be float32, float16 or bfloat16");
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
