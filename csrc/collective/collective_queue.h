// Runs a reduction's collectives in the order they were posted, on a thread of their own.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace gradcomp {
namespace detail {

// The codec posts a piece's collective and encodes the next piece while it is on the wire. Every
// rank posts the same collectives in the same order, and one thread runs them in that order, so
// the ranks' collectives still match one for one. Without a thread (start() not called) post()
// runs the collective at once on the caller's thread, as a reduction without pieces does.
class CollectiveQueue {
 public:
  // Wraps a posted collective on the posting thread (carrying its context, such as the
  // profiler's state) and returns what the queue's thread runs.
  using Carry = std::function<std::function<void()>(std::function<void()>)>;

  CollectiveQueue() = default;
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  void start(Carry carry);
  bool threaded() const { return thread_.joinable(); }

  // Returns a ticket for wait(). A collective that fails makes every later one fail with its
  // error, unrun, until the queue is drained.
  uint64_t post(std::function<void()> collective);
  // Waits for a posted collective; rethrows its error (or the earlier one that stopped it).
  void wait(uint64_t ticket);
  // Waits for everything posted, forgets any error: the buffers the collectives use are free.
  void drain() noexcept;
  // Time the posting thread spent in wait() and in collectives run at once (its blocked time).
  double blocked_seconds() const { return blocked_seconds_; }

 private:
  void run();

  Carry carry_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable posted_cv_, done_cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t posted_ = 0, done_ = 0;  // tickets are 1, 2, ...; all up to done_ have finished
  std::exception_ptr error_;
  uint64_t error_ticket_ = 0;
  bool stopping_ = false;
  double blocked_seconds_ = 0;
};

}  // namespace detail
}  // namespace gradcomp
