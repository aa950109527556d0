// GPU tests: CUDA payloads byte-identical to CPU payloads (q4 in both kernel generations);
// fusion, decoding, hardening, NCCL.
// Without a CUDA device every test here reports as skipped.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "gpu_test_util.h"
#include "gradcomp/collectives.h"
#include "gradcomp/cuda.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/nccl_communicator.h"

namespace gradcomp {
namespace {

using testing::HostTensor;

TEST(GpuQ4, PayloadsAndResidualsEqualTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    auto backend = backend_of(g);
    for (DType dtype : kDtypes) {
      for (int64_t n : testing::edge_lengths()) {
        for (bool stochastic : {true, false}) {
          HostTensor x =
              HostTensor::from_floats(dtype, testing::normal_floats(n, static_cast<uint32_t>(n)));
          std::vector<float> r = testing::normal_floats(n, 3, 0.1f);
          if (n > 70) x.set(70, std::nanf(""));
          auto ref = testing::q4_encode_tensor(x, 64, stochastic, {5, 6, 7, 8, 1}, r, true);
          DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), r.size() * 4),
              dout(r.size() * 4 + 16), dp(ref.payload.size());
          Segment seg{dx.get(), 0, n};
          Q4EncodeParams p;
          p.segments = &seg;
          p.num_segments = 1;
          p.dtype = testing::code(dtype);
          p.numel = n;
          p.residual_in = dr.get();
          p.residual_out = dout.get();
          p.stochastic = stochastic;
          p.rng = {5, 6, 7, 8, 1};
          p.payload = dp.get();
          backend->q4_encode(p);
          ASSERT_EQ(dp.host(), ref.payload)
              << dtype_name(dtype) << " n=" << n << " " << first_difference(dp.host(), ref.payload);
          auto res = dout.host();
          ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0)
              << dtype_name(dtype) << " n=" << n;

          // Decode of two payloads summed and averaged equals the CPU's, in every output dtype.
          HostTensor cpu_out =
              testing::q4_decode_payloads({&ref.payload, &ref.payload}, n, 64, dtype, 2.0f);
          DeviceBuffer dy(x.bytes.size());
          Segment oseg{dy.get(), 0, n};
          const uint8_t* ptrs[2] = {dp.get(), dp.get()};
          Q4DecodeParams d;
          d.payloads = ptrs;
          d.num_payloads = 2;
          d.payload_bytes = ref.payload.size();
          d.numel = n;
          d.segments = &oseg;
          d.num_segments = 1;
          d.dtype = testing::code(dtype);
          d.divisor = 2.0f;
          backend->q4_decode(d);
          EXPECT_EQ(backend->take_decode_status(), n > 70);
          ASSERT_EQ(dy.host(), cpu_out.bytes) << dtype_name(dtype) << " n=" << n << " "
                                              << first_difference(dy.host(), cpu_out.bytes);
        }
      }
    }
  }
}

// The device scan flags the values the CPU scan flags (the hierarchical allreduce's gathered
// bucket), in a segment table of two dtypes' worth of sizes.
TEST(GpuScan, NonFiniteScanFlagsWhatTheCpuScanFlags) {
  SKIP_WITHOUT_GPU();
  auto gpu = cuda::make_cuda_backend();
  auto cpu = make_cpu_backend();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (float bad : {0.0f, NAN, -INFINITY}) {
      HostTensor a = HostTensor::from_floats(dtype, testing::normal_floats(300, 1));
      HostTensor b = HostTensor::from_floats(dtype, testing::normal_floats(70001, 2));
      if (bad != 0.0f) b.set(70000, bad);
      DeviceBuffer da(a.bytes.data(), a.bytes.size()), db(b.bytes.data(), b.bytes.size());
      Segment host_segs[2] = {a.segment(), b.segment()};
      Segment dev_segs[2] = {Segment{da.get(), 0, 300}, Segment{db.get(), 300, 70001}};
      host_segs[1].offset = 300;
      for (int device = 0; device < 2; ++device) {
        NonfiniteScanParams p;
        p.segments = device ? dev_segs : host_segs;
        p.num_segments = 2;
        p.dtype = static_cast<uint8_t>(dtype);
        p.numel = 70301;
        Backend& backend = device ? *gpu : *cpu;
        backend.scan_nonfinite(p);
        EXPECT_EQ(backend.take_decode_status(), bad != 0.0f)
            << (device ? "cuda " : "cpu ") << dtype_name(dtype) << " " << bad;
      }
    }
  }
}

