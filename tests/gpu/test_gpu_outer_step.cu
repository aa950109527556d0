// DiLoCo's outer step on the v2 CUDA kernels against the CPU backend, byte for byte: the outer
// gradient, the SGD step, the merges, and OuterSync rounds on CUDA against the same on the CPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "gradcomp/cpu.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

// Fragments of several shapes: one element, a tensor shorter than a 16-byte group, odd sizes
// whose fp32 offsets leave 16-byte alignment, every dtype, and (skew) parameters that start one or
// three elements past an aligned address, so the unaligned kernels run too; kMixedSkew: tensor i
// starts i % 4 elements past one, so one table mixes aligned and unaligned tensors.
constexpr int kMixedSkew = -1;
struct Shape {
  std::vector<std::pair<uint8_t, int64_t>> tensors;  // dtype, numel
  int skew;
};

// The fp32 state arrays start one float past 16-byte alignment for odd skews (every element
// singly); the mixed-skew shape keeps them aligned, so its table mixes groups and singles.
int state_skew(const Shape& s) {
  return s.skew == kMixedSkew ? 0 : s.skew % 2;
}

// As a model's hundreds of parameter tensors: 300 of every dtype interleaved, 1 to ~1200
// elements, mixed alignment (one launch per dtype covers them all).
Shape many_tensors() {
  Shape s{{}, kMixedSkew};
  for (int i = 0; i < 300; ++i)
    s.tensors.push_back({static_cast<uint8_t>(i % 3), (i * 37) % 211 + (i % 7 == 0 ? 1000 : 1)});
  return s;
}

std::vector<Shape> shapes() {
  return {{{{math::kDtypeF32, 1}}, 0},
          {{{math::kDtypeF32, 1000}}, 0},
          {{{math::kDtypeF16, 4099}}, 0},
          {{{math::kDtypeBF16, 777}}, 1},
          {{{math::kDtypeF32, 5},
            {math::kDtypeBF16, 61},
            {math::kDtypeF16, 200},
            {math::kDtypeF32, 4096}},
           0},
          {{{math::kDtypeF16, 32}, {math::kDtypeF32, 100003}, {math::kDtypeBF16, 24}}, 3},
          many_tensors()};
}

// Ordinary values with specials sprinkled in: NaN, infinities, signed zeros, subnormals.
float value(std::mt19937& rng, int64_t i) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  switch (i % 211) {
    case 7:
      return std::numeric_limits<float>::quiet_NaN();
    case 19:
      return std::numeric_limits<float>::infinity();
    case 23:
      return -0.0f;
    case 41:
      return 1e-40f;
    case 43:
      return 3e-6f;  // an fp16 subnormal
    default:
      return n(rng);
  }
}

std::vector<float> floats(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = value(rng, i);
  return v;
}

uint64_t dsize(uint8_t dtype) {
  return math::dtype_bytes(dtype);
}

