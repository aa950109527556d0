// In-process multi-rank transport: W threads exchange host buffers through shared slots.
#include "gradcomp/inprocess_group.h"

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

namespace gradcomp {

struct InProcessGroup::Shared {
  explicit Shared(int w, double timeout) : world(w), timeout_s(timeout), send(w), bytes(w), op(w) {}
  int world;
  double timeout_s;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  std::vector<const void*> send;
  std::vector<size_t> bytes;
  std::vector<int> op;

  // Waits until every rank reached this point; names the missing ranks after the timeout.
  void barrier(int rank, const char* what) {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (++arrived == world) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(timeout_s));
    if (!cv.wait_until(lock, deadline, [&] { return generation != gen; })) {
      GRADCOMP_CHECK(false, "in-process " << what << ": rank " << rank << " waited " << timeout_s
                                          << " s; only " << arrived << " of " << world
                                          << " ranks arrived");
    }
  }
};

namespace {

enum Op { kAllToAll = 1, kAllGather = 2, kAllreduce = 3, kReduceScatter = 4 };

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup::Shared> shared, int rank)
      : shared_(std::move(shared)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return shared_->world; }
  bool device_memory() const override { return false; }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes_per_rank) override {
    exchange(kAllToAll, "all_to_all", send, recv, bytes_per_rank);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes_per_rank) override {
    exchange(kAllGather, "all_gather", send, recv, bytes_per_rank);
  }
  // Every rank scales each rank's values by 1/W in fp32 and sums them in rank order, so all ranks
  // end with the same values.
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override {
    post(kAllreduce, "allreduce", data, static_cast<size_t>(numel) * dtype_size(dtype));
    const std::vector<float> sum = mean_of_slice(0, numel, dtype);
    // Nobody may overwrite its values before every rank has read them.
    shared_->barrier(rank_, "allreduce");
    store(data, sum, dtype);
    shared_->barrier(rank_, "allreduce");
  }
  // The same arithmetic on slice rank() of every rank's send.
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t numel_per_rank,
                               DType dtype) override {
    post(kReduceScatter, "reduce_scatter", send,
         static_cast<size_t>(numel_per_rank) * dtype_size(dtype));
    store(recv, mean_of_slice(numel_per_rank * rank_, numel_per_rank, dtype), dtype);
    shared_->barrier(rank_, "reduce_scatter");
  }

 private:
  std::vector<float> mean_of_slice(int64_t begin, int64_t numel, DType dtype) const {
    const auto& s = *shared_;
    const uint8_t code = static_cast<uint8_t>(dtype);
    const float scale = 1.0f / static_cast<float>(s.world);
    std::vector<float> sum(static_cast<size_t>(numel), 0.0f);
    for (int w = 0; w < s.world; ++w) {
      for (int64_t i = 0; i < numel; ++i)
        sum[i] = math::add_rn(sum[i],
                              math::mul_rn(math::load_as_float(s.send[w], begin + i, code), scale));
    }
    return sum;
  }
  static void store(void* data, const std::vector<float>& values, DType dtype) {
    const uint8_t code = static_cast<uint8_t>(dtype);
    for (size_t i = 0; i < values.size(); ++i)
      math::store_from_float(data, static_cast<int64_t>(i), code, values[i]);
  }

  // Publishes this rank's buffer and waits for every rank's, checking they match.
  void post(int op, const char* what, const void* send, size_t bytes) {
    auto& s = *shared_;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.send[rank_] = send;
      s.bytes[rank_] = bytes;
      s.op[rank_] = op;
    }
    s.barrier(rank_, what);
    for (int w = 0; w < s.world; ++w) {
      GRADCOMP_CHECK(s.op[w] == op && s.bytes[w] == bytes,
                     "in-process " << what << ": rank " << rank_ << " posted " << bytes
                                   << " bytes but rank " << w << " posted " << s.bytes[w]
                                   << (s.op[w] == op ? "" : " to a different collective"));
    }
  }

  void exchange(int op, const char* what, const void* send, void* recv, size_t bytes) {
    auto& s = *shared_;
    post(op, what, send, bytes);
    for (int w = 0; w < s.world; ++w) {
      const char* src = static_cast<const char*>(s.send[w]);
      if (op == kAllToAll) src += bytes * static_cast<size_t>(rank_);
      if (bytes > 0)
        std::memcpy(static_cast<char*>(recv) + bytes * static_cast<size_t>(w), src, bytes);
    }
    // Nobody may reuse its send buffer before every rank has copied out of it.
    s.barrier(rank_, what);
  }

  std::shared_ptr<InProcessGroup::Shared> shared_;
  int rank_;
};

}  // namespace

InProcessGroup::InProcessGroup(int world_size, double timeout_seconds) {
  GRADCOMP_CHECK(world_size >= 1, "in-process group needs world_size >= 1, got " << world_size);
  shared_ = std::make_shared<Shared>(world_size, timeout_seconds);
  for (int r = 0; r < world_size; ++r)
    comms_.push_back(std::make_unique<InProcessCommunicator>(shared_, r));
}

InProcessGroup::~InProcessGroup() = default;

Communicator& InProcessGroup::communicator(int rank) {
  GRADCOMP_CHECK(rank >= 0 && rank < world_size(), "rank " << rank << " outside the group");
  return *comms_[rank];
}

int InProcessGroup::world_size() const {
  return shared_->world;
}

}  // namespace gradcomp