TEST(GpuQ4, FusedPackingEqualsUnfused) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    auto backend = backend_of(g);
    std::mt19937 gen(1);
    std::vector<std::unique_ptr<DeviceBuffer>> tensors;
    std::vector<Segment> segs;
    std::vector<float> flat;
    int64_t off = 0;
    for (int t = 0; t < 100; ++t) {
      const int64_t n = 1 + gen() % 5000;
      auto v = testing::normal_floats(n, t);
      tensors.push_back(std::make_unique<DeviceBuffer>(v.data(), n * 4));
      segs.push_back(Segment{tensors.back()->get(), off, n});
      flat.insert(flat.end(), v.begin(), v.end());
      off += n;
    }
    DeviceBuffer dflat(flat.data(), flat.size() * 4);
    Segment whole{dflat.get(), 0, off};
    const size_t bytes = q4_payload_bytes(off, 64);
    DeviceBuffer a(bytes), b(bytes);
    Q4EncodeParams p;
    p.segments = segs.data();
    p.num_segments = 100;
    p.numel = off;
    p.rng = {1, 2, 3, 4, 0};
    p.payload = a.get();
    backend->q4_encode(p);
    p.segments = &whole;
    p.num_segments = 1;
    p.payload = b.get();
    backend->q4_encode(p);
    EXPECT_EQ(a.host(), b.host());
    HostTensor hx = HostTensor::from_floats(DType::kFloat32, flat);
    EXPECT_EQ(a.host(), testing::q4_encode_tensor(hx, 64, true, {1, 2, 3, 4, 0}).payload);
  }
}

// Format v2: a flipped bit in the sections fails the body checksum summed on the device, and
// check_payloads refuses a bad chunk among chunks of differing sizes before anything is decoded.
TEST(GpuQ4, CorruptSectionsAreRejectedByTheBodyChecksumOnTheDevice) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    expect_corrupt_payload_rejected<Error>(
        *backend_of(g), format::kCodecQ4,
        [](std::vector<uint8_t>& p) { p[p.size() - 40] ^= 0x10; },  // a code nibble
        "body checksum");
  }
}

TEST(GpuQ4, CorruptHeaderIsRejectedAndOutputUntouched) {
  SKIP_WITHOUT_GPU();
  for (KernelGeneration g : kGenerations) {
    SCOPED_TRACE(gen_name(g));
    auto backend = backend_of(g);
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(1000, 1));
    auto enc = testing::q4_encode_tensor(x, 64, true, {1, 0, 0, 0, 0});
    enc.payload[20] ^= 1;
    DeviceBuffer dp(enc.payload.data(), enc.payload.size());
    std::vector<float> sentinel(1000, 42.0f);
    DeviceBuffer dy(sentinel.data(), 4000);
    Segment seg{dy.get(), 0, 1000};
    const uint8_t* ptr = dp.get();
    Q4DecodeParams d;
    d.payloads = &ptr;
    d.num_payloads = 1;
    d.payload_bytes = enc.payload.size();
    d.numel = 1000;
    d.segments = &seg;
    d.num_segments = 1;
    // Decodes are queued; the rejection is reported at the next status check.
    backend->q4_decode(d);
    EXPECT_THROW(backend->take_decode_status(), Error);
    auto out = dy.host();
    EXPECT_EQ(std::memcmp(out.data(), sentinel.data(), 4000), 0);
  }
}

TEST(GpuTopK, PayloadsAndResidualsEqualTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  for (DType dtype : kDtypes) {
    for (int64_t n : testing::edge_lengths()) {
      for (bool exact : {true, false}) {
        for (DType vd : {DType::kFloat32, DType::kBFloat16}) {
          HostTensor x = HostTensor::from_floats(
              dtype, testing::normal_floats(n, static_cast<uint32_t>(n) + 1));
          std::vector<float> r = testing::normal_floats(n, 4, 0.1f);
          TopKOptions o;
          o.exact = exact;
          const int64_t k = topk_k(n, o.ratio), cap = topk_capacity(n, o);
          auto ref = testing::topk_encode_tensor(x, k, cap, exact, vd, r);
          DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), n * 4), dout(n * 4 + 16),
              dp(ref.payload.size()), ws(backend->topk_workspace_bytes(n));
          Segment seg{dx.get(), 0, n};
          TopKEncodeParams p;
          p.segments = &seg;
          p.num_segments = 1;
          p.dtype = testing::code(dtype);
          p.numel = n;
          p.residual_in = dr.get();
          p.residual_out = dout.get();
          p.k = k;
          p.capacity = static_cast<uint32_t>(cap);
          p.exact = exact;
          p.value_dtype = testing::code(vd);
          p.payload = dp.get();
          p.workspace = ws.get();
          backend->topk_encode(p);
          ASSERT_EQ(dp.host(), ref.payload) << dtype_name(dtype) << " n=" << n << " exact=" << exact
                                            << " " << first_difference(dp.host(), ref.payload);
          auto res = dout.host();
          ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0);

          HostTensor cpu_out(dtype, n);
          Segment cseg = cpu_out.segment();
          std::vector<const uint8_t*> cptrs = {ref.payload.data(), ref.payload.data(),
                                               ref.payload.data()};
          cpu::topk_decode(testing::topk_decode_params(cptrs, ref.payload.size(), n, cap, vd, &cseg,
                                                       dtype, 3.0f));
          DeviceBuffer dy(x.bytes.size());
          Segment oseg{dy.get(), 0, n};
          std::vector<const uint8_t*> gptrs = {dp.get(), dp.get(), dp.get()};
          TopKDecodeParams d = testing::topk_decode_params(gptrs, ref.payload.size(), n, cap, vd,
                                                           &oseg, dtype, 3.0f);
          d.workspace = ws.get();
          backend->topk_decode(d);
          ASSERT_EQ(dy.host(), cpu_out.bytes) << first_difference(dy.host(), cpu_out.bytes);
        }
      }
    }
  }
}

