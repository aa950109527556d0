// Where the engine's worker runs: the request's parsing, the "auto" rule, and real threads let
// off the one core that OpenMP bound the binding thread to.
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/engine.h"
#include "gradcomp/inprocess_group.h"
#include "worker_cpus.h"

namespace gradcomp {
namespace {

using detail::choose_auto_cpus;
using detail::CpuRequest;
using detail::parse_cpu_request;

TEST(WorkerCpus, RequestsAreAutoInheritOrACpuList) {
  EXPECT_EQ(parse_cpu_request("auto").kind, CpuRequest::Kind::kAuto);
  EXPECT_EQ(parse_cpu_request(" Inherit ").kind, CpuRequest::Kind::kInherit);
  const CpuRequest list = parse_cpu_request("5,0-2, 2");
  EXPECT_EQ(list.kind, CpuRequest::Kind::kList);
  EXPECT_EQ(list.cpus, (std::vector<int>{0, 1, 2, 5}));
  EXPECT_EQ(detail::format_cpu_list(list.cpus), "0-2,5");
  for (const char* bad : {"", "x", "1,", "3-1", "-1", "1-", "99999", "0;1", "auto,1"}) {
    try {
      parse_cpu_request(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("worker_cpus"), std::string::npos) << e.what();
    }
  }
  EngineOptions o;
  o.worker_cpus = "two";
  EXPECT_THROW(BucketEngine{o}, Error);
  EXPECT_THROW(check_worker_cpus("0-"), Error);
  check_worker_cpus("auto");
}

TEST(WorkerCpus, AutoMovesTheWorkerOnlyOffACoreOpenMpBound) {
  std::string why;
  // Free to run on several cores: the scheduler finds an idle one.
  EXPECT_TRUE(choose_auto_cpus({0, 1, 2, 3}, false, true, {0, 1, 2, 3}, {}, &why).empty());
  EXPECT_NE(why.find("may run on CPUs 0-3"), std::string::npos) << why;
  // Bound to one CPU by taskset or numactl: the user's placement stands.
  EXPECT_TRUE(choose_auto_cpus({2}, true, false, {0, 1, 2, 3}, {2}, &why).empty());
  EXPECT_NE(why.find("process's own mask"), std::string::npos) << why;
  // Bound by OpenMP: its own CPU and every allowed one no thread is bound to.
  EXPECT_EQ(choose_auto_cpus({0}, true, true, {0, 1, 2, 3, 4, 5}, {0, 1, 4}, &why),
            (std::vector<int>{0, 2, 3, 5}));
  EXPECT_NE(why.find("runs on CPUs 0,2-3,5"), std::string::npos) << why;
  // ... to one core of two hyperthreads (OMP_PLACES=cores): the same, core for core.
  EXPECT_EQ(choose_auto_cpus({0, 4}, true, true, {0, 1, 2, 3, 4, 5, 6, 7}, {0, 1, 4, 5}, &why),
            (std::vector<int>{0, 2, 3, 4, 6, 7}));
  // ... and when every CPU is taken, it shares the binding thread's.
  EXPECT_TRUE(choose_auto_cpus({1}, true, true, {0, 1}, {0, 1}, &why).empty());
  EXPECT_NE(why.find("every other CPU"), std::string::npos) << why;
}

// The CPUs the worker ran a bucket's completion on.
std::vector<int> cpus_seen_by_worker(BucketEngine& engine) {
  std::vector<float> data(100, 1.0f);
  BucketRequest r;
  r.data = data.data();
  r.numel = 100;
  r.identity = 1;
  r.is_last = true;
  std::promise<std::vector<int>> seen;
  engine.submit(r, [&](std::exception_ptr) { seen.set_value(detail::current_thread_cpus()); });
  return seen.get_future().get();
}

// Pins the calling thread to CPU 0 and sets an OpenMP variable for the test's length.
class PinnedToCpu0 : public ::testing::Test {
 protected:
  void SetUp() override {
    CPU_ZERO(&saved_);
    ASSERT_EQ(sched_getaffinity(0, sizeof saved_, &saved_), 0);
    if (CPU_COUNT(&saved_) < 2 || !CPU_ISSET(0, &saved_) || !CPU_ISSET(1, &saved_))
      GTEST_SKIP() << "needs CPUs 0 and 1";
    cpu_set_t zero;
    CPU_ZERO(&zero);
    CPU_SET(0, &zero);
    ASSERT_EQ(sched_setaffinity(0, sizeof zero, &zero), 0);
    pinned_ = true;
  }
  void TearDown() override {
    unsetenv("OMP_PROC_BIND");
    if (pinned_) sched_setaffinity(0, sizeof saved_, &saved_);
  }
  cpu_set_t saved_;
  bool pinned_ = false;
};

TEST_F(PinnedToCpu0, UnderOpenMpBindingAutoLetsTheWorkerRunOnTheFreeCpusToo) {
  setenv("OMP_PROC_BIND", "true", 1);
  InProcessGroup group(1);
  EngineOptions o;
  o.compress = false;
  BucketEngine engine(o);
  engine.bind(group.communicator(0), nullptr);
  const std::vector<int> cpus = engine.worker_cpus();
  ASSERT_GE(cpus.size(), 2u) << engine.worker_placement();
  EXPECT_EQ(cpus[0], 0) << engine.worker_placement();
  EXPECT_EQ(cpus[1], 1) << engine.worker_placement();
  EXPECT_NE(engine.worker_placement().find("OpenMP bound the binding thread to CPU 0"),
            std::string::npos)
      << engine.worker_placement();
  EXPECT_EQ(cpus_seen_by_worker(engine), cpus);
}

TEST_F(PinnedToCpu0, WithoutOpenMpOrWhenAskedTheWorkerKeepsTheBinding) {
  for (const char* request : {"auto", "inherit"}) {
    InProcessGroup group(1);
    EngineOptions o;
    o.compress = false;
    o.worker_cpus = request;
    BucketEngine engine(o);
    engine.bind(group.communicator(0), nullptr);
    EXPECT_EQ(engine.worker_cpus(), std::vector<int>{0}) << request;
    EXPECT_EQ(cpus_seen_by_worker(engine), std::vector<int>{0}) << request;
  }
}

TEST_F(PinnedToCpu0, AListIsObeyedAndACpuTheProcessLacksIsRefused) {
  InProcessGroup group(1);
  EngineOptions o;
  o.compress = false;
  o.worker_cpus = "1";
  BucketEngine engine(o);
  engine.bind(group.communicator(0), nullptr);
  EXPECT_EQ(engine.worker_cpus(), std::vector<int>{1});
  EXPECT_EQ(cpus_seen_by_worker(engine), std::vector<int>{1});
  EXPECT_EQ(engine.worker_placement(), "CPUs 1, as asked");

  InProcessGroup other(1);
  o.worker_cpus = "1000";
  BucketEngine refused(o);
  try {
    refused.bind(other.communicator(0), nullptr);
    ADD_FAILURE() << "CPU 1000 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CPU 1000 is not available to this process"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
