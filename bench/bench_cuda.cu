// Google Benchmark suite for the CUDA codecs: CUDA-event timing, inputs rotated past L2, and
// the ratio to a device-to-device copy measured in this binary.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "gradcomp/cuda.h"
#include "gradcomp/format.h"
#include "launchers.h"
#include "v2/launchers_v2.h"

namespace {

using namespace gradcomp;

// Enough input copies that consecutive iterations never hit in the 60 MB L2.
constexpr size_t kRotateBytes = size_t{512} << 20;

struct Gpu {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  Gpu() {
    GRADCOMP_CUDA_CHECK(cudaStreamCreate(&stream));
    GRADCOMP_CUDA_CHECK(cudaEventCreate(&start));
    GRADCOMP_CUDA_CHECK(cudaEventCreate(&stop));
  }
};

Gpu& gpu() {
  static Gpu g;
  return g;
}

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  GRADCOMP_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}

// Times fn (enqueued on the stream) with CUDA events; one manual-time sample per iteration.
template <typename F>
void time_loop(benchmark::State& state, F&& fn) {
  for (int i = 0; i < 3; ++i) fn(i);  // warm-up
  int i = 0;
  for (auto _ : state) {
    GRADCOMP_CUDA_CHECK(cudaEventRecord(gpu().start, gpu().stream));
    fn(i++);
    GRADCOMP_CUDA_CHECK(cudaEventRecord(gpu().stop, gpu().stream));
    GRADCOMP_CUDA_CHECK(cudaEventSynchronize(gpu().stop));
    float ms = 0;
    GRADCOMP_CUDA_CHECK(cudaEventElapsedTime(&ms, gpu().start, gpu().stop));
    state.SetIterationTime(ms / 1e3);
  }
}

// Device-to-device copy bandwidth (read + write bytes per second), median of 20.
double device_copy_bytes_per_second() {
  static const double bw = [] {
    const size_t bytes = size_t{1} << 30;
    void* a = device_alloc(bytes);
    void* b = device_alloc(bytes);
    std::vector<float> ms(20);
    for (auto& m : ms) {
      GRADCOMP_CUDA_CHECK(cudaEventRecord(gpu().start, gpu().stream));
      GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, gpu().stream));
      GRADCOMP_CUDA_CHECK(cudaEventRecord(gpu().stop, gpu().stream));
      GRADCOMP_CUDA_CHECK(cudaEventSynchronize(gpu().stop));
      GRADCOMP_CUDA_CHECK(cudaEventElapsedTime(&m, gpu().start, gpu().stop));
    }
    std::nth_element(ms.begin(), ms.begin() + 10, ms.end());
    cudaFree(a);
    cudaFree(b);
    return 2.0 * bytes / (ms[10] / 1e3);
  }();
  return bw;
}

