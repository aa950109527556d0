// Faults at the engine: bad bytes from a peer, a failing or silent peer, foreign checkpoints.
// Every rank refuses damage naming the sender, no bucket is half-written, and a retried step
// computes what the step would have computed.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "gradcomp/engine.h"
#include "gradcomp/fault_injection.h"
#include "gradcomp/inprocess_group.h"
#include "test_util.h"

namespace gradcomp {
namespace {

constexpr int kWorld = 3;
constexpr int64_t kNumel[2] = {3000, 1100};

std::vector<float> gradient(int64_t n, uint32_t step, int rank, int bucket) {
  return testing::normal_floats(n, 100 * step + 10 * rank + bucket, 1.0f + rank);
}

BucketRequest request(std::vector<float>& data, int64_t index) {
  BucketRequest r;
  r.data = data.data();
  r.numel = static_cast<int64_t>(data.size());
  r.index = index;
  r.identity = 40 + index;
  r.is_last = index == 1;
  return r;
}

// Pieces of kSmallPieces elements: bucket 0 in 8 pieces, bucket 1 in 3, at W = 3.
constexpr int64_t kSmallPieces = 300;

EngineOptions options(Codec codec, int64_t piece_numel = CompressionConfig::kDefaultPieceNumel) {
  EngineOptions o;
  o.config.codec = codec;
  o.config.topk.ratio = 0.05;
  o.config.seed = 9;
  o.config.piece_numel = piece_numel;
  return o;
}

template <typename F>
void on_ranks(const F& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) threads.emplace_back([&, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// results[rank][step][bucket] of three fault-free steps.
using Results = std::vector<std::vector<std::vector<std::vector<float>>>>;

Results fault_free(Codec codec) {
  InProcessGroup group(kWorld);
  Results results(kWorld);
  on_ranks([&](int rank) {
    auto backend = make_cpu_backend();
    BucketEngine engine(options(codec));
    engine.bind(group.communicator(rank), backend.get());
    for (uint32_t step = 0; step < 3; ++step) {
      results[rank].emplace_back();
      for (int b = 0; b < 2; ++b) {
        std::vector<float> g = gradient(kNumel[b], step, rank, b);
        engine.reduce(request(g, b));
        results[rank][step].push_back(g);
      }
    }
  });
  return results;
}

struct DamageCase {
  Codec codec;
  FaultSpec::Action action;
  const char* collective;
  uint64_t call;  // the call of step 1's bucket 1 (two-phase q4: layout checks are all_gathers)
  int64_t piece_numel = CompressionConfig::kDefaultPieceNumel;  // the damaged run's pieces
};

class PeerSendsBadBytes : public ::testing::TestWithParam<DamageCase> {};

TEST_P(PeerSendsBadBytes, EveryRankRefusesItNamingTheSenderAndARetriedStepIsExact) {
  const DamageCase c = GetParam();
  const Results expect = fault_free(c.codec);
  InProcessGroup group(kWorld);
  std::vector<std::string> errors(kWorld);
  Results got(kWorld, Results::value_type(3));
  on_ranks([&](int rank) {
    FaultSpec spec;
    spec.action = c.action;
    spec.collective = c.collective;
    spec.call = c.call;
    spec.rank = 1;
    FaultInjectingCommunicator comm(group.communicator(rank), spec);
    auto backend = make_cpu_backend();
    BucketEngine engine(options(c.codec, c.piece_numel));
    engine.bind(comm, backend.get());
    for (uint32_t step = 0; step < 3; ++step) {
      for (int b = 0; b < 2; ++b) {
        std::vector<float> g = gradient(kNumel[b], step, rank, b);
        const std::vector<float> before = g;
        try {
          engine.reduce(request(g, b));
        } catch (const Error& e) {
          errors[rank] = e.what();
          EXPECT_EQ(g, before) << "rank " << rank << ": the refused bucket was written";
          // The job catches the error and redoes the step from its first bucket.
          std::vector<float> first = gradient(kNumel[0], step, rank, 0);
          engine.reduce(request(first, 0));
          got[rank][step][0] = first;
          g = before;
          engine.reduce(request(g, b));
        }
        got[rank][step].resize(2);
        got[rank][step][b] = g;
      }
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_NE(errors[rank].find("from rank 1"), std::string::npos) << errors[rank];
    EXPECT_NE(errors[rank].find("bucket 1"), std::string::npos) << errors[rank];
    EXPECT_NE(errors[rank].find("of step 1"), std::string::npos) << errors[rank];
    for (uint32_t step = 0; step < 3; ++step)
      for (int b = 0; b < 2; ++b)
        EXPECT_EQ(got[rank][step][b], expect[rank][step][b])
            << "rank " << rank << " step " << step << " bucket " << b;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Damage, PeerSendsBadBytes,
    ::testing::Values(
        DamageCase{Codec::kQ4, FaultSpec::Action::kFlipBits, "all_gather", 5},
        DamageCase{Codec::kQ4, FaultSpec::Action::kTruncate, "all_to_all", 3},
        DamageCase{Codec::kQ4, FaultSpec::Action::kReplace, "all_gather", 5},
        DamageCase{Codec::kQ4, FaultSpec::Action::kFlipBits, "all_to_all", 3},
        DamageCase{Codec::kTopK, FaultSpec::Action::kFlipBits, "all_gather", 5},
        DamageCase{Codec::kTopK, FaultSpec::Action::kTruncate, "all_gather", 5},
        // In pieces, damage to bucket 1's second piece: its first piece is decoded
        // fine, and still the bucket is left as it was. The results equal those of
        // one piece (fault_free).
        DamageCase{Codec::kQ4, FaultSpec::Action::kFlipBits, "all_gather", 22, kSmallPieces},
        DamageCase{Codec::kQ4, FaultSpec::Action::kTruncate, "all_to_all", 20, kSmallPieces}));

class PeerFails : public ::testing::TestWithParam<int64_t> {};

TEST_P(PeerFails, EveryRankRaisesNamingStepBucketAndCollectiveWithinTheTimeout) {
  const int64_t piece_numel = GetParam();
  InProcessGroup group(kWorld, 2.0);
  std::vector<std::string> errors(kWorld);
  const auto start = std::chrono::steady_clock::now();
  on_ranks([&](int rank) {
    FaultSpec spec;
    spec.action = FaultSpec::Action::kFail;
    spec.collective = "all_to_all";
    // Step 0, bucket 1 (in pieces: its second, while its first piece's allgather is queued).
    spec.call = piece_numel == kSmallPieces ? 9 : 1;
    spec.rank = 0;
    FaultInjectingCommunicator comm(group.communicator(rank), spec);
    auto backend = make_cpu_backend();
    BucketEngine engine(options(Codec::kQ4, piece_numel));
    engine.bind(comm, backend.get());
    for (int b = 0; b < 2; ++b) {
      std::vector<float> g = gradient(kNumel[b], 0, rank, b);
      std::promise<std::exception_ptr> done;
      engine.submit(request(g, b), [&](std::exception_ptr e) { done.set_value(std::move(e)); });
      if (std::exception_ptr e = done.get_future().get()) {
        try {
          std::rethrow_exception(e);
        } catch (const Error& error) {
          errors[rank] = error.what();
        }
        return;
      }
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(12));
  EXPECT_NE(errors[0].find("injected transport failure"), std::string::npos) << errors[0];
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_NE(errors[rank].find("bucket 1"), std::string::npos) << errors[rank];
    EXPECT_NE(errors[rank].find("of step 0"), std::string::npos) << errors[rank];
    EXPECT_NE(errors[rank].find("all_to_all"), std::string::npos) << errors[rank];
  }
}

INSTANTIATE_TEST_SUITE_P(OneAndManyPieces, PeerFails,
                         ::testing::Values(CompressionConfig::kDefaultPieceNumel, kSmallPieces));

TEST(ForeignCheckpoints, AnotherWorldSizeOrWrongResidualSizesAreRefusedAsAWhole) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  EngineOptions o = options(Codec::kQ4);
  o.world_size = 1;
  BucketEngine source(o);
  source.bind(group.communicator(0), backend.get());
  std::vector<float> g = gradient(kNumel[0], 0, 0, 0);
  BucketRequest r = request(g, 0);
  r.params = {ParamSlice{0, 0, kNumel[0]}};
  source.reduce(r);
  const EngineState saved = source.state();
  ASSERT_EQ(saved.world_size, 1);

  auto message = [&](EngineState s, int world) -> std::string {
    EngineOptions target = options(Codec::kQ4);
    target.world_size = world;
    BucketEngine engine(target);
    try {
      engine.load_state(std::move(s));
    } catch (const Error& e) {
      EXPECT_EQ(engine.state().compression.step, 0u) << "partly loaded";
      return e.what();
    }
    return "";
  };
  EXPECT_EQ(message(saved, 1), "");
  EXPECT_NE(message(saved, 4).find("saved by a job of 1 ranks; this job has 4"), std::string::npos);
  EngineState short_residual = saved;
  short_residual.compression.residuals.begin()->second.resize(100);
  short_residual.compression.step = 7;
  EXPECT_NE(message(short_residual, 1).find("has 100 bytes"), std::string::npos);
  EngineState foreign_chunks = saved;
  foreign_chunks.compression.chunk_residuals[999] = {1, 2, 3};
  EXPECT_EQ(message(foreign_chunks, 1), "");  // no layout: checked at the bucket's first use
  EngineOptions topk = options(Codec::kTopK);
  BucketEngine topk_engine(topk);
  EXPECT_THROW(topk_engine.load_state(saved), Error);  // top-k keeps no chunk residuals
}

TEST(EngineLifetime, TwoHundredEnginesComeAndGoWithoutLeaks) {
  // Under the sanitizer build LeakSanitizer checks this at exit.
  InProcessGroup group(1);
  for (int i = 0; i < 200; ++i) {
    auto backend = make_cpu_backend();
    BucketEngine engine(options(i % 2 ? Codec::kQ4 : Codec::kTopK));
    engine.bind(group.communicator(0), backend.get());
    std::vector<float> g = gradient(500, 0, 0, i);
    std::promise<void> done;
    engine.submit(request(g, 0), [&](std::exception_ptr) { done.set_value(); });
    done.get_future().get();
  }
}

}  // namespace
}  // namespace gradcomp
