// Google Benchmark suite for the CPU codecs; reports bytes/s and the ratio to memcpy in this
// binary.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_weight_row_loops.h"
#include "gradcomp/cpu.h"
#include "gradcomp/format.h"
#include "int4_params.h"

namespace {

using namespace gradcomp;

constexpr int64_t kN = 1 << 24;

// memcpy bandwidth of this machine, measured once in this process: median of 15 copies of the
// benchmarks' fp32 input size (64 MiB), counting bytes read plus bytes written.
double memcpy_bytes_per_second() {
  static const double bw = [] {
    const size_t bytes = static_cast<size_t>(kN) * 4;
    std::vector<char> a(bytes, 1), b(bytes, 2);
    std::vector<double> rates;
    for (int i = 0; i < 15; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::memcpy(b.data(), a.data(), bytes);
      benchmark::DoNotOptimize(b.data());
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      rates.push_back(2.0 * bytes / s);  // read + write, like the codecs' byte counts
    }
    std::nth_element(rates.begin(), rates.begin() + 7, rates.end());
    return rates[7];
  }();
  return bw;
}

void report(benchmark::State& state, double bytes_moved_per_iter) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes_moved_per_iter * state.iterations()));
  state.counters["vs_memcpy"] = benchmark::Counter(bytes_moved_per_iter / memcpy_bytes_per_second(),
                                                   benchmark::Counter::kIsIterationInvariantRate);
  state.counters["elements"] = static_cast<double>(state.range(0));
}

std::vector<uint8_t> make_input(DType dtype, int64_t n) {
  std::mt19937 gen(1);
  std::normal_distribution<float> dist;
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i)
    math::store_from_float(bytes.data(), i, static_cast<uint8_t>(dtype), dist(gen));
  return bytes;
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0)) * 4;
  std::vector<char> a(bytes, 1), b(bytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), bytes);
    benchmark::DoNotOptimize(b.data());
  }
  report(state, 2.0 * bytes);
}

// Selects the CPU loops for one benchmark (-1: the best this CPU has) and restores them after.
class IsaScope {
 public:
  IsaScope(benchmark::State& state, int64_t code) : saved_(cpu::active_isa()) {
    if (code < 0) return;
    const auto isa = static_cast<cpu::Isa>(code);
    if (!cpu::isa_supported(isa)) {
      state.SkipWithError((std::string(cpu::isa_name(isa)) + " is not supported here").c_str());
      ok_ = false;
      return;
    }
    cpu::set_active_isa(isa);
    state.SetLabel(cpu::isa_name(isa));
  }
  ~IsaScope() { cpu::set_active_isa(saved_); }
  bool ok() const { return ok_; }

 private:
  cpu::Isa saved_;
  bool ok_ = true;
};

// Args: elements, dtype, stochastic, error feedback, threads, instruction set (-1: best).
void BM_Q4Encode(benchmark::State& state) {
  IsaScope isa(state, state.range(5));
  if (!isa.ok()) return;
  const int64_t n = state.range(0);
  const DType dtype = static_cast<DType>(state.range(1));
  const bool ef = state.range(3) != 0;
  auto input = make_input(dtype, n);
  std::vector<float> r_in(ef ? n : 0, 0.0f), r_out(ef ? n : 0);
  std::vector<uint8_t> payload(q4_payload_bytes(n, 64));
  Segment seg{input.data(), 0, n};
  Q4EncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = static_cast<uint8_t>(dtype);
  p.numel = n;
  p.stochastic = state.range(2) != 0;
  p.payload = payload.data();
  if (ef) {
    p.residual_in = r_in.data();
    p.residual_out = r_out.data();
  }
  for (auto _ : state) {
    cpu::q4_encode(p, static_cast<int>(state.range(4)));
    benchmark::DoNotOptimize(payload.data());
    ++p.rng.step;
  }
  report(state, static_cast<double>(input.size() + payload.size() + (ef ? 8.0 * n : 0.0)));
}

// Args: elements, payloads (W), threads, instruction set (-1: best).
void BM_Q4DecodeSum(benchmark::State& state) {
  IsaScope isa(state, state.range(3));
  if (!isa.ok()) return;
  const int64_t n = state.range(0);
  const int world = static_cast<int>(state.range(1));
  auto input = make_input(DType::kFloat32, n);
  std::vector<uint8_t> payload(q4_payload_bytes(n, 64));
  Segment seg{input.data(), 0, n};
  Q4EncodeParams e;
  e.segments = &seg;
  e.num_segments = 1;
  e.numel = n;
  e.payload = payload.data();
  cpu::q4_encode(e);
  std::vector<const uint8_t*> ptrs(world, payload.data());
  std::vector<float> out(n);
  Segment oseg{out.data(), 0, n};
  Q4DecodeParams d;
  d.payloads = ptrs.data();
  d.num_payloads = world;
  d.payload_bytes = payload.size();
  d.numel = n;
  d.segments = &oseg;
  d.num_segments = 1;
  d.divisor = static_cast<float>(world);
  for (auto _ : state) {
    cpu::q4_decode(d, static_cast<int>(state.range(2)));
    benchmark::DoNotOptimize(out.data());
  }
  report(state, static_cast<double>(payload.size()) * world + 4.0 * n);
}

