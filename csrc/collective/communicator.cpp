// The counting and timing every transport shares, and the ring-allreduce byte formula.
#include "gradcomp/communicator.h"

#include <chrono>

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

}  // namespace gradcomp