// One fragment's parameters on the host and (skewed) on the device.
struct Fragment {
  Fragment(const Shape& s, uint32_t seed) : shape(s) {
    for (const auto& [dtype, n] : s.tensors) {
      const int k = s.skew == kMixedSkew ? static_cast<int>(host.size() % 4) : s.skew;
      std::vector<float> v = floats(n, seed++);
      std::vector<uint8_t> bytes(static_cast<size_t>(n * dsize(dtype)));
      for (int64_t e = 0; e < n; ++e)
        math::store_from_float(bytes.data(), e, dtype, v[static_cast<size_t>(e)]);
      host.push_back(bytes);
      const uint64_t skew = k * dsize(dtype);
      device.push_back(std::make_unique<DeviceBuffer>(bytes.size() + skew));
      GRADCOMP_CUDA_CHECK(cudaMemcpy(device.back()->get() + skew, bytes.data(), bytes.size(),
                                     cudaMemcpyHostToDevice));
      host_tensors.push_back({host.back().data(), n, numel, dtype});
      device_tensors.push_back({device.back()->get() + skew, n, numel, dtype});
      numel += n;
    }
    // The vectors' buffers moved as they grew: point at where they are now.
    for (size_t i = 0; i < host.size(); ++i) host_tensors[i].data = host[i].data();
  }
  // The device parameters' bytes, tensor after tensor.
  std::vector<uint8_t> device_bytes() const {
    std::vector<uint8_t> out;
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    for (size_t i = 0; i < host.size(); ++i) {
      std::vector<uint8_t> b(host[i].size());
      GRADCOMP_CUDA_CHECK(
          cudaMemcpy(b.data(), device_tensors[i].data, b.size(), cudaMemcpyDeviceToHost));
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
  std::vector<uint8_t> host_bytes() const {
    std::vector<uint8_t> out;
    for (const auto& b : host) out.insert(out.end(), b.begin(), b.end());
    return out;
  }
  Shape shape;
  int64_t numel = 0;
  std::vector<std::vector<uint8_t>> host;
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  std::vector<OuterTensor> host_tensors, device_tensors;
};

// An fp32 array on the host and on the device (with an offset of one float when skewed).
struct Floats {
  Floats(std::vector<float> v, int skew) : host(std::move(v)), skew(skew) {
    device = std::make_unique<DeviceBuffer>((host.size() + skew) * sizeof(float));
    GRADCOMP_CUDA_CHECK(
        cudaMemcpy(dev(), host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  float* dev() const { return reinterpret_cast<float*>(device->get()) + skew; }
  std::vector<uint8_t> host_bytes() const {
    std::vector<uint8_t> b(host.size() * sizeof(float));
    std::memcpy(b.data(), host.data(), b.size());
    return b;
  }
  std::vector<uint8_t> device_bytes() const {
    std::vector<uint8_t> b(host.size() * sizeof(float));
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(b.data(), dev(), b.size(), cudaMemcpyDeviceToHost));
    return b;
  }
  std::vector<float> host;
  int skew;
  std::unique_ptr<DeviceBuffer> device;
};

#define EXPECT_SAME_BYTES(cpu, gpu, what) \
  EXPECT_TRUE((cpu) == (gpu)) << (what) << ": " << first_difference(cpu, gpu)

TEST(GpuOuterStep, GradientEqualsTheCpuForEveryDtypeAndSize) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  uint32_t seed = 1;
  for (const Shape& s : shapes()) {
    for (bool widen : {false, true}) {
      Fragment f(s, seed++);
      Floats anchor(floats(f.numel, seed++), state_skew(s)), g(std::vector<float>(f.numel), 0);
      const std::string what = "shape " + std::to_string(f.numel) + (widen ? " widened" : "");
      OuterGradientParams p;
      p.num_tensors = static_cast<int>(f.host_tensors.size());
      p.numel = f.numel;
      p.tensors = f.host_tensors.data();
      p.anchor = widen ? nullptr : anchor.host.data();
      p.gradient = g.host.data();
      cpu->outer_gradient(p);
      p.tensors = f.device_tensors.data();
      p.anchor = widen ? nullptr : anchor.dev();
      p.gradient = g.dev();
      gpu->outer_gradient(p);
      EXPECT_SAME_BYTES(g.host_bytes(), g.device_bytes(), what);
    }
  }
}

TEST(GpuOuterStep, StepEqualsTheCpuWithAndWithoutNesterovStoreAndBuffer) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  uint32_t seed = 100;
  for (const Shape& s : shapes()) {
    for (int variant = 0; variant < 8; ++variant) {
      const bool nesterov = variant & 1, store = variant & 2, keep = variant & 4;
      Fragment f(s, seed++);
      Floats anchor(floats(f.numel, seed++), 0), g(floats(f.numel, seed++), state_skew(s));
      Floats buf(floats(f.numel, seed++), 0), out(std::vector<float>(f.numel), 0);
      const std::string what = "shape " + std::to_string(f.numel) + " nesterov " +
                               std::to_string(nesterov) + " store " + std::to_string(store) +
                               " keep " + std::to_string(keep);
      // Keeping the buffer: in place, as a blocking round steps; dropping it: into `out`, as the
      // eager step does.
      auto run = [&](Backend& b, bool on_gpu) {
        OuterStepParams p;
        p.anchor = on_gpu ? anchor.dev() : anchor.host.data();
        p.gradient = on_gpu ? g.dev() : g.host.data();
        p.momentum = on_gpu ? buf.dev() : buf.host.data();
        float* anchor_out = const_cast<float*>(p.anchor);
        p.anchor_out = keep ? anchor_out : (on_gpu ? out.dev() : out.host.data());
        p.momentum_out = keep ? const_cast<float*>(p.momentum) : nullptr;
        p.numel = f.numel;
        p.lr = 0.7f;
        p.mu = 0.9f;
        p.nesterov = nesterov;
        if (store) {
          p.tensors = on_gpu ? f.device_tensors.data() : f.host_tensors.data();
          p.num_tensors = static_cast<int>(f.host_tensors.size());
        }
        b.outer_step(p);
      };
      run(*cpu, false);
      run(*gpu, true);
      EXPECT_SAME_BYTES(anchor.host_bytes(), anchor.device_bytes(), what + " anchor");
      EXPECT_SAME_BYTES(buf.host_bytes(), buf.device_bytes(), what + " buffer");
      EXPECT_SAME_BYTES(out.host_bytes(), out.device_bytes(), what + " out");
      EXPECT_SAME_BYTES(f.host_bytes(), f.device_bytes(), what + " parameters");
    }
  }
}

TEST(GpuOuterStep, MergesEqualTheCpu) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  uint32_t seed = 300;
  for (const Shape& s : shapes()) {
    for (OuterMerge mode : {OuterMerge::kStore, OuterMerge::kMix, OuterMerge::kEagerCorrect}) {
      Fragment f(s, seed++);
      Floats global(floats(f.numel, seed++), state_skew(s)), eager(floats(f.numel, seed++), 0);
      const std::string what =
          "shape " + std::to_string(f.numel) + " mode " + std::to_string(int(mode));
      OuterMergeParams p;
      p.num_tensors = static_cast<int>(f.host_tensors.size());
      p.numel = f.numel;
      p.alpha = 0.3f;
      p.mode = mode;
      p.tensors = f.host_tensors.data();
      p.global = global.host.data();
      p.eager = eager.host.data();
      cpu->outer_merge(p);
      p.tensors = f.device_tensors.data();
      p.global = global.dev();
      p.eager = eager.dev();
      gpu->outer_merge(p);
      EXPECT_SAME_BYTES(f.host_bytes(), f.device_bytes(), what);
    }
  }
}

// The device table is cached per tensor list: the same list again (new values) reuses it, a
// list of the same shape elsewhere gets its own, more lists than the cache holds evict the
// oldest, and the first list is then rebuilt; every result equals the CPU's.
TEST(GpuOuterStep, TablesCachedPerLayoutAndRebuiltWhenItChanges) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  const Shape shape = shapes()[4];
  std::vector<std::unique_ptr<Fragment>> fragments;
  for (int i = 0; i < 20; ++i) fragments.push_back(std::make_unique<Fragment>(shape, 900 + i));
  uint32_t seed = 1000;
  auto check = [&](Fragment& f, const std::string& what) {
    Floats anchor(floats(f.numel, seed++), 0), g(std::vector<float>(f.numel), 0);
    OuterGradientParams p;
    p.num_tensors = static_cast<int>(f.host_tensors.size());
    p.numel = f.numel;
    p.tensors = f.host_tensors.data();
    p.anchor = anchor.host.data();
    p.gradient = g.host.data();
    cpu->outer_gradient(p);
    p.tensors = f.device_tensors.data();
    p.anchor = anchor.dev();
    p.gradient = g.dev();
    gpu->outer_gradient(p);
    EXPECT_SAME_BYTES(g.host_bytes(), g.device_bytes(), what);
  };
  check(*fragments[0], "first list");
  check(*fragments[0], "first list again");
  for (int i = 1; i < 20; ++i) check(*fragments[i], "list " + std::to_string(i));
  check(*fragments[0], "first list after eviction");
}

