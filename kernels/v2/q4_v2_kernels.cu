// q4 v2 launchers (placeholder: runs the v1 kernels until the v2 kernels replace this file).
#include "v2/launchers_v2.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  return kernels::run_q4_encode(p, max_ctas, stream);
}

LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  return kernels::run_q4_decode(p, stream);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
