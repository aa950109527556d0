// Payload-level kernels: the body checksum summed in parallel (its terms add in any order), the
// sealing of encoded payloads, and the checks of received ones.
#include "launchers.h"
#include "payload_kernels.h"
#include "segment_io.cuh"

namespace gradcomp {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 256;

// Adds this thread's terms of words [0, words) of a body to *into, one atomic per warp.
__device__ __forceinline__ void add_body_sum(const uint8_t* body, uint64_t words,
                                             unsigned long long* into) {
  uint64_t local = 0;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    local += format::body_checksum_term(reinterpret_cast<const uint32_t*>(body)[i], i);
  }
  for (int offset = 16; offset > 0; offset >>= 1)
    local += __shfl_xor_sync(0xFFFFFFFFu, static_cast<unsigned long long>(local), offset);
  if ((threadIdx.x & 31) == 0 && local != 0)
    atomicAdd(into, static_cast<unsigned long long>(local));
}

__global__ void __launch_bounds__(kThreads) seal_sum_kernel(uint8_t* payload, uint64_t total) {
  add_body_sum(payload + kPayloadHeaderBytes, (total - kPayloadHeaderBytes) / 4,
               reinterpret_cast<unsigned long long*>(
                   payload + offsetof(format::PayloadHeader, body_checksum)));
}

__global__ void seal_header_kernel(uint8_t* payload) {
  const format::PayloadHeader h = format::read_header(payload);
  *reinterpret_cast<uint32_t*>(payload + offsetof(format::PayloadHeader, checksum)) =
      format::header_checksum(h);
}

__device__ __forceinline__ uint64_t numel_of(const int64_t* numel_each, int64_t numel, int w) {
  return static_cast<uint64_t>(numel_each != nullptr ? numel_each[w] : numel);
}

__global__ void __launch_bounds__(kThreads)
    body_sums_kernel(const uint8_t* const* payloads, const int64_t* numel_each, int64_t numel,
                     uint8_t codec, uint32_t param, uint8_t value_dtype, uint64_t available,
                     unsigned long long* sums) {
  const int w = blockIdx.y;
  const uint64_t total =
      format::expected_payload_bytes(codec, numel_of(numel_each, numel, w), param, value_dtype);
  if (total > available) return;  // the header check reports it as truncated
  add_body_sum(payloads[w] + kPayloadHeaderBytes, (total - kPayloadHeaderBytes) / 4, &sums[w]);
}

__global__ void check_payloads_kernel(const uint8_t* const* payloads, int n,
                                      const int64_t* numel_each, int64_t numel, uint8_t codec,
                                      uint32_t param, uint8_t value_dtype, uint64_t available,
                                      const unsigned long long* sums, int32_t* status) {
  for (int w = threadIdx.x; w < n; w += blockDim.x) {
    const format::PayloadHeader h = format::read_header(payloads[w]);
    int code = format::check_header(h, codec, numel_of(numel_each, numel, w), param, value_dtype,
                                    available);
    if (code == format::kPayloadOk && sums[w] != h.body_checksum) code = format::kBadBodyChecksum;
    set_status(status, code);
  }
}

unsigned blocks_for(uint64_t words) {
  const uint64_t b = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

}  // namespace

namespace detail {

cudaError_t launch_seal(uint8_t* payload, uint64_t total, cudaStream_t stream) {
  const uint64_t words = (total - kPayloadHeaderBytes) / 4;
  if (words > 0) {
    seal_sum_kernel<<<blocks_for(words), kThreads, 0, stream>>>(payload, total);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  seal_header_kernel<<<1, 1, 0, stream>>>(payload);
  return cudaGetLastError();
}

cudaError_t launch_payload_checks(const uint8_t* const* payloads, int n, const int64_t* numel_each,
                                  int64_t numel, uint8_t codec, uint32_t param, uint8_t value_dtype,
                                  uint64_t available, uint64_t* sums, int32_t* status,
                                  cudaStream_t stream) {
  auto* s = reinterpret_cast<unsigned long long*>(sums);
  const uint64_t words = (available - kPayloadHeaderBytes) / 4;
  body_sums_kernel<<<dim3(blocks_for(words), static_cast<unsigned>(n)), kThreads, 0, stream>>>(
      payloads, numel_each, numel, codec, param, value_dtype, available, s);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  check_payloads_kernel<<<1, 32, 0, stream>>>(payloads, n, numel_each, numel, codec, param,
                                              value_dtype, available, s, status);
  return cudaGetLastError();
}

}  // namespace detail

LaunchStatus run_check_payloads(const PayloadCheckParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  return launched(detail::launch_payload_checks(p.payloads, p.num_payloads, p.numel, 0, p.codec,
                                                p.param, p.value_dtype, p.payload_bytes,
                                                p.body_sums, p.status, stream));
}

}  // namespace kernels
}  // namespace gradcomp
