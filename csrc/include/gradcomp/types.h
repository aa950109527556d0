// Public vocabulary of gradcomp: dtypes, codec options, tensor segments, errors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "params.h"

namespace gradcomp {

enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
static_assert(static_cast<uint8_t>(DType::kFloat32) == math::kDtypeF32 &&
                  static_cast<uint8_t>(DType::kFloat16) == math::kDtypeF16 &&
                  static_cast<uint8_t>(DType::kBFloat16) == math::kDtypeBF16,
              "DType values are the dtype codes the kernels and payloads use");

inline size_t dtype_size(DType d) {
  return math::dtype_bytes(static_cast<uint8_t>(d));
}
const char* dtype_name(DType d);

// kQ2: 2-bit codes of q4's blocks, meant for DiLoCo's outer gradients (docs/algorithms.md).
enum class Codec : uint8_t { kQ4 = 1, kTopK = 2, kQ2 = 3 };
static_assert(static_cast<uint8_t>(Codec::kQ4) == format::kCodecQ4 &&
                  static_cast<uint8_t>(Codec::kTopK) == format::kCodecTopK &&
                  static_cast<uint8_t>(Codec::kQ2) == format::kCodecQ2,
              "Codec values are the codec codes of the wire format");
enum class Rounding : uint8_t { kStochastic = 0, kNearest = 1 };

// Which generation of CUDA kernels a CUDA backend launches (docs/api.md, "Kernel generations").
// v1 is the default; v2 (kernels/v2/) is opt-in until a GPU run proves it byte-equal to the CPU
// and sanitizer-clean. kDefault reads GRADCOMP_KERNELS ("v1" or "v2"; unset: v1). The CPU
// backend has one generation and ignores this.
enum class KernelGeneration : uint8_t { kDefault = 0, kV1 = 1, kV2 = 2 };
// kDefault resolved through the environment; throws Error naming a bad GRADCOMP_KERNELS.
KernelGeneration resolve_kernel_generation(KernelGeneration requested);
const char* kernel_generation_name(KernelGeneration g);  // "default", "v1" or "v2"
// "default", "v1" or "v2" to the enum; throws Error naming `what` otherwise.
KernelGeneration parse_kernel_generation(const std::string& name, const char* what);

// Every error gradcomp raises. The message says what was wrong and where (bucket, rank, tensor).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A payload that failed its checks (corrupted, truncated or foreign bytes): counted apart, as
// operators alert on it.
class PayloadError : public Error {
 public:
  explicit PayloadError(const std::string& what) : Error(what) {}
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
}  // namespace detail

// The core layer's one error-checking macro: GRADCOMP_CHECK(cond, "text " << value).
#define GRADCOMP_CHECK(cond, msg)                                                    \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream gradcomp_check_os_;                                         \
      gradcomp_check_os_ << msg;                                                     \
      ::gradcomp::detail::throw_error(__FILE__, __LINE__, gradcomp_check_os_.str()); \
    }                                                                                \
  } while (0)

// Also the options of Codec::kQ2, whose blocks follow the same rule (math::q2_block_size_valid).
struct Q4Options {
  int block_size = 64;  // math::q4_block_size_valid; docs/algorithms.md explains the default
  Rounding rounding = Rounding::kStochastic;
  void validate() const;
};

struct TopKOptions {
  double ratio = 0.01;  // k = max(1, ceil(ratio * N))
  bool exact = true;    // false: threshold from a sample, one compaction pass
  DType value_dtype = DType::kFloat32;
  double capacity_factor = 1.25;  // approximate mode: payload holds ceil(factor * k) entries
  void validate() const;
};

// Largest bucket top-k accepts: indices are 32-bit within a bucket.
constexpr int64_t kTopKMaxNumel = math::kTopKMaxNumel;

// k for a bucket of n elements.
int64_t topk_k(int64_t numel, double ratio);
// Entries an approximate-mode payload holds for a bucket of n elements.
int64_t topk_capacity(int64_t numel, const TopKOptions& options);

}  // namespace gradcomp
