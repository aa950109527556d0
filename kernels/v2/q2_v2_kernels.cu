// q2 v2 kernels (DiLoCo's outer gradients): q4 v2's passes with bf16 steps and 2-bit codes,
// four per byte (block_v2_codes.cuh). Bytes equal the CPU reference backend's (cpu_q2.cpp).
#include "v2/block_v2_run.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2)
    q2_encode_v2_kernel(const block::EncodeArgs a) {
  block::encode_body<Q2Codes, kIn, kRes, kSR, kAligned>(a);
}

template <uint8_t kOut, bool kPow2, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2)
    q2_decode_v2_kernel(const block::DecodeArgs a) {
  block::decode_body<Q2Codes, kOut, kPow2, kAligned>(a);
}

struct Q2Kernels {
  using Codes = Q2Codes;
  template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
  static void encode(const block::EncodeArgs& a, int grid, cudaStream_t stream) {
    q2_encode_v2_kernel<kIn, kRes, kSR, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  }
  template <uint8_t kOut, bool kPow2, bool kAligned>
  static void decode(const block::DecodeArgs& a, int grid, cudaStream_t stream) {
    q2_decode_v2_kernel<kOut, kPow2, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  }
};

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
