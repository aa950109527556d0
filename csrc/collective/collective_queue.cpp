// The collective queue: one thread running posted collectives in order, errors handed to waiters.
#include "collective_queue.h"

#if defined(__linux__)
#include <pthread.h>
#endif

#include <chrono>
#include <utility>

namespace gradcomp {
namespace detail {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

CollectiveQueue::~CollectiveQueue() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  posted_cv_.notify_all();
  thread_.join();
}

void CollectiveQueue::start(Carry carry) {
  if (thread_.joinable()) return;
  carry_ = std::move(carry);
  thread_ = std::thread([this] { run(); });
}

uint64_t CollectiveQueue::post(std::function<void()> collective) {
  if (!thread_.joinable()) {
    const auto t0 = std::chrono::steady_clock::now();
    struct Count {
      double& total;
      std::chrono::steady_clock::time_point t0;
      ~Count() { total += seconds_since(t0); }
    } count{blocked_seconds_, t0};
    collective();
    return 0;
  }
  std::function<void()> op = carry_ ? carry_(std::move(collective)) : std::move(collective);
  uint64_t ticket;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
    ticket = ++posted_;
  }
  posted_cv_.notify_one();
  return ticket;
}

void CollectiveQueue::wait(uint64_t ticket) {
  if (!thread_.joinable()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ >= ticket; });
  blocked_seconds_ += seconds_since(t0);
  if (error_ && error_ticket_ <= ticket) std::rethrow_exception(error_);
}

void CollectiveQueue::drain() noexcept {
  if (!thread_.joinable()) return;
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return done_ >= posted_; });
  error_ = nullptr;
  error_ticket_ = 0;
}

void CollectiveQueue::run() {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), "gradcomp-comm");
#endif
  for (;;) {
    std::function<void()> op;
    bool skip;
    {
      std::unique_lock<std::mutex> lock(mu_);
      posted_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
      skip = error_ != nullptr;
    }
    std::exception_ptr error;
    if (!skip) {
      try {
        op();
      } catch (...) {
        error = std::current_exception();
      }
    }
    op = nullptr;  // what it captured goes before the waiter learns it is done
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++done_;
      if (error && !error_) {
        error_ = std::move(error);
        error_ticket_ = done_;
      }
      // This thread's reference is dropped under the lock as well, so that whichever thread
      // destroys the exception is ordered after a waiter's reads of it by mu_, not only by
      // libstdc++'s reference count (atomic, but uninstrumented: ThreadSanitizer cannot see it).
      error = nullptr;
    }
    done_cv_.notify_all();
  }
}

}  // namespace detail
}  // namespace gradcomp