// k = 0 is accepted by both backends (it used to be refused on the GPU only) and selects nothing.
TEST(GpuTopK, KZeroEqualsTheCpu) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{4099}}) {
    HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(n, 6));
    if (n > 7) x.set(7, std::nanf(""));
    std::vector<float> r = testing::normal_floats(n, 5, 0.1f);
    auto ref = testing::topk_encode_tensor(x, 0, 0, true, DType::kFloat32, r);
    DeviceBuffer dx(x.bytes.data(), x.bytes.size()), dr(r.data(), n * 4), dout(n * 4 + 16),
        dp(ref.payload.size()), ws(backend->topk_workspace_bytes(n));
    Segment seg{dx.get(), 0, n};
    TopKEncodeParams p;
    p.segments = &seg;
    p.num_segments = 1;
    p.numel = n;
    p.residual_in = dr.get();
    p.residual_out = dout.get();
    p.k = 0;
    p.capacity = 0;
    p.payload = dp.get();
    p.workspace = ws.get();
    backend->topk_encode(p);
    ASSERT_EQ(dp.host(), ref.payload)
        << "n=" << n << " " << first_difference(dp.host(), ref.payload);
    auto res = dout.host();
    ASSERT_EQ(std::memcmp(res.data(), ref.residual.data(), n * 4), 0) << "n=" << n;
  }
}

TEST(GpuTopK, OutOfRangeIndexIsRejectedOnTheDevice) {
  SKIP_WITHOUT_GPU();
  auto backend = cuda::make_cuda_backend();
  HostTensor x = HostTensor::from_floats(DType::kFloat32, testing::normal_floats(2000, 1));
  auto enc = testing::topk_encode_tensor(x, 20, 20, true, DType::kFloat32);
  reinterpret_cast<uint32_t*>(enc.payload.data() + kPayloadHeaderBytes)[3] = 1u << 30;
  DeviceBuffer dp(enc.payload.data(), enc.payload.size()), ws(backend->topk_workspace_bytes(2000));
  std::vector<float> sentinel(2000, 42.0f);
  DeviceBuffer dy(sentinel.data(), 8000);
  Segment seg{dy.get(), 0, 2000};
  std::vector<const uint8_t*> ptrs = {dp.get()};
  TopKDecodeParams d = testing::topk_decode_params(ptrs, enc.payload.size(), 2000, 20,
                                                   DType::kFloat32, &seg, DType::kFloat32);
  d.workspace = ws.get();
  backend->topk_decode(d);
  EXPECT_THROW(backend->take_decode_status(), Error);
  auto out = dy.host();
  EXPECT_EQ(std::memcmp(out.data(), sentinel.data(), 8000), 0);
}

// A one-rank NCCL communicator and a stream, released at scope exit.
struct OneRankNccl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  OneRankNccl() {
    int dev = 0;
    GRADCOMP_NCCL_CHECK(ncclCommInitAll(&comm, 1, &dev));
    GRADCOMP_CUDA_CHECK(cudaStreamCreate(&stream));
  }
  ~OneRankNccl() {
    ncclCommDestroy(comm);
    cudaStreamDestroy(stream);
  }
};

// A configuration on the GPU (NCCL, one rank) and on the CPU (in-process, one rank; the same
// configuration unless given another).
struct EnginePair {
  NcclCommunicator nccl;
  std::unique_ptr<Backend> gpu;
  CompressedAllreduce gpu_engine;
  InProcessGroup group{1};
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  CompressedAllreduce cpu_engine;
  EnginePair(const OneRankNccl& rank, const CompressionConfig& c) : EnginePair(rank, c, c) {}
  EnginePair(const OneRankNccl& rank, const CompressionConfig& c, const CompressionConfig& on_cpu)
      : nccl(rank.comm, rank.stream),
        gpu(cuda::make_cuda_backend(cuda::CudaBackendOptions{0, rank.stream, 0})),
        gpu_engine(nccl, *gpu, c),
        cpu_engine(group.communicator(0), *cpu, on_cpu) {}
};

