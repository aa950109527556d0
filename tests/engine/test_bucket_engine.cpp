// The bucket engine without torch: scheduling on its worker, steps and stats, the plain path,
// the release of unused buckets, checkpoints and the remapping of restored layouts, errors.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <thread>

#include "gradcomp/engine.h"
#include "gradcomp/inprocess_group.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

// Runs fn(rank) on one thread per rank; rethrows the first failure.
void on_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> failures(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        failures[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& f : failures)
    if (f) std::rethrow_exception(f);
}

EngineOptions q4_options(uint64_t seed = 3) {
  EngineOptions o;
  o.config.seed = seed;
  return o;
}

std::vector<float> gradient(int64_t n, uint32_t step, int rank, uint32_t salt = 0) {
  return testing::normal_floats(n, 1000 * step + 10 * rank + salt, 1.0f + rank);
}

// Submits a bucket and waits for its callback; returns the error it reported.
std::exception_ptr submit_and_wait(BucketEngine& engine, BucketRequest r) {
  std::promise<std::exception_ptr> done;
  engine.submit(std::move(r), [&](std::exception_ptr e) { done.set_value(std::move(e)); });
  return done.get_future().get();
}

BucketRequest request(std::vector<float>& data, int64_t index, uint64_t identity, bool is_last) {
  BucketRequest r;
  r.data = data.data();
  r.numel = static_cast<int64_t>(data.size());
  r.index = index;
  r.identity = identity;
  r.is_last = is_last;
  return r;
}

TEST(BucketEngine, WorkerReductionsEqualTheCollectiveAndRunOffTheSubmittingThread) {
  const int world = 3;
  InProcessGroup engine_group(world), direct_group(world);
  on_ranks(world, [&](int rank) {
    auto backend = make_cpu_backend(), direct_backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(engine_group.communicator(rank), backend.get());
    CompressedAllreduce direct(direct_group.communicator(rank), *direct_backend,
                               q4_options().config);
    const std::thread::id submitter = std::this_thread::get_id();
    for (uint32_t step = 0; step < 3; ++step) {
      for (int64_t index = 0; index < 2; ++index) {
        std::vector<float> a = gradient(777 + index, step, rank, index), b = a;
        std::thread::id reducer;
        std::promise<void> done;
        BucketRequest r = request(a, index, 40 + index, index == 1);
        engine.submit(r, [&](std::exception_ptr e) {
          reducer = std::this_thread::get_id();
          EXPECT_FALSE(e);
          done.set_value();
        });
        done.get_future().get();
        Segment seg{b.data(), 0, static_cast<int64_t>(b.size())};
        ASSERT_TRUE(direct.allreduce(&seg, 1, DType::kFloat32, 40 + index));
        EXPECT_NE(reducer, submitter);
        ASSERT_EQ(a, b) << "rank " << rank << " step " << step << " bucket " << index;
      }
      direct.advance_step();
    }
    // Bucket 0 arriving again started steps 1 and 2.
    EXPECT_EQ(engine.state().compression.step, 2u);
    EXPECT_TRUE(engine.started());
  });
}

TEST(BucketEngine, StatsCountBucketsBytesAndTheRingFormulaPerStep) {
  const int world = 2;
  InProcessGroup group(world);
  on_ranks(world, [&](int rank) {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(group.communicator(rank), backend.get());
    for (uint32_t step = 0; step < 2; ++step) {
      std::vector<float> a = gradient(5000, step, rank), b = gradient(3000, step, rank, 1);
      engine.reduce(request(a, 0, 1, false));
      engine.reduce(request(b, 1, 2, true));
    }
    const ReductionStats step = engine.last_step_stats(), total = engine.total_stats();
    EXPECT_EQ(step.buckets, 2u);
    EXPECT_EQ(total.buckets, 4u);
    EXPECT_EQ(total.compressed_buckets, 4u);
    const CompressionConfig c = q4_options().config;
    EXPECT_EQ(step.bytes_sent, compressed_allreduce_bytes_sent(c, 5000, world) +
                                   compressed_allreduce_bytes_sent(c, 3000, world));
    EXPECT_EQ(step.uncompressed_bytes, ring_allreduce_bytes(5000, DType::kFloat32, world) +
                                           ring_allreduce_bytes(3000, DType::kFloat32, world));
    EXPECT_GE(step.codec_seconds, 0.0);
    EXPECT_GT(step.comm_seconds, 0.0);
    EXPECT_EQ(step.nonfinite_buckets, 0u);
  });
}