TEST(GpuOuterStep, RefusedUnderV1AndOnBadParamsNamingWhy) {
  SKIP_WITHOUT_GPU();
  auto v1 = backend_of(KernelGeneration::kV1);
  ASSERT_NE(v1->outer_unsupported(), nullptr);
  Fragment f(shapes()[1], 7);
  Floats a(floats(f.numel, 8), 0), g(std::vector<float>(f.numel), 0);
  OuterGradientParams p;
  p.tensors = f.device_tensors.data();
  p.num_tensors = 1;
  p.numel = f.numel;
  p.anchor = a.dev();
  p.gradient = g.dev();
  try {
    v1->outer_gradient(p);
    ADD_FAILURE() << "v1 ran the outer gradient";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GRADCOMP_KERNELS=v2"), std::string::npos) << e.what();
  }
  auto v2 = backend_of(KernelGeneration::kV2);
  EXPECT_EQ(v2->outer_unsupported(), nullptr);
  p.numel = f.numel + 1;  // the tensors no longer tile the fragment
  try {
    v2->outer_gradient(p);
    ADD_FAILURE() << "a fragment the tensors do not tile was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("add up"), std::string::npos) << e.what();
  }
  EXPECT_SAME_BYTES(std::vector<uint8_t>(f.numel * 4), g.device_bytes(), "untouched");
}

