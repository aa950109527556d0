// DiLoCo's host outer step on 25 M parameters: OuterSync::apply's old loop, the vectorized ones.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/outer_sync.h"
#include "math/outer_math.h"
#include "outer_step_cpu.h"

namespace {

constexpr int64_t kParams = 25'000'000;

struct Fragment {
  std::vector<float> anchor, momentum;
};

struct Inputs {
  Fragment f;
  std::vector<float> g;
  Inputs() : f{std::vector<float>(kParams), std::vector<float>(kParams)}, g(kParams) {
    for (int64_t e = 0; e < kParams; ++e) {
      f.anchor[e] = static_cast<float>(e % 1000) * 1e-3f;
      g[e] = static_cast<float>(e % 7) * 1e-4f - 3e-4f;
    }
  }
};

// OuterSync::apply's loop before this change, with its operands where they were: the fragment's
// vectors and the options read through a reference on every element.
__attribute__((noinline)) void loop_before(Fragment& f, const float* g, size_t n,
                                           const gradcomp::OuterSyncOptions& options_) {
  for (size_t e = 0; e < n; ++e)
    f.anchor[e] = gradcomp::math::outer_sgd(f.anchor[e], g[e], &f.momentum[e], options_.outer_lr,
                                            options_.outer_momentum, options_.nesterov);
}

void BM_OuterStepBefore(benchmark::State& state) {
  Inputs in;
  gradcomp::OuterSyncOptions o;
  for (auto _ : state) {
    loop_before(in.f, in.g.data(), kParams, o);
    benchmark::DoNotOptimize(in.f.anchor.data());
  }
  state.SetBytesProcessed(state.iterations() * kParams * 5 * 4);
}

void BM_OuterStepRows(benchmark::State& state) {
  const auto isa = static_cast<gradcomp::cpu::Isa>(state.range(0));
  if (!gradcomp::cpu::isa_supported(isa)) {
    state.SkipWithError("this CPU lacks the instruction set");
    return;
  }
  Inputs in;
  gradcomp::OuterSyncOptions o;
  gradcomp::detail::OuterStepRows rows;
  rows.anchor = in.f.anchor.data();
  rows.gradient = in.g.data();
  rows.momentum = in.f.momentum.data();
  rows.n = kParams;
  rows.lr = o.outer_lr;
  rows.mu = o.outer_momentum;
  rows.nesterov = o.nesterov;
  for (auto _ : state) {
    gradcomp::detail::outer_sgd_rows(rows, isa);
    benchmark::DoNotOptimize(in.f.anchor.data());
  }
  state.SetLabel(gradcomp::cpu::isa_name(isa));
  state.SetBytesProcessed(state.iterations() * kParams * 5 * 4);
}

}  // namespace

BENCHMARK(BM_OuterStepBefore)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_OuterStepRows)
    ->Arg(static_cast<int>(gradcomp::cpu::Isa::kPortable))
    ->Arg(static_cast<int>(gradcomp::cpu::Isa::kAvx2))
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