TEST(BucketEngine, OneRankRunsTheCodecOnEveryBucketAndSendsNothing) {
  // What a one-GPU job's stats say: every bucket compressed and decoded, nothing on a wire.
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  BucketEngine engine(q4_options());
  engine.bind(group.communicator(0), backend.get());
  for (uint32_t step = 0; step < 2; ++step) {
    std::vector<float> a = gradient(5000, step, 0), b = gradient(3000, step, 0, 1);
    const std::vector<float> a0 = a;
    engine.reduce(request(a, 0, 1, false));
    engine.reduce(request(b, 1, 2, true));
    EXPECT_NE(a, a0) << "one rank's bucket still goes through q4's rounding";
  }
  const ReductionStats total = engine.total_stats();
  EXPECT_EQ(total.buckets, 4u);
  EXPECT_EQ(total.compressed_buckets, 4u);
  EXPECT_EQ(total.bytes_sent, 0u);
  EXPECT_EQ(total.uncompressed_bytes, 0u);
}

TEST(BucketEngine, StatsReadWhileTheEngineBindsAreNotARace) {
  // A metrics scrape may run while the first bucket binds the engine (the DDP hook binds there,
  // with the GIL released): the ThreadSanitizer stage of scripts/test_all.sh checks this one.
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  BucketEngine engine(q4_options());
  std::atomic<bool> done{false};
  std::atomic<uint64_t> reads{0};
  std::thread scraper([&] {
    while (!done.load()) {
      engine.total_stats();
      engine.last_step_stats();
      ++reads;
    }
  });
  while (reads.load() == 0) std::this_thread::yield();  // a read before the bind, unordered
  engine.bind(group.communicator(0), backend.get());
  std::vector<float> a = gradient(5000, 0, 0);
  engine.reduce(request(a, 0, 1, true));
  done = true;
  scraper.join();
  EXPECT_EQ(engine.total_stats().buckets, 1u);
  EXPECT_GT(engine.total_stats().residual_bytes, 0u);
}

TEST(BucketEngine, UncompressedPathAveragesAndCountsTheRing) {
  const int world = 4;
  InProcessGroup group(world);
  std::vector<std::vector<float>> inputs(world), outputs(world);
  for (int r = 0; r < world; ++r) inputs[r] = gradient(1001, 0, r);
  on_ranks(world, [&](int rank) {
    EngineOptions o;
    o.compress = false;
    BucketEngine engine(o);
    engine.bind(group.communicator(rank), nullptr);
    outputs[rank] = inputs[rank];
    ASSERT_FALSE(submit_and_wait(engine, request(outputs[rank], 0, 9, true)));
    EXPECT_EQ(engine.total_stats().bytes_sent, ring_allreduce_bytes(1001, DType::kFloat32, world));
    EXPECT_EQ(engine.total_stats().buckets, 1u);
    EXPECT_EQ(engine.total_stats().compressed_buckets, 0u);
    EXPECT_TRUE(engine.state().compression.residuals.empty());
  });
  for (int64_t i = 0; i < 1001; ++i) {
    float expect = 0.0f;
    for (int r = 0; r < world; ++r) expect += inputs[r][i] * 0.25f;
    for (int r = 0; r < world; ++r) ASSERT_EQ(outputs[r][i], expect) << "rank " << r << " " << i;
  }
}

TEST(BucketEngine, BucketsAFrontEndStopsUsingAreReleased) {
  const int world = 2;
  InProcessGroup group(world);
  on_ranks(world, [&](int rank) {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(group.communicator(rank), backend.get());
    std::vector<float> whole = gradient(900, 0, rank);
    engine.reduce(request(whole, 0, 100, true));  // the first iteration's one bucket
    EXPECT_EQ(engine.state().compression.residuals.count(100), 1u);
    for (uint32_t step = 1; step < 3; ++step) {
      std::vector<float> a = gradient(400, step, rank), b = gradient(500, step, rank, 1);
      engine.reduce(request(a, 0, 200, false));
      engine.reduce(request(b, 1, 201, true));
    }
    const EngineState s = engine.state();
    ASSERT_EQ(s.compression.residuals.size(), 2u);
    EXPECT_EQ(s.compression.residuals.count(200), 1u);
    EXPECT_EQ(s.compression.residuals.count(201), 1u);
  });
}