// A rank of an in-process group whose collectives take device memory: staged through the host
// after the device finished what the backend queued.
class DeviceRelay final : public Communicator {
 public:
  explicit DeviceRelay(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  bool device_memory() const override { return true; }

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    relay(send, bytes * world_size(), recv, bytes * world_size(),
          [&](const void* s, void* r) { inner_.all_to_all(s, r, bytes); });
  }
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    relay(send, bytes, recv, bytes * world_size(),
          [&](const void* s, void* r) { inner_.all_gather(s, r, bytes); });
  }
  void run_allreduce_mean(void* data, int64_t n, DType d) override {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(d);
    relay(data, bytes, data, bytes, [&](const void* s, void* r) {
      std::memcpy(r, s, bytes);
      inner_.allreduce_mean(r, n, d);
    });
  }
  void run_reduce_scatter_mean(const void* send, void* recv, int64_t n, DType d) override {
    const size_t bytes = static_cast<size_t>(n) * dtype_size(d);
    relay(send, bytes * world_size(), recv, bytes,
          [&](const void* s, void* r) { inner_.reduce_scatter_mean(s, r, n, d); });
  }

 private:
  template <typename F>
  void relay(const void* send, size_t send_bytes, void* recv, size_t recv_bytes, F&& f) {
    std::vector<uint8_t> s(send_bytes), r(recv_bytes);
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(s.data(), send, send_bytes, cudaMemcpyDeviceToHost));
    f(s.data(), r.data());
    GRADCOMP_CUDA_CHECK(cudaMemcpy(recv, r.data(), recv_bytes, cudaMemcpyHostToDevice));
  }
  Communicator& inner_;
};