// The weight all-gathers' row codecs, int8 and 4-bit (one run of one dtype, block 64). Args:
// elements, dtype, instruction set (-1: best; -2: the element-by-element reference the loops
// replaced, with the scalar checksum).
using cpu::detail::WeightRowCodec;

void row_encode(benchmark::State& state, const WeightRowCodec& codec) {
  const bool reference = state.range(2) == -2;
  IsaScope isa(state, reference ? 0 : state.range(2));
  if (!isa.ok()) return;
  if (reference) state.SetLabel("reference");
  const auto encode = reference ? codec.encode_reference : codec.encode;
  const Int8Run run{static_cast<uint8_t>(state.range(1)), state.range(0)};
  const auto input = make_input(static_cast<DType>(run.dtype), run.numel);
  std::vector<uint8_t> payload(codec.payload_bytes(&run, 1, 64));
  for (auto _ : state) {
    benchmark::DoNotOptimize(encode(input.data(), &run, 1, 64, payload.data()));
    benchmark::ClobberMemory();
  }
  report(state, static_cast<double>(input.size() + payload.size()));
}

// Verdict (header and checksum) and decode of one row, as CompressedAllGather runs per rank.
void row_decode(benchmark::State& state, const WeightRowCodec& codec) {
  const bool reference = state.range(2) == -2;
  IsaScope isa(state, reference ? 0 : state.range(2));
  if (!isa.ok()) return;
  if (reference) state.SetLabel("reference");
  const auto decode = reference ? codec.decode_reference : codec.decode;
  const Int8Run run{static_cast<uint8_t>(state.range(1)), state.range(0)};
  const auto input = make_input(static_cast<DType>(run.dtype), run.numel);
  std::vector<uint8_t> payload(codec.payload_bytes(&run, 1, 64));
  codec.encode(input.data(), &run, 1, 64, payload.data());
  std::vector<uint8_t> output(input.size());
  for (auto _ : state) {
    // Under the reference the verdict runs on the portable checksum, the scalar loop it replaced.
    if (codec.verdict(payload.data(), &run, 1, 64) != kInt8Ok) {
      state.SkipWithError("the payload does not pass its own verdict");
      return;
    }
    decode(payload.data(), &run, 1, 64, output.data());
    benchmark::ClobberMemory();
  }
  report(state, static_cast<double>(input.size() + payload.size()));
}

void BM_Int8Encode(benchmark::State& state) {
  row_encode(state, cpu::detail::kInt8RowCodec);
}
void BM_Int8Decode(benchmark::State& state) {
  row_decode(state, cpu::detail::kInt8RowCodec);
}
void BM_Int4Encode(benchmark::State& state) {
  row_encode(state, cpu::detail::kInt4RowCodec);
}
void BM_Int4Decode(benchmark::State& state) {
  row_decode(state, cpu::detail::kInt4RowCodec);
}

// Args: elements, exact.
void BM_TopKEncode(benchmark::State& state) {
  const int64_t n = state.range(0);
  auto input = make_input(DType::kFloat32, n);
  std::vector<float> r_in(n, 0.0f), r_out(n);
  TopKOptions o;
  o.exact = state.range(1) != 0;
  const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
  std::vector<uint8_t> payload(topk_payload_bytes(cap, DType::kFloat32));
  Segment seg{input.data(), 0, n};
  TopKEncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.numel = n;
  p.residual_in = r_in.data();
  p.residual_out = r_out.data();
  p.k = k;
  p.capacity = static_cast<uint32_t>(cap);
  p.exact = o.exact;
  p.payload = payload.data();
  std::vector<float> workspace(cpu::topk_workspace_bytes(n) / 4);  // as the engine keeps per bucket
  p.workspace = workspace.data();
  for (auto _ : state) {
    benchmark::DoNotOptimize(cpu::topk_encode(p));
  }
  report(state, 12.0 * n + static_cast<double>(payload.size()));
}

