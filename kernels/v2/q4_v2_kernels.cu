// q4 v2 kernels: encode with error feedback and the body checksum in one pass, sealed by the last
// block; decode-and-mean of W payloads with 512-byte warp stores. Bytes equal the CPU's.
#include "v2/block_v2_run.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

GRADCOMP_V2_BLOCK_KERNELS(q4, Q4Codes, Q4Kernels);

}  // namespace

LaunchStatus run_q4_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  return block::run_encode<Q4Kernels>(p, max_ctas, stream);
}

LaunchStatus run_q4_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  return block::run_decode<Q4Kernels>(p, stream);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