// W = 2 ranks, fp32/bf16/fp16 parameters, two fragments, q4: every rank's parameters and state
// after three rounds equal on CUDA (v2) and on the CPU. tau = 0, or tau = 1 with mixing, or
// eager (tau > 0 needs the v2 outer step on CUDA).
TEST(GpuOuterStep, OuterSyncRoundsOnCudaEqualTheCpu) {
  SKIP_WITHOUT_GPU();
  const int world = 2;
  const Shape shape{{{math::kDtypeF32, 301}, {math::kDtypeBF16, 97}, {math::kDtypeF16, 1000}}, 0};
  for (int variant = 0; variant < 3; ++variant) {
    OuterSyncOptions o;
    o.inner_steps = 4;
    o.fragments = 2;
    o.overlap_steps = variant == 0 ? 0 : 1;
    o.mixing = variant == 1 ? 0.25f : 0.0f;
    o.eager = variant == 2;
    CompressionConfig c;
    c.seed = 3;
    std::vector<std::vector<uint8_t>> cpu_params(world), gpu_params(world);
    std::vector<std::vector<std::vector<float>>> cpu_state(world), gpu_state(world);
    for (bool on_gpu : {false, true}) {
      InProcessGroup group(world);
      testing::run_ranks(group, [&](int r, Communicator& comm) {
        DeviceRelay relay(comm);
        cuda::CudaBackendOptions bo;
        bo.kernels = KernelGeneration::kV2;
        auto backend = on_gpu ? cuda::make_cuda_backend(bo) : make_cpu_backend();
        Fragment f(shape, 50);  // the same start on every rank
        std::vector<OuterParam> params;
        const auto& tensors = on_gpu ? f.device_tensors : f.host_tensors;
        for (const OuterTensor& t : tensors)
          params.push_back({t.data, t.numel, static_cast<DType>(t.dtype)});
        OuterSync sync(on_gpu ? static_cast<Communicator&>(relay) : comm, *backend, c, o, params);
        for (uint64_t t = 1; t <= 12; ++t) {
          // An inner step: each rank drifts its parameters its own way (host copy, then upload).
          for (size_t i = 0; i < f.host.size(); ++i) {
            const OuterTensor& h = f.host_tensors[i];
            for (int64_t e = 0; e < h.numel; ++e) {
              const float v = math::load_as_float(h.data, e, h.dtype);
              math::store_from_float(h.data, e, h.dtype,
                                     v + 0.01f * std::sin(float(r + 1) * t + float(e)));
            }
            if (on_gpu) {
              GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
              GRADCOMP_CUDA_CHECK(cudaMemcpy(f.device_tensors[i].data, h.data, f.host[i].size(),
                                             cudaMemcpyHostToDevice));
            }
          }
          sync.step();
          // Read back what the round wrote, so the next drift starts from it.
          if (on_gpu) {
            GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
            for (size_t i = 0; i < f.host.size(); ++i)
              GRADCOMP_CUDA_CHECK(cudaMemcpy(f.host[i].data(), f.device_tensors[i].data,
                                             f.host[i].size(), cudaMemcpyDeviceToHost));
          }
        }
        sync.flush();
        const OuterSyncState st = sync.state();
        (on_gpu ? gpu_params : cpu_params)[r] = on_gpu ? f.device_bytes() : f.host_bytes();
        auto& state = (on_gpu ? gpu_state : cpu_state)[r];
        for (const auto& a : st.anchors) state.push_back(a);
        for (const auto& m : st.momenta) state.push_back(m);
      });
    }
    for (int r = 0; r < world; ++r) {
      const std::string what = "variant " + std::to_string(variant) + " rank " + std::to_string(r);
      EXPECT_SAME_BYTES(cpu_params[r], gpu_params[r], what + " parameters");
      ASSERT_EQ(cpu_state[r].size(), gpu_state[r].size());
      for (size_t i = 0; i < cpu_state[r].size(); ++i)
        EXPECT_EQ(0, std::memcmp(cpu_state[r][i].data(), gpu_state[r][i].data(),
                                 cpu_state[r][i].size() * sizeof(float)))
            << what << " state array " << i;
    }
  }
}

}  // namespace
}  // namespace gradcomp
