// Streaming DiLoCo's overlap tests' shared parts: the sequential reference of the delayed, mixed
// (or eager) rule, the in-process ranks' parameters and inner steps, and the cases.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/inprocess_group.h"
#include "gradcomp/outer_sync.h"
#include "outer_sync_reference.h"
#include "run_ranks.h"

namespace gradcomp {
namespace testing {

inline CompressionConfig q4_config() {
  CompressionConfig c;
  c.seed = 5;
  return c;
}

inline float mix_reference(float local, float global, float alpha) {
  volatile float a = alpha * local;
  volatile float b = (1.0f - alpha) * global;
  return a + b;
}

// Every rank holds the same tensors at the start; rank r's inner steps drift them its own way.
using Params = std::vector<std::vector<std::vector<float>>>;  // [rank][tensor][element]

inline Params make_params(int world, const std::vector<int64_t>& sizes) {
  Params out(static_cast<size_t>(world));
  for (auto& rank : out)
    for (int64_t n : sizes) {
      std::vector<float> p(static_cast<size_t>(n));
      for (size_t e = 0; e < p.size(); ++e) p[e] = std::sin(static_cast<float>(e) * 0.37f);
      rank.push_back(p);
    }
  return out;
}

inline std::vector<OuterParam> outer_params(std::vector<std::vector<float>>& tensors) {
  std::vector<OuterParam> out;
  for (auto& p : tensors)
    out.push_back({p.data(), static_cast<int64_t>(p.size()), DType::kFloat32});
  return out;
}

inline void inner_step(std::vector<std::vector<float>>& tensors, int rank, uint64_t t) {
  for (auto& p : tensors)
    for (size_t e = 0; e < p.size(); ++e) p[e] += drift(rank, t, e);
}

struct Case {
  int world;
  uint32_t fragments, h, tau;
  float alpha;
  bool eager = false;
};

inline std::string name(const Case& c) {
  return "W" + std::to_string(c.world) + "_F" + std::to_string(c.fragments) + "_H" +
         std::to_string(c.h) + "_Tau" + std::to_string(c.tau) + "_Alpha" +
         std::to_string(static_cast<int>(c.alpha * 10)) + "Tenths" + (c.eager ? "_Eager" : "");
}

// ctest's names of the cases (gtest_discover_tests takes the printed parameter).
inline void PrintTo(const Case& c, std::ostream* os) {
  *os << name(c);
}

// The rule written out sequentially: at fragment f's sync point g = anchor - param goes through
// the compressed allreduce at once; tau steps later the anchor takes the outer step with that
// mean and the parameters become alpha * (their value then) + (1 - alpha) * anchor. Eager: the
// sync point also moves the parameters to this rank's own outer step (on a copy of the buffer),
// and the merge adds anchor - that eager anchor to them instead of mixing.
inline void reference_run(const Case& c, Params& params, uint64_t steps) {
  InProcessGroup group(c.world);
  run_ranks(group, [&](int r, Communicator& comm) {
    auto backend = make_cpu_backend();
    CompressedAllreduce allreduce(comm, *backend, q4_config());
    auto& mine = params[static_cast<size_t>(r)];
    const size_t tensors = mine.size(), per = tensors / c.fragments;
    struct Frag {
      std::vector<float> anchor, buf, mean, eager;
      uint32_t round = 0;
      uint64_t merge = 0;
    };
    std::vector<Frag> frags(c.fragments);
    auto gather = [&](uint32_t f) {
      std::vector<float> v;
      for (size_t i = f * per; i < (f + 1) * per; ++i)
        v.insert(v.end(), mine[i].begin(), mine[i].end());
      return v;
    };
    auto scatter = [&](uint32_t f, const std::vector<float>& v) {
      size_t at = 0;
      for (size_t i = f * per; i < (f + 1) * per; ++i)
        for (float& x : mine[i]) x = v[at++];
    };
    for (uint32_t f = 0; f < c.fragments; ++f) {
      frags[f].anchor = gather(f);
      frags[f].buf.assign(frags[f].anchor.size(), 0.0f);
    }
    auto merge = [&](uint32_t f) {
      Frag& fr = frags[f];
      std::vector<float> local = gather(f);
      for (size_t e = 0; e < local.size(); ++e) {
        fr.anchor[e] = sgd_reference(fr.anchor[e], fr.mean[e], &fr.buf[e], 0.7f, 0.9f);
        if (c.eager)
          local[e] = local[e] + (fr.anchor[e] - fr.eager[e]);
        else
          local[e] =
              c.alpha == 0.0f ? fr.anchor[e] : mix_reference(local[e], fr.anchor[e], c.alpha);
      }
      ++fr.round;
      fr.merge = 0;
      scatter(f, local);
    };
    for (uint64_t t = 1; t <= steps; ++t) {
      inner_step(mine, r, t);
      for (uint32_t f = 0; f < c.fragments; ++f)
        if (frags[f].merge == t) merge(f);
      for (uint32_t f = 0; f < c.fragments; ++f) {
        if (t % c.h != uint64_t{f} * c.h / c.fragments) continue;
        Frag& fr = frags[f];
        std::vector<float> g = gather(f);
        for (size_t e = 0; e < g.size(); ++e) g[e] = fr.anchor[e] - g[e];
        if (c.eager) {
          fr.eager.resize(g.size());
          for (size_t e = 0; e < g.size(); ++e) {
            float scratch = fr.buf[e];
            fr.eager[e] = sgd_reference(fr.anchor[e], g[e], &scratch, 0.7f, 0.9f);
          }
          scatter(f, fr.eager);
        }
        allreduce.set_step(fr.round);
        const Segment s{g.data(), 0, static_cast<int64_t>(g.size())};
        ASSERT_TRUE(allreduce.allreduce(&s, 1, DType::kFloat32, f));
        fr.mean = g;
        fr.merge = t + c.tau;
      }
    }
    // flush(): the round still in flight merges now.
    for (uint32_t f = 0; f < c.fragments; ++f)
      if (frags[f].merge != 0) merge(f);
  });
}

inline OuterSyncOptions options(const Case& c) {
  OuterSyncOptions o;
  o.inner_steps = c.h;
  o.fragments = c.fragments;
  o.overlap_steps = c.tau;
  o.mixing = c.alpha;
  o.eager = c.eager;
  return o;
}

}  // namespace testing
}  // namespace gradcomp
