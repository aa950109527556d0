// gradcomp-bench project: a step-time model for data-parallel jobs on multi-GPU nodes.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"
#include "gradcomp/gradcomp.h"

namespace gradcomp_bench {

using namespace gradcomp;

int project_mode(const Args& a) {
  const auto params = numbers(a, "--params", "1e9,7e9", 1e3, 1e13);
  const auto links = numbers(a, "--link-gbps", "25,100,400", 0.001, 1e5);
  const double gpus = numbers(a, "--gpus-per-node", "8", 1, 1024)[0];
  const double nodes = numbers(a, "--nodes", "16", 2, 1e6)[0];
  // Encode + decode throughput per GPU in elements/s. Default: the H200 bandwidth model of
  // docs/benchmarks.md (4.3 TB/s copy, ~20 bytes moved per element for encode, decode and the
  // two-phase re-encode together), to be replaced by measured numbers.
  const double codec_gbps = numbers(a, "--encode-gbps", "3440", 1, 1e6)[0];
  const double overlap = numbers(a, "--overlap", "0.5", 0, 1)[0];
  if (a.json)
    std::printf("[\n");
  else
    std::printf(
        "MODEL, not a measurement: %g nodes x %g GPUs, bf16 gradients, compute = 6*P*4096 tokens "
        "per GPU at\n"
        "396 TFLOP/s (40%% of 990), %.0f%% of backward (2/3 of compute) available to hide "
        "communication.\n\n"
        "%-8s %-10s %12s %12s %12s %12s %9s\n",
        nodes, gpus, overlap * 100, "params", "link", "compute ms", "bf16 step", "q4 step",
        "q4 comm MB", "speedup");
  bool first = true;
  for (double p : params) {
    for (double gbps : links) {
      const double compute = 6.0 * p * 4096 / 396e12;
      // Hierarchical: intra-node reduce-scatter, then each GPU's 1/gpus shard crosses the node
      // NIC (shared by the node's GPUs): ring over nodes moves 2 (N-1)/N of it.
      const double node_bytes_bf16 = 2.0 * (nodes - 1) / nodes * p * 2.0;
      const double node_bytes_q4 = 2.0 * (nodes - 1) / nodes * p * (4.5 / 8.0);
      const double link = gbps * 1e9 / 8;
      const double hide = overlap * compute * 2.0 / 3.0;
      const double codec =
          3.0 * (p / gpus) * 8.0 / (codec_gbps * 1e9);  // bytes per element ~ 8 for each pass
      const double bf16_step = compute + std::max(0.0, node_bytes_bf16 / link - hide);
      const double q4_step = compute + std::max(0.0, node_bytes_q4 / link + codec - hide);
      if (a.json) {
        std::printf(
            "%s  {\"params\": %g, \"link_gbps\": %g, \"compute_s\": %.5f, \"bf16_step_s\": %.5f, "
            "\"q4_step_s\": %.5f, \"speedup\": %.3f, \"model\": true}",
            first ? "" : ",\n", p, gbps, compute, bf16_step, q4_step, bf16_step / q4_step);
        first = false;
      } else {
        std::printf("%-8.2g %-6g Gb/s %12.1f %12.1f %12.1f %12.1f %8.2fx\n", p, gbps, compute * 1e3,
                    bf16_step * 1e3, q4_step * 1e3, node_bytes_q4 / 1e6, bf16_step / q4_step);
      }
    }
  }
  if (a.json) std::printf("\n]\n");
  return 0;
}

}  // namespace gradcomp_bench