// Also q4 configured for pieces of 1000 elements: on the GPU a bucket goes in one piece (stream
// order, nothing to overlap), the same bytes as the CPU's one piece.
TEST(GpuCollectives, NcclEngineMatchesTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  OneRankNccl nccl_rank;
  for (int variant = 0; variant < 3; ++variant) {
    CompressionConfig c;
    c.codec = variant == 1 ? Codec::kTopK : Codec::kQ4;
    c.seed = 9;
    CompressionConfig on_cpu = c;
    if (variant == 2) {
      c.piece_numel = 1000;
      on_cpu.piece_numel = 0;
    }
    EnginePair engines(nccl_rank, c, on_cpu);
    CompressedAllreduce& gpu_engine = engines.gpu_engine;
    CompressedAllreduce& cpu_engine = engines.cpu_engine;
    for (int step = 0; step < 3; ++step) {
      HostTensor x = HostTensor::from_floats(DType::kBFloat16, testing::normal_floats(10007, step));
      DeviceBuffer dx(x.bytes.data(), x.bytes.size());
      Segment gseg{dx.get(), 0, x.numel}, cseg = x.segment();
      EXPECT_TRUE(gpu_engine.allreduce(&gseg, 1, DType::kBFloat16, 1));
      EXPECT_TRUE(cpu_engine.allreduce(&cseg, 1, DType::kBFloat16, 1));
      gpu_engine.advance_step();
      cpu_engine.advance_step();
      ASSERT_EQ(dx.host(), x.bytes) << "variant " << variant << " step " << step << " "
                                    << first_difference(dx.host(), x.bytes);
    }
  }
}

// The queued path (what the DDP hook uses on CUDA) gives the CPU engine's bytes, and a
// non-finite step keeps the residuals (and top-k velocities) on the device exactly as the CPU
// engine keeps them. Variant 2 runs DGC's remedies: clipping (the fixed-order norm on the
// device), momentum correction, masking and the warm-up's shrinking payloads; variant 3 the q4
// warm-up with momentum, switching to top-k at step 2 (own-chunk residuals released).
TEST(GpuCollectives, QueuedNcclEngineKeepsResidualsOnNonFiniteSteps) {
  SKIP_WITHOUT_GPU();
  OneRankNccl nccl_rank;
  for (int variant = 0; variant < 4; ++variant) {
    CompressionConfig c;
    c.codec = variant == 0 ? Codec::kQ4 : Codec::kTopK;
    c.seed = 11;
    if (variant == 2) {
      c.remedies.momentum = 0.9f;
      c.remedies.clip_norm = 20.0f;
      c.remedies.warmup_steps = 3;
    }
    if (variant == 3) {
      c.remedies.momentum = 0.9f;
      c.remedies.warmup = TopKWarmup::kQ4;
      c.remedies.warmup_steps = 2;
    }
    EnginePair engines(nccl_rank, c);
    CompressedAllreduce& gpu_engine = engines.gpu_engine;
    CompressedAllreduce& cpu_engine = engines.cpu_engine;
    uint64_t cpu_nonfinite = 0;
    for (int step = 0; step < 4; ++step) {
      auto v = testing::normal_floats(5003, 40 + step);
      if (step == 2) v[77] = std::numeric_limits<float>::quiet_NaN();
      HostTensor x = HostTensor::from_floats(DType::kFloat32, v);
      DeviceBuffer dx(x.bytes.data(), x.bytes.size());
      Segment gseg{dx.get(), 0, x.numel}, cseg = x.segment();
      gpu_engine.enqueue_allreduce(&gseg, 1, DType::kFloat32, 3);
      if (!cpu_engine.allreduce(&cseg, 1, DType::kFloat32, 3)) ++cpu_nonfinite;
      gpu_engine.advance_step();
      cpu_engine.advance_step();
      ASSERT_EQ(dx.host(), x.bytes) << "variant " << variant << " step " << step << " "
                                    << first_difference(dx.host(), x.bytes);
    }
    EXPECT_EQ(cpu_nonfinite, 1u);
    // poll() never waits: its first call queues a snapshot, later calls return it once ready.
    uint64_t polled = 0;
    while (!gpu_engine.poll(&polled)) {
    }
    EXPECT_EQ(polled + gpu_engine.synchronize(), cpu_nonfinite);
    const CompressionState gs = gpu_engine.state(), cs = cpu_engine.state();
    EXPECT_EQ(gs.residuals, cs.residuals);
    EXPECT_EQ(gs.chunk_residuals, cs.chunk_residuals);
    EXPECT_EQ(gs.velocities, cs.velocities);
    EXPECT_EQ(gs.velocities.empty(), variant < 2);
  }
}

}  // namespace
}  // namespace gradcomp