// Args: elements, W. The mean of W payloads of 1 % each (ranks select different elements), as
// the top-k allreduce decodes its allgather.
void BM_TopKDecode(benchmark::State& state) {
  const int64_t n = state.range(0);
  const int world = static_cast<int>(state.range(1));
  TopKOptions o;
  const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
  const size_t payload_bytes = topk_payload_bytes(cap, DType::kFloat32);
  std::vector<std::vector<uint8_t>> payloads(world, std::vector<uint8_t>(payload_bytes));
  std::vector<float> workspace(cpu::topk_workspace_bytes(n) / 4);
  for (int w = 0; w < world; ++w) {
    std::mt19937 gen(100 + w);
    std::normal_distribution<float> dist;
    std::vector<float> input(n);
    for (float& v : input) v = dist(gen);
    Segment seg{input.data(), 0, n};
    TopKEncodeParams e;
    e.segments = &seg;
    e.num_segments = 1;
    e.numel = n;
    e.k = k;
    e.capacity = static_cast<uint32_t>(cap);
    e.payload = payloads[w].data();
    e.workspace = workspace.data();
    cpu::topk_encode(e);
  }
  std::vector<const uint8_t*> ptrs;
  for (const auto& payload : payloads) ptrs.push_back(payload.data());
  std::vector<float> out(n);
  Segment oseg{out.data(), 0, n};
  TopKDecodeParams d;
  d.payloads = ptrs.data();
  d.num_payloads = world;
  d.payload_bytes = payload_bytes;
  d.numel = n;
  d.capacity = static_cast<uint32_t>(cap);
  d.segments = &oseg;
  d.num_segments = 1;
  d.divisor = static_cast<float>(world);
  d.workspace = workspace.data();
  for (auto _ : state) {
    cpu::topk_decode(d);
    benchmark::DoNotOptimize(out.data());
  }
  report(state, static_cast<double>(payload_bytes) * world + 4.0 * n);
}

// Relative L2 error and payload bits per element of q4 for each block size (not a speed test:
// the numbers behind the default block size in docs/algorithms.md).
void BM_Q4BlockSizeError(benchmark::State& state) {
  const int64_t n = 1 << 20;
  const int block = static_cast<int>(state.range(0));
  // Heavy-tailed data, like gradients: normal values with a few 20x outliers.
  std::mt19937 gen(7);
  std::normal_distribution<float> dist;
  std::vector<float> x(n), y(n);
  for (auto& v : x) v = dist(gen) * (gen() % 1000 == 0 ? 20.0f : 1.0f);
  std::vector<uint8_t> payload(q4_payload_bytes(n, block));
  Segment in{x.data(), 0, n}, out{y.data(), 0, n};
  Q4EncodeParams e;
  e.segments = &in;
  e.num_segments = 1;
  e.numel = n;
  e.block_size = static_cast<uint32_t>(block);
  e.stochastic = false;
  e.payload = payload.data();
  const uint8_t* ptr = payload.data();
  Q4DecodeParams d;
  d.payloads = &ptr;
  d.num_payloads = 1;
  d.payload_bytes = payload.size();
  d.numel = n;
  d.block_size = static_cast<uint32_t>(block);
  d.segments = &out;
  d.num_segments = 1;
  for (auto _ : state) {
    cpu::q4_encode(e);
    cpu::q4_decode(d);
  }
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(y[i]) - x[i]) * (double(y[i]) - x[i]);
    den += double(x[i]) * x[i];
  }
  state.counters["rel_l2_error"] = std::sqrt(num / den);
  state.counters["bits_per_element"] = 8.0 * payload.size() / n;
  report(state, 4.0 * n + payload.size());
}

BENCHMARK(BM_Memcpy)->Arg(kN)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Q4Encode)
    ->ArgNames({"n", "dtype", "sr", "ef", "threads", "isa"})
    ->Args({kN, 0, 1, 0, 1, -1})
    ->Args({kN, 0, 0, 0, 1, -1})
    ->Args({kN, 0, 1, 1, 1, -1})
    ->Args({kN, 2, 1, 0, 1, -1})
    ->Args({kN, 0, 1, 0, 2, -1})
    ->Args({kN, 0, 1, 1, 2, -1})
    ->Args({kN, 0, 1, 0, 1, 0})
    ->Args({kN, 0, 1, 0, 1, 1})
    ->Args({kN, 0, 1, 0, 1, 2})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Q4DecodeSum)
    ->ArgNames({"n", "W", "threads", "isa"})
    ->Args({kN, 1, 1, -1})
    ->Args({kN, 4, 1, -1})
    ->Args({kN, 4, 2, -1})
    ->Args({kN, 4, 1, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Int8Encode)
    ->ArgNames({"n", "dtype", "isa"})
    ->ArgsProduct({{1000000, 25000000}, {0, 2}, {-2, 0, -1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Int8Decode)
    ->ArgNames({"n", "dtype", "isa"})
    ->ArgsProduct({{1000000, 25000000}, {0, 2}, {-2, 0, -1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Int4Encode)
    ->ArgNames({"n", "dtype", "isa"})
    ->ArgsProduct({{1000000, 25000000}, {0, 2}, {-2, 0, -1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Int4Decode)
    ->ArgNames({"n", "dtype", "isa"})
    ->ArgsProduct({{1000000, 25000000}, {0, 2}, {-2, 0, -1}})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TopKEncode)
    ->ArgNames({"n", "exact"})
    ->Args({kN, 1})
    ->Args({kN, 0})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_TopKDecode)
    ->ArgNames({"n", "W"})
    ->Args({kN, 2})
    ->Args({kN, 8})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Q4BlockSizeError)
    ->ArgName("block")
    ->Arg(16)
    ->Arg(32)
    ->Arg(64)
    ->Arg(128)
    ->Arg(256)
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
