// The collective queue on its own: posted order, errors handed to waiters, drain, blocked time.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "collective_queue.h"

namespace gradcomp {
namespace detail {
namespace {

TEST(CollectiveQueue, RunsCollectivesInPostedOrderOffThePostingThread) {
  CollectiveQueue queue;
  queue.start(nullptr);
  ASSERT_TRUE(queue.threaded());
  std::vector<int> order;  // written by the queue's thread only, read after wait()
  const std::thread::id poster = std::this_thread::get_id();
  std::atomic<bool> off_thread{true};
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 50; ++i) {
    tickets.push_back(queue.post([&, i] {
      if (std::this_thread::get_id() == poster) off_thread = false;
      if (i % 7 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      order.push_back(i);
    }));
  }
  queue.wait(tickets.back());
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
  EXPECT_TRUE(off_thread);
  EXPECT_GT(queue.blocked_seconds(), 0.0);
}

TEST(CollectiveQueue, AFailureStopsLaterCollectivesUntilDrainedAndWaitersGetIt) {
  CollectiveQueue queue;
  int carried = 0;
  queue.start([&](std::function<void()> f) {
    ++carried;  // on the posting thread
    return f;
  });
  std::atomic<int> ran{0};
  const uint64_t first = queue.post([&] { ++ran; });
  const uint64_t failing = queue.post([] { throw std::runtime_error("wire cut"); });
  const uint64_t later = queue.post([&] { ++ran; });
  queue.wait(first);  // finished before the failure: no error
  EXPECT_THROW(queue.wait(failing), std::runtime_error);
  try {
    queue.wait(later);
    ADD_FAILURE() << "a collective after the failure reported success";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "wire cut");
  }
  EXPECT_EQ(ran.load(), 1) << "the collective after the failure ran";
  queue.drain();
  const uint64_t again = queue.post([&] { ++ran; });
  queue.wait(again);  // the error is forgotten once drained
  EXPECT_EQ(ran.load(), 2);
  EXPECT_EQ(carried, 4);
}

TEST(CollectiveQueue, WithoutAThreadPostRunsAtOnceAndThrowsThere) {
  CollectiveQueue queue;
  EXPECT_FALSE(queue.threaded());
  int ran = 0;
  queue.wait(queue.post([&] { ++ran; }));
  EXPECT_EQ(ran, 1);
  EXPECT_THROW(queue.post([] { throw std::runtime_error("at once"); }), std::runtime_error);
  queue.drain();
}

TEST(CollectiveQueue, DestructionFinishesWhatWasPosted) {
  std::atomic<int> ran{0};
  {
    CollectiveQueue queue;
    queue.start(nullptr);
    for (int i = 0; i < 10; ++i)
      queue.post([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
      });
  }
  EXPECT_EQ(ran.load(), 10);
}

}  // namespace
}  // namespace detail
}  // namespace gradcomp
