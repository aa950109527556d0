// Overlapped buckets: a bucket's decode waits while the next one is encoded and posted. The
// result, the residuals and the stats' bytes equal one bucket at a time, whichever rank overlaps;
// a non-finite bucket keeps only its own residuals; a failing peer fails only the buckets it hit.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "gradcomp/engine.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "run_ranks.h"
#include "test_util.h"

namespace gradcomp {
namespace {

constexpr int kWorld = 3, kBuckets = 4, kSteps = 3;
constexpr int64_t kNumel[kBuckets] = {5000, 1300, 2600, 700};

template <typename F>
void expect_error_containing(const F& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing \"" << text << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

std::vector<float> gradient(int64_t n, uint32_t step, int rank, int bucket) {
  return testing::normal_floats(n, 100 * step + 10 * rank + bucket, 1.0f + rank);
}

struct OverlapCase {
  const char* name;
  CompressionConfig config;
};

CompressionConfig base(Codec codec) {
  CompressionConfig c;
  c.codec = codec;
  c.seed = 21;
  c.topk.ratio = 0.05;
  c.piece_numel = 256;  // several pieces per chunk, so pieces and overlap combine
  return c;
}

std::vector<OverlapCase> cases() {
  std::vector<OverlapCase> v;
  v.push_back({"Q4TwoPhaseInPieces", base(Codec::kQ4)});
  CompressionConfig one_phase = base(Codec::kQ4);
  one_phase.q4_algorithm = Q4Algorithm::kOnePhase;
  v.push_back({"Q4OnePhase", one_phase});
  v.push_back({"TopK", base(Codec::kTopK)});
  CompressionConfig warmup = base(Codec::kTopK);
  warmup.remedies.warmup = TopKWarmup::kQ4;
  warmup.remedies.warmup_steps = 2;  // steps 0 and 1 in q4, step 2 in top-k
  warmup.remedies.momentum = 0.9f;
  v.push_back({"TopKQ4WarmUpWithMomentum", warmup});
  return v;
}

// Holds the worker's first task until every bucket of the step is queued, so each bucket but
// the last is left in flight while the next one begins.
struct QueueUp {
  std::promise<void> all_queued;
  std::shared_future<void> ready = all_queued.get_future().share();
};

using Results = std::vector<std::vector<std::vector<float>>>;  // [step][bucket]

class OverlappedBucketsOfEveryCodec : public ::testing::TestWithParam<OverlapCase> {};

TEST_P(OverlappedBucketsOfEveryCodec, EqualOneBucketAtATimeByteForByteWhicheverRanksOverlap) {
  const CompressionConfig config = GetParam().config;
  InProcessGroup engine_group(kWorld), direct_group(kWorld);
  testing::run_ranks(engine_group, [&](int rank, Communicator& comm) {
    auto backend = make_cpu_backend(), direct_backend = make_cpu_backend();
    EngineOptions o;
    o.config = config;
    // Rank 0 hands buckets in one at a time (it never overlaps); the others queue them all.
    const bool overlap = rank != 0;
    std::unique_ptr<QueueUp> queue_up;
    o.wrap_task = [&](std::function<void()> task) -> std::function<void()> {
      if (!queue_up) return task;
      std::shared_future<void> ready = queue_up->ready;
      return [task = std::move(task), ready] {
        ready.wait();
        task();
      };
    };
    BucketEngine engine(o);
    engine.bind(comm, backend.get());
    CompressedAllreduce direct(direct_group.communicator(rank), *direct_backend, config);
    for (uint32_t step = 0; step < kSteps; ++step) {
      std::vector<std::vector<float>> got(kBuckets), expect(kBuckets);
      std::vector<std::promise<std::exception_ptr>> done(kBuckets);
      if (overlap) queue_up = std::make_unique<QueueUp>();
      for (int b = 0; b < kBuckets; ++b) {
        got[b] = expect[b] = gradient(kNumel[b], step, rank, b);
        BucketRequest r;
        r.data = got[b].data();
        r.numel = kNumel[b];
        r.index = b;
        r.identity = 70 + b;
        r.is_last = b == kBuckets - 1;
        engine.submit(r, [&done, b](std::exception_ptr e) { done[b].set_value(std::move(e)); });
        if (!overlap) ASSERT_FALSE(done[b].get_future().get());
      }
      if (overlap) {
        queue_up->all_queued.set_value();
        for (auto& d : done) ASSERT_FALSE(d.get_future().get());
        queue_up.reset();
      }
      for (int b = 0; b < kBuckets; ++b) {
        Segment seg{expect[b].data(), 0, kNumel[b]};
        ASSERT_TRUE(direct.allreduce(&seg, 1, DType::kFloat32, 70 + b));
        ASSERT_EQ(got[b], expect[b]) << "rank " << rank << " step " << step << " bucket " << b;
      }
      const ReductionStats stats = engine.last_step_stats();
      EXPECT_EQ(stats.buckets, uint64_t{kBuckets});
      EXPECT_EQ(stats.overlapped_buckets, overlap ? uint64_t{kBuckets - 1} : 0u)
          << "rank " << rank << " step " << step;
      // Step 0 also exchanges the layout fingerprints.
      uint64_t bytes = 0;
      for (int b = 0; b < kBuckets; ++b)
        bytes += compressed_allreduce_bytes_sent(config, kNumel[b], kWorld, step);
      if (step > 0) EXPECT_EQ(stats.bytes_sent, bytes) << "rank " << rank << " step " << step;
      EXPECT_EQ(engine.step_timeline().size(), size_t{kBuckets});
      direct.advance_step();
    }
    // The residuals (and velocities) of every bucket, as one bucket at a time left them.
    const CompressionState mine = engine.state().compression, ref = direct.state();
    EXPECT_EQ(mine.residuals, ref.residuals);
    EXPECT_EQ(mine.chunk_residuals, ref.chunk_residuals);
    EXPECT_EQ(mine.velocities, ref.velocities);
  });
}

INSTANTIATE_TEST_SUITE_P(Codecs, OverlappedBucketsOfEveryCodec, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// Without pipelining (piece_numel = 0) or on a hierarchical reduction buckets go one at a time.
TEST(OverlappedBuckets, OnlyFlatPipelinedReductionsOnTheHostOverlap) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  CompressionConfig config = base(Codec::kQ4);
  EXPECT_TRUE(CompressedAllreduce(group.communicator(0), *backend, config).overlaps_buckets());
  config.piece_numel = 0;
  CompressedAllreduce sequential(group.communicator(0), *backend, config);
  EXPECT_FALSE(sequential.overlaps_buckets());
  std::vector<float> a = gradient(300, 0, 0, 0), b = a;
  Segment sa{a.data(), 0, 300}, sb{b.data(), 0, 300};
  sequential.begin_allreduce(&sa, 1, DType::kFloat32, 1);
  expect_error_containing([&] { sequential.begin_allreduce(&sb, 1, DType::kFloat32, 2); },
                          "this reduction does not overlap buckets");
  EXPECT_TRUE(sequential.finish_allreduce());
  expect_error_containing([&] { sequential.finish_allreduce(); }, "no begun bucket");
}

// begin(A), begin(B), finish(A), finish(B) with B non-finite on one rank: A's result and
// residuals are those of one at a time, and B is non-finite on every rank and keeps its
// residuals. Then the other way round.
TEST(OverlappedBuckets, ANonFiniteBucketFlagsOnlyItselfAndKeepsItsResiduals) {
  for (int bad = 0; bad < 2; ++bad) {
    InProcessGroup group(kWorld), direct_group(kWorld);
    testing::run_ranks(group, [&](int rank, Communicator& comm) {
      auto backend = make_cpu_backend(), direct_backend = make_cpu_backend();
      const CompressionConfig config = base(Codec::kQ4);
      CompressedAllreduce overlapped(comm, *backend, config);
      CompressedAllreduce direct(direct_group.communicator(rank), *direct_backend, config);
      for (uint32_t step = 0; step < 2; ++step) {
        std::vector<std::vector<float>> got(2), expect(2);
        for (int b = 0; b < 2; ++b) {
          got[b] = gradient(kNumel[b], step, rank, b);
          if (step == 1 && b == bad && rank == 2) got[b][17] = INFINITY;
          expect[b] = got[b];
        }
        Segment s0{got[0].data(), 0, kNumel[0]}, s1{got[1].data(), 0, kNumel[1]};
        overlapped.begin_allreduce(&s0, 1, DType::kFloat32, 1);
        overlapped.begin_allreduce(&s1, 1, DType::kFloat32, 2);
        EXPECT_EQ(overlapped.in_flight(), 2);
        const bool finite0 = overlapped.finish_allreduce();
        const bool finite1 = overlapped.finish_allreduce();
        Segment e0{expect[0].data(), 0, kNumel[0]}, e1{expect[1].data(), 0, kNumel[1]};
        EXPECT_EQ(finite0, direct.allreduce(&e0, 1, DType::kFloat32, 1));
        EXPECT_EQ(finite1, direct.allreduce(&e1, 1, DType::kFloat32, 2));
        EXPECT_EQ(finite0, !(step == 1 && bad == 0)) << "rank " << rank;
        EXPECT_EQ(finite1, !(step == 1 && bad == 1)) << "rank " << rank;
        for (int b = 0; b < 2; ++b) {
          if (step == 1 && b == bad) continue;  // non-finite: what it holds is not compared
          EXPECT_EQ(got[b], expect[b]) << "rank " << rank << " step " << step << " bucket " << b;
        }
        overlapped.advance_step();
        direct.advance_step();
      }
      EXPECT_EQ(overlapped.state().residuals, direct.state().residuals);
      EXPECT_EQ(overlapped.state().chunk_residuals, direct.state().chunk_residuals);
    });
  }
}

// A peer fails in bucket 1's all-to-all while bucket 0 is in flight: bucket 0 completes on every
// rank, bucket 1 fails on every rank naming itself, and nothing hangs.
TEST(OverlappedBuckets, AFailingPeerFailsTheBucketItHitAndTheOneInFlightCompletes) {
  InProcessGroup group(kWorld, 2.0);
  std::vector<std::string> errors(kWorld);
  std::vector<char> first_ok(kWorld, 0);  // not vector<bool>: ranks write their own element at once
  const auto start = std::chrono::steady_clock::now();
  testing::run_ranks(group, [&](int rank, Communicator& inner) {
    EngineOptions o;
    o.config = base(Codec::kQ4);
    FaultSpec spec;
    spec.action = FaultSpec::Action::kFail;
    spec.collective = "all_to_all";
    // Bucket 0's all-to-alls are calls 0 .. pieces - 1: this is bucket 1's first.
    spec.call = static_cast<uint64_t>(q4_pieces(o.config, kNumel[0], kWorld));
    ASSERT_GT(spec.call, 1u);
    spec.rank = 0;
    FaultInjectingCommunicator comm(inner, spec);
    auto backend = make_cpu_backend();
    QueueUp queue_up;
    o.wrap_task = [&](std::function<void()> task) -> std::function<void()> {
      std::shared_future<void> ready = queue_up.ready;
      return [task = std::move(task), ready] {
        ready.wait();
        task();
      };
    };
    BucketEngine engine(o);
    engine.bind(comm, backend.get());
    std::vector<std::vector<float>> g = {gradient(kNumel[0], 0, rank, 0),
                                         gradient(kNumel[1], 0, rank, 1)};
    std::vector<std::promise<std::exception_ptr>> done(2);
    for (int b = 0; b < 2; ++b) {
      BucketRequest r;
      r.data = g[b].data();
      r.numel = kNumel[b];
      r.index = b;
      r.identity = 80 + b;
      r.is_last = b == 1;
      engine.submit(r, [&done, b](std::exception_ptr e) { done[b].set_value(std::move(e)); });
    }
    queue_up.all_queued.set_value();
    first_ok[rank] = !done[0].get_future().get();
    if (std::exception_ptr e = done[1].get_future().get()) {
      try {
        std::rethrow_exception(e);
      } catch (const Error& error) {
        errors[rank] = error.what();
      }
    }
    EXPECT_EQ(engine.total_stats().overlapped_buckets, 1u) << "rank " << rank;
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(12));
  EXPECT_NE(errors[0].find("injected transport failure"), std::string::npos) << errors[0];
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_TRUE(first_ok[rank]) << "rank " << rank;
    EXPECT_NE(errors[rank].find("bucket 1"), std::string::npos) << errors[rank];
    EXPECT_NE(errors[rank].find("all_to_all"), std::string::npos) << errors[rank];
  }
}

}  // namespace
}  // namespace gradcomp
