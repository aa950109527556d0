// Error construction and dtype names for the core library.
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

}  // namespace gradcomp
