// OuterSync over a backend without outer-step kernels (CUDA under v1): the outer state in host
// memory and the parameters staged through it give the bytes of the direct path; tau > 0 refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gradcomp/forwarding_backend.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "math/half.h"
#include "run_ranks.h"

namespace gradcomp {
namespace {

// The CPU backend with its outer operations withheld, as the CUDA backend under v1 withholds
// them: OuterSync must stage through its own host backend and never call these.
class NoOuterKernels final : public ForwardingBackend {
 public:
  NoOuterKernels() : ForwardingBackend(make_cpu_backend()) {}
  void outer_gradient(const OuterGradientParams&) override { ADD_FAILURE() << "outer_gradient"; }
  void outer_step(const OuterStepParams&) override { ADD_FAILURE() << "outer_step"; }
  void outer_merge(const OuterMergeParams&) override { ADD_FAILURE() << "outer_merge"; }
  const char* outer_unsupported() const override {
    return "no outer kernels (set GRADCOMP_KERNELS=v2)";
  }
};

// Mixed-dtype parameters (fp32, bf16, fp16), the same start on every rank.
struct Params {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<OuterParam> list;
  Params() {
    const std::pair<DType, int64_t> shape[] = {
        {DType::kFloat32, 301}, {DType::kBFloat16, 97}, {DType::kFloat16, 1000}};
    for (const auto& [dtype, n] : shape) {
      bytes.emplace_back(static_cast<size_t>(n) * dtype_size(dtype));
      for (int64_t e = 0; e < n; ++e)
        math::store_from_float(bytes.back().data(), e, static_cast<uint8_t>(dtype),
                               std::sin(0.37f * static_cast<float>(e)));
      list.push_back({bytes.back().data(), n, dtype});
    }
    for (size_t i = 0; i < bytes.size(); ++i) list[i].data = bytes[i].data();
  }
  void drift(int rank, uint64_t t) {
    for (const OuterParam& p : list)
      for (int64_t e = 0; e < p.numel; ++e) {
        const auto code = static_cast<uint8_t>(p.dtype);
        const float v = math::load_as_float(p.data, e, code);
        math::store_from_float(p.data, e, code, v + 0.01f * std::sin(float(rank + 1) * t + e));
      }
  }
};

TEST(OuterSyncStaged, HostStagedRoundsEqualTheDirectOnes) {
  const int world = 2;
  OuterSyncOptions o;
  o.inner_steps = 4;
  o.fragments = 2;
  o.mixing = 0.25f;
  CompressionConfig c;
  c.seed = 3;
  std::vector<std::vector<uint8_t>> out[2];
  for (int staged = 0; staged < 2; ++staged) {
    out[staged].resize(world);
    InProcessGroup group(world);
    testing::run_ranks(group, [&](int r, Communicator& comm) {
      std::unique_ptr<Backend> backend =
          staged ? std::unique_ptr<Backend>(new NoOuterKernels) : make_cpu_backend();
      Params p;
      OuterSync sync(comm, *backend, c, o, p.list);
      for (uint64_t t = 1; t <= 12; ++t) {
        p.drift(r, t);
        sync.step();
      }
      const OuterSyncState st = sync.state();
      std::vector<uint8_t>& bytes = out[staged][r];
      for (const auto& b : p.bytes) bytes.insert(bytes.end(), b.begin(), b.end());
      for (const auto* arrays : {&st.anchors, &st.momenta})
        for (const auto& a : *arrays) {
          const auto* u = reinterpret_cast<const uint8_t*>(a.data());
          bytes.insert(bytes.end(), u, u + a.size() * sizeof(float));
        }
    });
  }
  for (int r = 0; r < world; ++r) EXPECT_TRUE(out[0][r] == out[1][r]) << "rank " << r;
}

TEST(OuterSyncStaged, OverlapIsRefusedNamingTheKernelSwitch) {
  InProcessGroup group(1);
  NoOuterKernels backend;
  Params p;
  OuterSyncOptions o;
  o.inner_steps = 4;
  o.overlap_steps = 1;
  try {
    OuterSync sync(group.communicator(0), backend, CompressionConfig{}, o, p.list);
    ADD_FAILURE() << "overlap_steps > 0 accepted without outer kernels";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GRADCOMP_KERNELS=v2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
