// v2 payload checks: body checksums summed with 16-byte loads, four in flight a thread, and the
// headers checked by the last block to finish, so a check is one launch.
#include "v2/launchers_v2.h"
#include "v2/payload_v2.h"
#include "v2/span_io.cuh"

namespace gradcomp {
namespace kernels {
namespace v2 {
namespace {

constexpr int kLoadsInFlight = 4;
constexpr int kMaxCheckBlocks = 2048;  // ~15 blocks per SM of an H200: enough bytes in flight

struct CheckArgs {
  const uint8_t* const* payloads;
  int n;
  const int64_t* numel_each;  // device array, or null: every payload holds `numel`
  int64_t numel;
  uint8_t codec;
  uint32_t param;
  uint8_t value_dtype;
  uint64_t available;
  unsigned long long* sums;  // n sums, then the finished-block count
  int32_t* status;
};

__device__ __forceinline__ uint64_t numel_of(const CheckArgs& a, int w) {
  return static_cast<uint64_t>(a.numel_each != nullptr
                                   ? __ldg(reinterpret_cast<const long long*>(a.numel_each) + w)
                                   : a.numel);
}

__device__ __forceinline__ const uint8_t* payload_of(const CheckArgs& a, int w) {
  return reinterpret_cast<const uint8_t*>(
      __ldg(reinterpret_cast<const unsigned long long*>(a.payloads) + w));
}

__device__ __forceinline__ uint64_t terms_of(uint4 v, uint64_t word) {
  return format::body_checksum_term(v.x, word) + format::body_checksum_term(v.y, word + 1) +
         format::body_checksum_term(v.z, word + 2) + format::body_checksum_term(v.w, word + 3);
}

// The header through the read-only path in 4-byte words (a payload may sit at any 4-byte address).
__device__ __forceinline__ format::PayloadHeader load_header(const uint8_t* payload) {
  format::PayloadHeader h;
  uint32_t* words = reinterpret_cast<uint32_t*>(&h);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof h / 4); ++i)
    words[i] = __ldg(reinterpret_cast<const unsigned int*>(payload) + i);
  return h;
}

// blockIdx.y: the payload; blockIdx.x: a slice of its body, grid-strided in groups of four
// 16-byte loads a thread.
__global__ void __launch_bounds__(kThreadsPerBlock) check_payloads_v2_kernel(const CheckArgs a) {
  __shared__ bool last;
  const int w = blockIdx.y;
  const uint8_t* payload = payload_of(a, w);
  const uint64_t total =
      format::expected_payload_bytes(a.codec, numel_of(a, w), a.param, a.value_dtype);
  uint64_t local = 0;
  if (total <= a.available && (reinterpret_cast<uintptr_t>(payload) & 15) != 0) {
    // A payload at a 4-byte address (callers' own buffers): 4-byte loads, same sum.
    const uint32_t* body = reinterpret_cast<const uint32_t*>(payload + kPayloadHeaderBytes);
    const uint64_t words = (total - kPayloadHeaderBytes) / 4;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreadsPerBlock;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x; i < words;
         i += stride)
      local += format::body_checksum_term(__ldcs(body + i), i);
  } else if (total <= a.available) {  // a truncated payload is reported by its header check
    const uint4* body = reinterpret_cast<const uint4*>(payload + kPayloadHeaderBytes);
    const uint64_t vectors = (total - kPayloadHeaderBytes) / 16;
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * kThreadsPerBlock;
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * kThreadsPerBlock + threadIdx.x;
         i < vectors; i += stride * kLoadsInFlight) {
      uint4 v[kLoadsInFlight];
#pragma unroll
      for (int k = 0; k < kLoadsInFlight; ++k)
        v[k] = i + k * stride < vectors ? __ldcs(body + i + k * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int k = 0; k < kLoadsInFlight; ++k) local += terms_of(v[k], 4 * (i + k * stride));
    }
  }
  local = warp_sum(local);
  if ((threadIdx.x & 31) == 0 && local != 0) atomicAdd(&a.sums[w], local);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long blocks = static_cast<unsigned long long>(gridDim.x) * gridDim.y;
    last = atomicAdd(&a.sums[a.n], 1ull) == blocks - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int p = threadIdx.x; p < a.n; p += kThreadsPerBlock) {
    const format::PayloadHeader h = load_header(payload_of(a, p));
    int code =
        format::check_header(h, a.codec, numel_of(a, p), a.param, a.value_dtype, a.available);
    if (code == format::kPayloadOk && atomicAdd(&a.sums[p], 0ull) != h.body_checksum)
      code = format::kBadBodyChecksum;
    if (code != 0) atomicCAS(a.status, 0, code);
  }
}

}  // namespace

cudaError_t launch_checks(const uint8_t* const* payloads, int n, const int64_t* numel_each,
                          int64_t numel, uint8_t codec, uint32_t param, uint8_t value_dtype,
                          uint64_t available, uint64_t* sums, int32_t* status,
                          cudaStream_t stream) {
  CheckArgs a{payloads,    n,         numel_each,
              numel,       codec,     param,
              value_dtype, available, reinterpret_cast<unsigned long long*>(sums),
              status};
  const uint64_t vectors =
      available > kPayloadHeaderBytes ? (available - kPayloadHeaderBytes) / 16 : 0;
  const uint64_t per_block = static_cast<uint64_t>(kThreadsPerBlock) * kLoadsInFlight;
  uint64_t x = (vectors + per_block - 1) / per_block;
  const uint64_t cap = static_cast<uint64_t>(kMaxCheckBlocks / (n > 0 ? n : 1));
  x = x < 1 ? 1 : (x > cap ? (cap < 1 ? 1 : cap) : x);
  check_payloads_v2_kernel<<<dim3(static_cast<unsigned>(x), static_cast<unsigned>(n)),
                             kThreadsPerBlock, 0, stream>>>(a);
  return cudaGetLastError();
}

LaunchStatus run_check_payloads(const PayloadCheckParams& p, cudaStream_t stream) {
  LaunchStatus s;
  if ((s.rejected = params_problem(p)) != nullptr) return s;
  if (p.status == nullptr || p.body_sums == nullptr) {
    s.rejected = "no device status word or body-sum words";
    return s;
  }
  return launched(launch_checks(p.payloads, p.num_payloads, p.numel, 0, p.codec, p.param,
                                p.value_dtype, p.payload_bytes, p.body_sums, p.status, stream));
}

}  // namespace v2
}  // namespace kernels
}  // namespace gradcomp
