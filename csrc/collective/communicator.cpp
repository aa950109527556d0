// The counting and timing every transport shares, and the ring-allreduce byte formula.
#include "gradcomp/communicator.h"

#include <chrono>
#include <cstring>
#include <vector>

namespace gradcomp {
namespace {

// Adds the seconds of its scope to a counter.
class ScopedSeconds {
 public:
  explicit ScopedSeconds(std::atomic<double>& total)
      : total_(total), t0_(std::chrono::steady_clock::now()) {}
  ~ScopedSeconds() {
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    total_.store(total_.load(std::memory_order_relaxed) + dt, std::memory_order_relaxed);
  }

 private:
  std::atomic<double>& total_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace

uint64_t ring_allreduce_bytes(int64_t numel, DType dtype, int world) {
  return static_cast<uint64_t>(2.0 * (world - 1) / world * static_cast<double>(numel) *
                               static_cast<double>(dtype_size(dtype)));
}

uint64_t reduce_scatter_bytes(int64_t numel_per_rank, DType dtype, int world) {
  return static_cast<uint64_t>(world - 1) * static_cast<uint64_t>(numel_per_rank) *
         dtype_size(dtype);
}

// Runs one collective of the transport; its failure (a dead peer, a timeout) becomes an Error
// naming the collective, its size and this rank.
template <typename F>
void Communicator::run(const char* collective, uint64_t bytes, F&& f) {
  ScopedSeconds timed(seconds_);
  try {
    f();
  } catch (const std::exception& e) {
    GRADCOMP_CHECK(false, collective << " of " << bytes << " bytes on rank " << rank() << " of "
                                     << world_size() << " failed: " << e.what());
  }
}

void Communicator::count_bytes(uint64_t bytes) {
  bytes_sent_.store(bytes_sent_.load(std::memory_order_relaxed) + bytes, std::memory_order_relaxed);
}

void Communicator::all_to_all(const void* send, void* recv, size_t bytes_per_rank) {
  run("all_to_all", bytes_per_rank * world_size(),
      [&] { run_all_to_all(send, recv, bytes_per_rank); });
  count_bytes(bytes_per_rank * static_cast<uint64_t>(world_size() - 1));
}

void Communicator::all_gather(const void* send, void* recv, size_t bytes_per_rank) {
  run("all_gather", bytes_per_rank, [&] { run_all_gather(send, recv, bytes_per_rank); });
  count_bytes(bytes_per_rank * static_cast<uint64_t>(world_size() - 1));
}

void Communicator::allreduce_mean(void* data, int64_t numel, DType dtype) {
  run("allreduce", static_cast<uint64_t>(numel) * dtype_size(dtype),
      [&] { run_allreduce_mean(data, numel, dtype); });
  count_bytes(ring_allreduce_bytes(numel, dtype, world_size()));
}

void Communicator::reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                                       DType dtype) {
  run("reduce_scatter", static_cast<uint64_t>(numel_per_rank) * dtype_size(dtype) * world_size(),
      [&] { run_reduce_scatter_mean(send, recv, numel_per_rank, dtype); });
  count_bytes(reduce_scatter_bytes(numel_per_rank, dtype, world_size()));
}

void Communicator::reduce_scatter_mean_strided(const void* send, int64_t send_stride, void* recv,
                                               int64_t numel_per_rank, DType dtype) {
  GRADCOMP_CHECK(send_stride >= numel_per_rank, "reduce_scatter stride "
                                                    << send_stride << " is shorter than a slice of "
                                                    << numel_per_rank << " elements");
  run("reduce_scatter", static_cast<uint64_t>(numel_per_rank) * dtype_size(dtype) * world_size(),
      [&] { run_reduce_scatter_mean_strided(send, send_stride, recv, numel_per_rank, dtype); });
  count_bytes(reduce_scatter_bytes(numel_per_rank, dtype, world_size()));
}

void Communicator::all_gather_strided(const void* send, void* recv, size_t bytes_per_rank,
                                      size_t recv_stride) {
  GRADCOMP_CHECK(recv_stride >= bytes_per_rank, "all_gather stride "
                                                    << recv_stride << " is shorter than a slice of "
                                                    << bytes_per_rank << " bytes");
  run("all_gather", bytes_per_rank,
      [&] { run_all_gather_strided(send, recv, bytes_per_rank, recv_stride); });
  count_bytes(bytes_per_rank * static_cast<uint64_t>(world_size() - 1));
}

void Communicator::run_reduce_scatter_mean_strided(const void* send, int64_t send_stride,
                                                   void* recv, int64_t numel_per_rank,
                                                   DType dtype) {
  GRADCOMP_CHECK(!device_memory(), "this transport has no strided reduce_scatter on device memory");
  const size_t slice = static_cast<size_t>(numel_per_rank) * dtype_size(dtype);
  const size_t stride = static_cast<size_t>(send_stride) * dtype_size(dtype);
  std::vector<uint8_t> packed(slice * static_cast<size_t>(world_size()));
  for (int w = 0; w < world_size(); ++w) {
    std::memcpy(packed.data() + slice * w, static_cast<const uint8_t*>(send) + stride * w, slice);
  }
  run_reduce_scatter_mean(packed.data(), recv, numel_per_rank, dtype);
}

void Communicator::run_all_gather_strided(const void* send, void* recv, size_t bytes_per_rank,
                                          size_t recv_stride) {
  GRADCOMP_CHECK(!device_memory(), "this transport has no strided all_gather on device memory");
  std::vector<uint8_t> packed(bytes_per_rank * static_cast<size_t>(world_size()));
  run_all_gather(send, packed.data(), bytes_per_rank);
  for (int w = 0; w < world_size(); ++w) {
    std::memcpy(static_cast<uint8_t*>(recv) + recv_stride * w, packed.data() + bytes_per_rank * w,
                bytes_per_rank);
  }
}

}  // namespace gradcomp
