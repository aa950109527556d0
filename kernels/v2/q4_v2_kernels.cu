// q4 v2 kernels: encode with error feedback and the body checksum in one pass, sealed by the last
// block; decode-and-mean of W payloads with 512-byte warp stores. Bytes equal the CPU's.
#include "v2/block_v2_run.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2)
    q4_encode_v2_kernel(const block::EncodeArgs a) {
  block::encode_body<Q4Codes, kIn, kRes, kSR, kAligned>(a);
}

template <uint8_t kOut, bool kPow2, bool kAligned>
__global__ void __launch_bounds__(kThreadsPerBlock, 2)
    q4_decode_v2_kernel(const block::DecodeArgs a) {
  block::decode_body<Q4Codes, kOut, kPow2, kAligned>(a);
}

struct Q4Kernels {
  using Codes = Q4Codes;
  template <uint8_t kIn, uint8_t kRes, bool kSR, bool kAligned>
  static void encode(const block::EncodeArgs& a, int grid, cudaStream_t stream) {
    q4_encode_v2_kernel<kIn, kRes, kSR, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  }
  template <uint8_t kOut, bool kPow2, bool kAligned>
  static void decode(const block::DecodeArgs& a, int grid, cudaStream_t stream) {
    q4_decode_v2_kernel<kOut, kPow2, kAligned><<<grid, kThreadsPerBlock, 0, stream>>>(a);
  }
};

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
