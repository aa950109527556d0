// q2 v2 kernels (DiLoCo's outer gradients): q4 v2's passes with bf16 steps and 2-bit codes,
// four per byte (block_v2_codes.cuh). Bytes equal the CPU reference backend's (cpu_q2.cpp).
#include "v2/block_v2_run.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

GRADCOMP_V2_BLOCK_KERNELS(q2, Q2Codes, Q2Kernels);

}  // namespace

LaunchStatus run_q2_encode(const Q4EncodeParams& p, int max_ctas, cudaStream_t stream) {
  return block::run_encode<Q2Kernels>(p, max_ctas, stream);
}

LaunchStatus run_q2_decode(const Q4DecodeParams& p, cudaStream_t stream) {
  return block::run_decode<Q2Kernels>(p, stream);
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