void report(benchmark::State& state, double bytes_per_iter) {
  state.SetBytesProcessed(static_cast<int64_t>(bytes_per_iter * state.iterations()));
  state.counters["vs_copy"] = benchmark::Counter(bytes_per_iter / device_copy_bytes_per_second(),
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

bool skip_without_gpu(benchmark::State& state) {
  if (cuda::device_available()) return false;
  state.SkipWithError("no CUDA device");
  return true;
}

// Rotating copies of a normal-distributed input of n elements of `dtype`.
struct Inputs {
  std::vector<void*> copies;
  Inputs(int64_t n, DType dtype) {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(dtype);
    std::vector<uint8_t> host(bytes);
    std::mt19937 gen(1);
    std::normal_distribution<float> dist;
    for (int64_t i = 0; i < n; ++i)
      math::store_from_float(host.data(), i, static_cast<uint8_t>(dtype), dist(gen));
    const size_t count =
        std::max<size_t>(2, std::min<size_t>(32, kRotateBytes / std::max<size_t>(bytes, 1)));
    for (size_t c = 0; c < count; ++c) {
      copies.push_back(device_alloc(bytes));
      GRADCOMP_CUDA_CHECK(cudaMemcpy(copies.back(), host.data(), bytes, cudaMemcpyHostToDevice));
    }
  }
  ~Inputs() {
    for (void* p : copies) cudaFree(p);
  }
  void* at(int i) const { return copies[static_cast<size_t>(i) % copies.size()]; }
};

Segment* device_segments(const std::vector<Segment>& host) {
  auto* d = static_cast<Segment*>(device_alloc(sizeof(Segment) * host.size()));
  GRADCOMP_CUDA_CHECK(
      cudaMemcpy(d, host.data(), sizeof(Segment) * host.size(), cudaMemcpyHostToDevice));
  return d;
}

// The kernel generation of a benchmark row: 1 (v1) or 2 (v2, opt-in until an H200 run proves it).
kernels::LaunchStatus q4_encode_gen(const Q4EncodeParams& p, int64_t gen) {
  return gen >= 2 ? kernels::v2::run_q4_encode(p, 0, gpu().stream)
                  : kernels::run_q4_encode(p, 0, gpu().stream);
}
kernels::LaunchStatus q4_decode_gen(const Q4DecodeParams& p, int64_t gen) {
  return gen >= 2 ? kernels::v2::run_q4_decode(p, gpu().stream)
                  : kernels::run_q4_decode(p, gpu().stream);
}

void BM_CudaCopy(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const size_t bytes = static_cast<size_t>(state.range(0)) * 4;
  void* a = device_alloc(bytes);
  void* b = device_alloc(bytes);
  time_loop(state,
            [&](int) { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, gpu().stream); });
  report(state, 2.0 * bytes);
  cudaFree(a);
  cudaFree(b);
}

// Args: elements, dtype, stochastic, error feedback, kernel generation.
void BM_CudaQ4Encode(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const int64_t n = state.range(0);
  const DType dtype = static_cast<DType>(state.range(1));
  const bool ef = state.range(3) != 0;
  Inputs in(n, dtype);
  void* r_in = ef ? device_alloc(n * 4) : nullptr;
  void* r_out = ef ? device_alloc(n * 4) : nullptr;
  if (ef) GRADCOMP_CUDA_CHECK(cudaMemset(r_in, 0, n * 4));
  const size_t pbytes = q4_payload_bytes(n, 64);
  auto* payload = static_cast<uint8_t*>(device_alloc(pbytes));
  std::vector<Segment*> segs;
  std::vector<Segment> host;  // v2 reads the host copy to pick its aligned kernel
  for (size_t c = 0; c < in.copies.size(); ++c) {
    host.push_back(Segment{in.copies[c], 0, n});
    segs.push_back(device_segments({host.back()}));
  }
  Q4EncodeParams p;
  p.num_segments = 1;
  p.dtype = static_cast<uint8_t>(dtype);
  p.numel = n;
  p.stochastic = state.range(2) != 0;
  p.residual_in = r_in;
  p.residual_out = r_out;
  p.payload = payload;
  const int64_t gen = state.range(4);
  time_loop(state, [&](int i) {
    const size_t c = static_cast<size_t>(i) % segs.size();
    p.segments = segs[c];
    p.segments_host = &host[c];
    GRADCOMP_CUDA_CHECK(q4_encode_gen(p, gen));
  });
  report(state, static_cast<double>(n) * dtype_size(dtype) + pbytes + (ef ? 8.0 * n : 0.0));
  for (auto* s : segs) cudaFree(s);
  cudaFree(payload);
  cudaFree(r_in);
  cudaFree(r_out);
}

// Args: elements, W, kernel generation. Decode-and-mean of W payloads into fp32, payload checks
// included.
void BM_CudaQ4DecodeSum(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const int64_t n = state.range(0);
  const int world = static_cast<int>(state.range(1));
  const size_t pbytes = q4_payload_bytes(n, 64);
  std::vector<uint8_t*> payloads;
  Inputs in(n, DType::kFloat32);
  Segment* seg = device_segments({Segment{in.at(0), 0, n}});
  for (int w = 0; w < world; ++w) {
    payloads.push_back(static_cast<uint8_t*>(device_alloc(pbytes)));
    Q4EncodeParams e;
    e.segments = seg;
    e.num_segments = 1;
    e.numel = n;
    e.rng.rank = static_cast<uint32_t>(w);
    e.payload = payloads.back();
    GRADCOMP_CUDA_CHECK(kernels::run_q4_encode(e, 0, gpu().stream));
  }
  auto* ptrs = static_cast<const uint8_t**>(device_alloc(sizeof(void*) * world));
  GRADCOMP_CUDA_CHECK(
      cudaMemcpy(ptrs, payloads.data(), sizeof(void*) * world, cudaMemcpyHostToDevice));
  void* out = device_alloc(n * 4);
  const Segment host_oseg{out, 0, n};
  Segment* oseg = device_segments({host_oseg});
  auto* status = static_cast<int32_t*>(device_alloc(8));
  GRADCOMP_CUDA_CHECK(cudaMemset(status, 0, 8));
  // The payloads' body checksums are summed into zeroed words on every launch (as the backend
  // stages them), so each timed decode zeroes them first: a small memset inside the timing.
  // (v2 counts its finished check blocks in one more word.)
  const size_t sum_bytes = sizeof(uint64_t) * (world + 1);
  auto* body_sums = static_cast<uint64_t*>(device_alloc(sum_bytes));
  Q4DecodeParams d;
  d.payloads = ptrs;
  d.num_payloads = world;
  d.payload_bytes = pbytes;
  d.numel = n;
  d.segments = oseg;
  d.num_segments = 1;
  d.divisor = static_cast<float>(world);
  d.segments_host = &host_oseg;
  d.status = status;
  d.body_sums = body_sums;
  const int64_t gen = state.range(2);
  time_loop(state, [&](int) {
    GRADCOMP_CUDA_CHECK(cudaMemsetAsync(body_sums, 0, sum_bytes, gpu().stream));
    GRADCOMP_CUDA_CHECK(q4_decode_gen(d, gen));
  });
  // A refused payload would have made every timed decode write nothing.
  int32_t refused = 0;
  GRADCOMP_CUDA_CHECK(cudaMemcpy(&refused, status, sizeof refused, cudaMemcpyDeviceToHost));
  if (refused != 0) state.SkipWithError("the timed decodes refused their payloads");
  report(state, static_cast<double>(pbytes) * world + 4.0 * n);
  cudaFree(body_sums);
  for (auto* p : payloads) cudaFree(p);
  cudaFree(ptrs);
  cudaFree(out);
  cudaFree(oseg);
  cudaFree(seg);
  cudaFree(status);
}

// Args: elements, exact, kernel generation (1, 2, 3: v2 with GRADCOMP_TOPK_EXACT=cub, whose
// threshold comes from cub::DeviceTopK when the build found CCCL >= 3.3, 4: v2 unfused). k = 1% of
// n; fp32 input with error feedback: a residual is read and the new one written (the target is with
// it).
void BM_CudaTopKEncode(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const int64_t n = state.range(0);
  const bool exact = state.range(1) != 0;
  const bool v2 = state.range(2) >= 2;
  unsetenv("GRADCOMP_TOPK_EXACT");
  unsetenv("GRADCOMP_TOPK_FUSED");
  if (state.range(2) == 3) {
    setenv("GRADCOMP_TOPK_EXACT", "cub", 1);
    state.SetLabel(kernels::v2::topk_exact_method());
  } else if (state.range(2) == 4) {
    setenv("GRADCOMP_TOPK_FUSED", "0", 1);
    state.SetLabel("v2 unfused: bracket pass, radix, full compaction");
  }
  Inputs in(n, DType::kFloat32);
  TopKOptions o;
  o.exact = exact;
  const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
  auto* payload = static_cast<uint8_t*>(device_alloc(topk_payload_bytes(cap, DType::kFloat32)));
  void* ws =
      device_alloc(v2 ? kernels::v2::topk_workspace_bytes(n) : kernels::topk_workspace_bytes(n));
  // The residual starts as a tenth of another normal draw (the encode's output after a step).
  void* r_in = device_alloc(static_cast<size_t>(n) * 4);
  void* r_out = device_alloc(static_cast<size_t>(n) * 4);
  {
    std::vector<float> host(static_cast<size_t>(n));
    std::mt19937 gen(2);
    std::normal_distribution<float> dist(0.0f, 0.1f);
    for (auto& v : host) v = dist(gen);
    GRADCOMP_CUDA_CHECK(cudaMemcpy(r_in, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<Segment*> segs;
  for (size_t c = 0; c < in.copies.size(); ++c)
    segs.push_back(device_segments({Segment{in.copies[c], 0, n}}));
  TopKEncodeParams p;
  p.num_segments = 1;
  p.numel = n;
  p.k = k;
  p.capacity = static_cast<uint32_t>(cap);
  p.exact = exact;
  p.payload = payload;
  p.workspace = ws;
  p.residual_in = r_in;
  p.residual_out = r_out;
  time_loop(state, [&](int i) {
    p.segments = segs[static_cast<size_t>(i) % segs.size()];
    GRADCOMP_CUDA_CHECK(v2 ? kernels::v2::run_topk_encode(p, gpu().stream)
                           : kernels::run_topk_encode(p, gpu().stream));
  });
  // The bytes a fused single pass must move: input and residual read, residual written.
  report(state, 12.0 * n);
  // One read of the input at the copy's rate: the approximate target is at most twice this.
  state.counters["one_read_us"] = 4.0 * n / device_copy_bytes_per_second() * 1e6;
  for (auto* s : segs) cudaFree(s);
  cudaFree(payload);
  cudaFree(ws);
  cudaFree(r_in);
  cudaFree(r_out);
  unsetenv("GRADCOMP_TOPK_EXACT");
  unsetenv("GRADCOMP_TOPK_FUSED");
}

// Args: elements, W, kernel generation. Decode-and-mean of W exact top-k payloads (1 %), the
// payload checks included.
void BM_CudaTopKDecode(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const int64_t n = state.range(0);
  const int world = static_cast<int>(state.range(1));
  const bool v2 = state.range(2) == 2;
  Inputs in(n, DType::kFloat32);
  TopKOptions o;
  const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
  const size_t pbytes = topk_payload_bytes(cap, DType::kFloat32);
  void* ws = device_alloc(
      std::max(kernels::v2::topk_workspace_bytes(n), kernels::topk_workspace_bytes(n)));
  std::vector<uint8_t*> payloads;
  for (int w = 0; w < world; ++w) {
    payloads.push_back(static_cast<uint8_t*>(device_alloc(pbytes)));
    Segment* seg = device_segments({Segment{in.at(w), 0, n}});
    TopKEncodeParams e;
    e.segments = seg;
    e.num_segments = 1;
    e.numel = n;
    e.k = k;
    e.capacity = static_cast<uint32_t>(cap);
    e.payload = payloads.back();
    e.workspace = ws;
    GRADCOMP_CUDA_CHECK(kernels::run_topk_encode(e, gpu().stream));
    GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(gpu().stream));
    cudaFree(seg);
  }
  auto* ptrs = static_cast<const uint8_t**>(device_alloc(sizeof(void*) * world));
  GRADCOMP_CUDA_CHECK(
      cudaMemcpy(ptrs, payloads.data(), sizeof(void*) * world, cudaMemcpyHostToDevice));
  void* out = device_alloc(n * 4);
  const Segment host_oseg{out, 0, n};
  Segment* oseg = device_segments({host_oseg});
  auto* status = static_cast<int32_t*>(device_alloc(8));
  GRADCOMP_CUDA_CHECK(cudaMemset(status, 0, 8));
  auto* body_sums = static_cast<uint64_t*>(device_alloc(sizeof(uint64_t) * (world + 1)));
  TopKDecodeParams d;
  d.payloads = ptrs;
  d.num_payloads = world;
  d.payload_bytes = pbytes;
  d.numel = n;
  d.capacity = static_cast<uint32_t>(cap);
  d.segments = oseg;
  d.num_segments = 1;
  d.divisor = static_cast<float>(world);
  d.status = status;
  d.body_sums = body_sums;
  d.workspace = ws;
  time_loop(state, [&](int) {
    GRADCOMP_CUDA_CHECK(
        cudaMemsetAsync(body_sums, 0, sizeof(uint64_t) * (world + 1), gpu().stream));
    GRADCOMP_CUDA_CHECK(v2 ? kernels::v2::run_topk_decode(d, gpu().stream)
                           : kernels::run_topk_decode(d, gpu().stream));
  });
  int32_t refused = 0;
  GRADCOMP_CUDA_CHECK(cudaMemcpy(&refused, status, sizeof refused, cudaMemcpyDeviceToHost));
  if (refused != 0) state.SkipWithError("the timed decodes refused their payloads");
  report(state, static_cast<double>(pbytes) * world + 4.0 * n);
  for (auto* p : payloads) cudaFree(p);
  cudaFree(ptrs);
  cudaFree(out);
  cudaFree(oseg);
  cudaFree(status);
  cudaFree(body_sums);
  cudaFree(ws);
}

// Args: tensors, fused, kernel generation. 100 tensors encoded by one fused launch, or flattened
// first then encoded.
void BM_CudaFusedPacking(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  const int tensors = static_cast<int>(state.range(0));
  const bool fused = state.range(1) != 0;
  std::mt19937 rng(3);
  std::vector<Segment> host;
  std::vector<void*> bufs;
  int64_t total = 0;
  for (int t = 0; t < tensors; ++t) {
    const int64_t n = 100000 + rng() % 400000;
    bufs.push_back(device_alloc(n * 4));
    GRADCOMP_CUDA_CHECK(cudaMemset(bufs.back(), 0x3c, n * 4));
    host.push_back(Segment{bufs.back(), total, n});
    total += n;
  }
  Segment* list = device_segments(host);
  void* flat = device_alloc(total * 4);
  const Segment host_flat{flat, 0, total};
  Segment* flat_seg = device_segments({host_flat});
  const size_t pbytes = q4_payload_bytes(total, 64);
  auto* payload = static_cast<uint8_t*>(device_alloc(pbytes));
  Q4EncodeParams p;
  p.numel = total;
  p.payload = payload;
  p.num_segments = fused ? tensors : 1;
  p.segments = fused ? list : flat_seg;
  p.segments_host = fused ? host.data() : &host_flat;
  const int64_t gen = state.range(2);
  time_loop(state, [&](int) {
    if (!fused) {
      for (const Segment& s : host) {
        GRADCOMP_CUDA_CHECK(cudaMemcpyAsync(static_cast<float*>(flat) + s.offset, s.data,
                                            s.numel * 4, cudaMemcpyDeviceToDevice, gpu().stream));
      }
    }
    GRADCOMP_CUDA_CHECK(q4_encode_gen(p, gen));
  });
  report(state, 4.0 * total + pbytes);
  for (void* b : bufs) cudaFree(b);
  cudaFree(list);
  cudaFree(flat);
  cudaFree(flat_seg);
  cudaFree(payload);
}

constexpr int64_t kBig = 100'000'000;
constexpr int64_t kBucket = 1 << 20;  // a 1M-element bucket: the launch-latency target

BENCHMARK(BM_CudaCopy)->Arg(kBig)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaQ4Encode)
    ->ArgNames({"n", "dtype", "sr", "ef", "gen"})
    ->ArgsProduct({{kBig}, {0}, {1, 0}, {1, 0}, {1, 2}})
    ->ArgsProduct({{kBig}, {2}, {1}, {0}, {1, 2}})
    ->ArgsProduct({{kBucket}, {0}, {1}, {1}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaQ4DecodeSum)
    ->ArgNames({"n", "W", "gen"})
    ->ArgsProduct({{kBig / 4}, {4}, {1, 2}})
    ->ArgsProduct({{kBig}, {1}, {1, 2}})
    ->ArgsProduct({{kBucket}, {1}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaTopKEncode)
    ->ArgNames({"n", "exact", "gen"})
    ->Args({kBig, 1, 1})
    ->Args({kBig, 1, 2})
    ->Args({kBig, 1, 3})
    ->Args({kBig, 1, 4})
    ->Args({kBig, 0, 1})
    ->Args({kBig, 0, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaTopKDecode)
    ->ArgNames({"n", "W", "gen"})
    ->Args({kBig, 1, 1})
    ->Args({kBig, 1, 2})
    ->Args({kBig / 4, 4, 1})
    ->Args({kBig / 4, 4, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CudaFusedPacking)
    ->ArgNames({"tensors", "fused", "gen"})
    ->ArgsProduct({{100}, {1, 0}, {1, 2}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
BENCHMARK_MAIN();