TEST(BucketEngine, ErrorsReachTheCallbackOrTheCaller) {
  const int world = 2;
  InProcessGroup group(world, 5.0);
  std::vector<std::string> errors(world);
  on_ranks(world, [&](int rank) {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(group.communicator(rank), backend.get());
    std::vector<float> a = gradient(rank == 1 ? 1064 : 1000, 0, rank);
    std::exception_ptr e = submit_and_wait(engine, request(a, 0, 5, true));
    ASSERT_TRUE(e) << "rank " << rank << ": mismatched layouts accepted";
    try {
      std::rethrow_exception(e);
    } catch (const Error& error) {
      errors[rank] = error.what();
    }
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("layout mismatch"), std::string::npos) << e;

  BucketEngine unbound(q4_options());
  std::vector<float> a(10);
  EXPECT_THROW(unbound.reduce(request(a, 0, 1, true)), Error);
  EXPECT_THROW(unbound.submit(request(a, 0, 1, true), [](std::exception_ptr) {}), Error);
  EngineState wrong_seed;
  wrong_seed.compression.seed = 4;
  EXPECT_THROW(unbound.load_state(wrong_seed), Error);
}

TEST(BucketEngine, TasksRunInTheFrontEndsContext) {
  static thread_local int context = 0;
  InProcessGroup group(1);
  EngineOptions o = q4_options();
  std::atomic<int> wrapped{0};
  o.wrap_task = [&](std::function<void()> task) -> std::function<void()> {
    ++wrapped;
    return [task = std::move(task)] {
      context = 7;
      task();
      context = 0;
    };
  };
  auto backend = make_cpu_backend();
  BucketEngine engine(o);
  engine.bind(group.communicator(0), backend.get());
  std::vector<float> a = gradient(100, 0, 0);
  std::promise<int> seen;
  BucketRequest r = request(a, 0, 1, true);
  engine.submit(r, [&](std::exception_ptr) { seen.set_value(context); });
  EXPECT_EQ(seen.get_future().get(), 7);
  engine.reduce(r);
  EXPECT_EQ(wrapped.load(), 2);
}

// A transport whose all-to-all takes 200 ms, so that a reduction is still running when the next
// bucket is handed in.
class SlowCommunicator final : public Communicator {
 public:
  explicit SlowCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  bool device_memory() const override { return false; }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    inner_.all_to_all(send, recv, bytes);
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    inner_.all_gather(send, recv, bytes);
  }
  void run_allreduce_mean(void* data, int64_t numel, DType dtype) override {
    inner_.allreduce_mean(data, numel, dtype);
  }
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t n, DType dtype) override {
    inner_.reduce_scatter_mean(send, recv, n, dtype);
  }

 private:
  Communicator& inner_;
};

TEST(BucketEngine, HandingInABucketNeverWaitsForTheReductionInProgress) {
  InProcessGroup group(1);
  SlowCommunicator slow(group.communicator(0));
  auto backend = make_cpu_backend();
  BucketEngine engine(q4_options());
  engine.bind(slow, backend.get());
  std::vector<std::vector<float>> buckets(4, gradient(2000, 0, 0));
  std::atomic<int> done{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 4; ++i) {
    engine.submit(request(buckets[i], i, 60 + i, i == 3), [&](std::exception_ptr) { ++done; });
    // What backward would do meanwhile: read the stats (as the DDP hook's users may).
    (void)engine.total_stats().max_queued;
  }
  const auto handed_in = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(handed_in, std::chrono::milliseconds(150)) << "submit() waited for a reduction";
  while (done.load() < 4) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_GE(engine.total_stats().max_queued, 2u);
}

TEST(BucketEngine, DestructionFinishesQueuedBuckets) {
  InProcessGroup group(1);
  std::atomic<int> finished{0};
  std::vector<std::vector<float>> buckets(20, gradient(3000, 0, 0));
  {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(group.communicator(0), backend.get());
    for (int i = 0; i < 20; ++i)
      engine.submit(request(buckets[i], i, 1000 + i, i == 19), [&](std::exception_ptr e) {
        EXPECT_FALSE(e);
        ++finished;
      });
  }
  EXPECT_EQ(finished.load(), 20);
}

