// Restarts whose first buckets differ from the checkpoint's: the engine holds them and reduces
// the saved layouts over them, bit-identically to a run that never stopped.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <thread>

#include "gradcomp/engine.h"
#include "gradcomp/inprocess_group.h"
#include "test_util.h"

namespace gradcomp {
namespace {

const int64_t kParamSizes[] = {300, 500, 200};

std::vector<float> param_gradient(int param, uint32_t step, int rank) {
  return testing::normal_floats(kParamSizes[param], 100 * step + 10 * rank + param, 1.0f + rank);
}

// A bucket holding the gradients of `params` in order, as a front end lays it out.
struct Bucket {
  std::vector<int> params;
  int64_t index = 0;
  std::vector<float> data;
  std::vector<ParamSlice> slices;

  Bucket(std::vector<int> ps, int64_t idx) : params(std::move(ps)), index(idx) {
    int64_t offset = 0;
    for (int p : params) {
      slices.push_back(ParamSlice{p, offset, kParamSizes[p]});
      offset += kParamSizes[p];
    }
    data.resize(static_cast<size_t>(offset));
  }
  void fill(uint32_t step, int rank) {
    for (size_t i = 0; i < params.size(); ++i) {
      const std::vector<float> g = param_gradient(params[i], step, rank);
      std::copy(g.begin(), g.end(), data.begin() + slices[i].offset);
    }
  }
  uint64_t identity() const {
    std::vector<std::vector<int64_t>> shapes;
    for (int p : params) shapes.push_back({kParamSizes[p]});
    return bucket_identity(index, static_cast<int64_t>(data.size()), DType::kFloat32, shapes);
  }
  BucketRequest request(bool is_last) {
    BucketRequest r;
    r.data = data.data();
    r.numel = static_cast<int64_t>(data.size());
    r.index = index;
    r.identity = identity();
    r.is_last = is_last;
    r.params = slices;
    return r;
  }
  // Each parameter's averaged gradient, by parameter.
  void collect(std::map<int, std::vector<float>>& out) const {
    for (size_t i = 0; i < params.size(); ++i)
      out[params[i]].assign(data.begin() + slices[i].offset,
                            data.begin() + slices[i].offset + slices[i].numel);
  }
};

using Results = std::vector<std::map<int, std::vector<float>>>;  // per step

// Reduces one step of `layout` (buckets in index order) on one rank, with callbacks, and checks
// that held buckets complete only after the last one was handed in.
void run_step(BucketEngine& engine, std::vector<Bucket>& layout, uint32_t step, int rank,
              Results& results, bool expect_held) {
  std::vector<int> completed(layout.size(), 0);
  for (size_t b = 0; b < layout.size(); ++b) {
    layout[b].fill(step, rank);
    const bool last = b + 1 == layout.size();
    engine.reduce(layout[b].request(last), [&, b](std::exception_ptr e) {
      EXPECT_FALSE(e) << "step " << step << " bucket " << b;
      ++completed[b];
    });
    if (expect_held && !last) EXPECT_EQ(completed[b], 0) << "bucket " << b << " was not held";
  }
  for (int c : completed) EXPECT_EQ(c, 1);
  if (results.size() <= step) results.resize(step + 1);
  for (const Bucket& b : layout) b.collect(results[step]);
}

EngineOptions options(Codec codec) {
  EngineOptions o;
  o.config.codec = codec;
  o.config.topk.ratio = 0.05;
  o.config.seed = 11;
  return o;
}

class RestoredLayouts : public ::testing::TestWithParam<Codec> {};

TEST_P(RestoredLayouts, ResumeThroughOtherFirstBucketsIsBitIdentical) {
  const int world = 2;
  InProcessGroup group_a(world), group_b(world);
  std::vector<Results> uninterrupted(world), resumed(world);
  std::vector<EngineState> saved(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      auto backend = make_cpu_backend();
      std::vector<Bucket> rebuilt = {Bucket({2, 1}, 0), Bucket({0}, 1)};
      {
        BucketEngine engine(options(GetParam()));
        engine.bind(group_a.communicator(rank), backend.get());
        for (uint32_t step = 0; step < 4; ++step) {
          if (step == 2) saved[rank] = engine.state();
          run_step(engine, rebuilt, step, rank, uninterrupted[rank], false);
        }
      }
      BucketEngine engine(options(GetParam()));
      engine.bind(group_b.communicator(rank), backend.get());
      engine.load_state(saved[rank]);
      std::vector<Bucket> first = {Bucket({0, 1}, 0), Bucket({2}, 1)};
      run_step(engine, first, 2, rank, resumed[rank], true);
      run_step(engine, rebuilt, 3, rank, resumed[rank], false);
      const EngineState after = engine.state();
      EXPECT_EQ(after.compression.step, 3u);
      EXPECT_EQ(after.layouts.size(), 2u);
      for (const auto& kv : saved[rank].compression.residuals)
        EXPECT_EQ(after.compression.residuals.count(kv.first), 1u);
      EXPECT_EQ(after.compression.residuals.size(), saved[rank].compression.residuals.size());
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < world; ++rank) {
    ASSERT_EQ(saved[rank].layouts.size(), 2u);
    for (uint32_t step = 2; step < 4; ++step)
      for (int p = 0; p < 3; ++p)
        EXPECT_EQ(resumed[rank][step][p], uninterrupted[rank][step][p])
            << "rank " << rank << " step " << step << " param " << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, RestoredLayouts, ::testing::Values(Codec::kQ4, Codec::kTopK));

TEST(RestoredLayoutsFallback, AnotherModelIsReducedAsItsOwnBuckets) {
  InProcessGroup group(1);
  auto backend = make_cpu_backend();
  std::vector<Bucket> saved_layout = {Bucket({2, 1}, 0), Bucket({0}, 1)};
  EngineState saved;
  {
    BucketEngine engine(options(Codec::kQ4));
    engine.bind(group.communicator(0), backend.get());
    Results r;
    run_step(engine, saved_layout, 0, 0, r, false);
    saved = engine.state();
  }
  // The restarted model has only parameters 0 and 1: the saved layout cannot be rebuilt.
  BucketEngine engine(options(Codec::kQ4));
  engine.bind(group.communicator(0), backend.get());
  engine.load_state(saved);
  std::vector<Bucket> other = {Bucket({0}, 0), Bucket({1}, 1)};
  Results r;
  run_step(engine, other, 1, 0, r, true);
  EXPECT_EQ(engine.last_step_stats().buckets, 2u);
  for (int p = 0; p < 2; ++p)
    for (float v : r[1][p]) ASSERT_TRUE(std::isfinite(v));
}

}  // namespace
}  // namespace gradcomp
