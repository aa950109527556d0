// top-k v2 launchers. Until the v2 top-k kernels land these run the v1 kernels, so that the
// switch selects a complete set (documented in docs/api.md).
#include "v2/launchers_v2.h"

namespace gradcomp {
namespace kernels {
namespace v2 {

size_t topk_workspace_bytes(int64_t numel) {
  return kernels::topk_workspace_bytes(numel);
}

LaunchStatus run_topk_encode(const TopKEncodeParams& p, cudaStream_t stream) {
  return kernels::run_topk_encode(p, stream);
}

LaunchStatus run_topk_decode(const TopKDecodeParams& p, cudaStream_t stream) {
  return kernels::run_topk_decode(p, stream);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
