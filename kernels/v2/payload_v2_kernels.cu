// Payload-check v2 launcher (placeholder: runs the v1 kernels until the v2 kernels replace it).
#include "v2/launchers_v2.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

LaunchStatus run_check_payloads(const PayloadCheckParams& p, cudaStream_t stream) {
  return kernels::run_check_payloads(p, stream);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