// With node groups the engine's compressed reductions are hierarchical: it counts what left the
// node apart, records the ranks per node in its state, and refuses a state of another topology.
TEST(BucketEngine, NodeGroupsMakeReductionsHierarchicalAndStateRecordsTheTopology) {
  const int nodes = 2, local = 2, world = nodes * local;
  const int64_t n = 3000;
  testing::NodeGrid grid(nodes, local);
  InProcessGroup all(world);
  std::vector<ReductionStats> stats(world);
  std::vector<EngineState> states(world);
  std::vector<std::vector<float>> results(world), direct(world);
  std::vector<std::string> refused(world);
  testing::run_grid(grid, [&](int rank, NodeGroups groups) {
    auto backend = make_cpu_backend(), direct_backend = make_cpu_backend();
    EngineOptions options = q4_options();
    options.local_world_size = local;
    BucketEngine engine(options);
    engine.bind(all.communicator(rank), backend.get(), groups);
    CompressedAllreduce reference(groups, *direct_backend, options.config);
    for (uint32_t step = 0; step < 2; ++step) {
      std::vector<float> g = gradient(n, step, rank), h = g;
      engine.reduce(request(g, 0, 42, true));
      Segment seg{h.data(), 0, n};
      reference.allreduce(&seg, 1, DType::kFloat32, 42);
      reference.advance_step();
      results[rank] = g;
      direct[rank] = h;
    }
    stats[rank] = engine.last_step_stats();
    states[rank] = engine.state();
    EngineOptions flat = q4_options();
    BucketEngine other(flat);
    other.bind(all.communicator(rank), backend.get());
    try {
      other.load_state(states[rank]);
    } catch (const Error& e) {
      refused[rank] = e.what();
    }
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(results[r], direct[r]) << "rank " << r;
    EXPECT_EQ(stats[r].inter_node_bytes,
              inter_node_bytes_sent(q4_options().config, n, nodes, local));
    EXPECT_EQ(stats[r].bytes_sent,
              stats[r].inter_node_bytes + intra_node_bytes_sent(n, DType::kFloat32, local));
    EXPECT_EQ(states[r].local_world_size, local);
    EXPECT_EQ(states[r].compression.residuals.at(42).size(),
              residual_bytes(q4_options().config, node_shard_numel(n, local)));
    EXPECT_NE(refused[r].find("saved by a job of 2 ranks per node; this job has 1"),
              std::string::npos)
        << refused[r];
  }
}

// Node groups of one rank per node are the flat scheme over the world communicator, counted.
TEST(BucketEngine, NodeGroupsOfOneRankPerNodeAreTheFlatSchemeAndCounted) {
  testing::NodeGrid grid(3, 1);
  InProcessGroup all(3);
  std::vector<ReductionStats> stats(3);
  testing::run_grid(grid, [&](int rank, NodeGroups groups) {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    engine.bind(all.communicator(rank), backend.get(), groups);
    for (uint32_t step = 0; step < 2; ++step) {
      std::vector<float> g = gradient(1000, step, rank);
      engine.reduce(request(g, 0, 5, true));
    }
    stats[rank] = engine.last_step_stats();
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(stats[r].bytes_sent, compressed_allreduce_bytes_sent(q4_options().config, 1000, 3));
    EXPECT_EQ(stats[r].inter_node_bytes, stats[r].bytes_sent);
  }
}

TEST(BucketEngine, NodeGroupsThatDoNotPlaceTheRankAreRefused) {
  testing::NodeGrid grid(2, 2);
  InProcessGroup all(4);
  std::vector<std::string> errors(4);
  testing::run_grid(grid, [&](int rank, NodeGroups groups) {
    auto backend = make_cpu_backend();
    BucketEngine engine(q4_options());
    try {
      engine.bind(all.communicator(3 - rank), backend.get(), groups);
    } catch (const Error& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(errors[r].find("ranks must be node-major"), std::string::npos) << errors[r];
}

}  // namespace
}  // namespace gradcomp
