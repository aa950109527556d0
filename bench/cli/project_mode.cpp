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

namespace {

// Seconds of one step's gradient exchange of P parameters, per scheme (docs/benchmarks.md).
struct Projection {
  double compute, bf16, fp8, flat_q4, hier_q4, diloco;
  double flat_q4_node_bytes, hier_q4_node_bytes;
};

Projection project(double p, double gbps, double gpus, double nodes, double nvlink_gbps,
                   double codec_gbps, double overlap, double diloco_h) {
  Projection r;
  const double world = gpus * nodes;
  const double q4 = 4.5 / 8.0;  // bytes per element of a q4 payload, block 64
  const double link = gbps * 1e9 / 8, nvlink = nvlink_gbps * 1e9 / 8;
  r.compute = 6.0 * p * 4096 / 396e12;
  const double hide = overlap * r.compute * 2.0 / 3.0;
  // Codec passes (encode, decode, the two-phase re-encode) over a GPU's elements, ~8 bytes each.
  auto codec = [&](double elements) { return 3.0 * elements * 8.0 / (codec_gbps * 1e9); };
  // bf16 through NCCL: its rings cross each node's link once, 2 (W-1)/W of the bucket.
  const double bf16_bytes = 2.0 * (world - 1) / world * p * 2.0;
  r.bf16 = r.compute + std::max(0.0, bf16_bytes / link - hide);
  // Flat q4: every GPU compresses the whole bucket; its all-to-all sends a chunk to each of the
  // W - L GPUs on other nodes, and the ring allgather of the chunks crosses each link once.
  r.flat_q4_node_bytes = (gpus * (world - gpus) / world + (world - 1) / world) * p * q4;
  r.flat_q4 = r.compute + std::max(0.0, r.flat_q4_node_bytes / link + codec(p) - hide);
  // Hierarchical q4: bf16 reduce-scatter and allgather over NVLink, each GPU's 1/L shard
  // compressed across nodes (L exchanges share the node's link), codec work on the shard only.
  const double intra = 2.0 * 2.0 * (gpus - 1) / gpus * p * 2.0 / nvlink;
  r.hier_q4_node_bytes = 2.0 * (nodes - 1) / nodes * p * q4;
  r.hier_q4 =
      r.compute + std::max(0.0, intra + r.hier_q4_node_bytes / link + codec(p / gpus) - hide);
  // The frameworks' FP8 hook: all-to-all of e4m3 (+ an fp32 scale per 128) over all W GPUs, an
  // fp32 sum, an allgather: flat q4's traffic shape at 1 + 4/128 bytes per element, and its casts
  // about as fast as a copy (two passes of ~6 bytes per element).
  const double fp8_node_bytes =
      (gpus * (world - gpus) / world + (world - 1) / world) * p * (1.0 + 4.0 / 128);
  r.fp8 = r.compute + std::max(0.0, fp8_node_bytes / link + 2.0 * p * 6.0 / 4.3e12 - hide);
  // DiLoCo: the hierarchical q4 exchange once every H steps, between steps (nothing hides it),
  // plus its host staging: the parameters to the host and back and the outer gradient both ways
  // (16 bytes per element at ~50 GB/s over PCIe) and the outer step's host loops (~2 ns per
  // element on one core).
  const double staging = p * 16.0 / 50e9 + p * 2e-9;
  r.diloco =
      r.compute + (intra + r.hier_q4_node_bytes / link + codec(p / gpus) + staging) / diloco_h;
  return r;
}

}  // namespace

int project_mode(const Args& a) {
  const auto params = numbers(a, "--params", "1e9,7e9", 1e3, 1e13);
  const auto links = numbers(a, "--link-gbps", "25,100,400", 0.001, 1e5);
  const double gpus = numbers(a, "--gpus-per-node", "8", 1, 1024)[0];
  const double nodes = numbers(a, "--nodes", "16", 2, 1e6)[0];
  // NVLink per GPU and direction: 450 GB/s on H100/H200 (NVLink 4, 900 GB/s both ways).
  const double nvlink_gbps = numbers(a, "--nvlink-gbps", "3600", 1, 1e6)[0];
  // Encode + decode throughput per GPU in elements/s. Default: the H200 bandwidth model of
  // docs/benchmarks.md (4.3 TB/s copy, ~20 bytes moved per element for encode, decode and the
  // two-phase re-encode together), to be replaced by measured numbers.
  const double codec_gbps = numbers(a, "--encode-gbps", "3440", 1, 1e6)[0];
  const double overlap = numbers(a, "--overlap", "0.5", 0, 1)[0];
  const double diloco_h = numbers(a, "--diloco-h", "100", 1, 1e6)[0];
  auto at = [&](double p, double gbps) {
    return project(p, gbps, gpus, nodes, nvlink_gbps, codec_gbps, overlap, diloco_h);
  };
  // The slowest link at which a scheme's step is within 5 % of bf16's: past it, compressing
  // gains too little to be worth a lossy exchange.
  // 0: not even at 0.1 Gbit/s (it never pays against bf16).
  auto stops_paying = [&](double p, double Projection::*scheme) {
    for (double g = 0.1; g < 1e6; g *= 1.05) {
      const Projection r = at(p, g);
      if (r.*scheme >= 0.95 * r.bf16) return g == 0.1 ? 0.0 : g;
    }
    return 1e6;
  };
  auto speed = [](double g) {
    return g == 0.0 ? std::string("never") : std::to_string(static_cast<long long>(g + 0.5));
  };
  if (a.json)
    std::printf("[\n");
  else
    std::printf(
        "MODEL, not a measurement: %g nodes x %g GPUs (NVLink %g Gbit/s), bf16 gradients, compute "
        "= 6*P*4096 tokens\nper GPU at 396 TFLOP/s (40%% of 990), %.0f%% of backward (2/3 of "
        "compute) available to hide communication.\n\n"
        "%-8s %-10s %10s %10s %10s %10s %10s %11s %11s %11s %9s %9s\n",
        nodes, gpus, nvlink_gbps, overlap * 100, "params", "link", "compute ms", "bf16 ms",
        "fp8 ms", "flat q4 ms", "hier q4 ms", "diloco ms", "flat MB/node", "hier MB/node",
        "vs bf16", "vs flat");
  bool first = true;
  for (double p : params) {
    for (double gbps : links) {
      const Projection r = at(p, gbps);
      if (a.json) {
        std::printf(
            "%s  {\"params\": %g, \"link_gbps\": %g, \"compute_s\": %.5f, \"bf16_step_s\": %.5f, "
            "\"fp8_step_s\": %.5f, \"flat_q4_step_s\": %.5f, \"hier_q4_step_s\": %.5f, "
            "\"diloco_step_s\": %.5f, \"flat_q4_node_bytes\": %.0f, "
            "\"hier_q4_node_bytes\": %.0f, \"model\": true}",
            first ? "" : ",\n", p, gbps, r.compute, r.bf16, r.fp8, r.flat_q4, r.hier_q4, r.diloco,
            r.flat_q4_node_bytes, r.hier_q4_node_bytes);
        first = false;
      } else {
        std::printf(
            "%-8.2g %-6g Gb/s %10.1f %10.1f %10.1f %10.1f %10.1f %10.1f %11.1f %11.1f %8.2fx "
            "%8.2fx\n",
            p, gbps, r.compute * 1e3, r.bf16 * 1e3, r.fp8 * 1e3, r.flat_q4 * 1e3, r.hier_q4 * 1e3,
            r.diloco * 1e3, r.flat_q4_node_bytes / 1e6, r.hier_q4_node_bytes / 1e6,
            r.bf16 / r.hier_q4, r.flat_q4 / r.hier_q4);
      }
    }
  }
  if (a.json) {
    std::printf("\n]\n");
    return 0;
  }
  std::printf(
      "\nStops paying (step within 5 %% of bf16's) from this per-node link speed up (Gbit/s;"
      " DiLoCo H = %g):\n",
      diloco_h);
  for (double p : params)
    std::printf("%-8.2g fp8 %-9s flat q4 %-9s hier q4 %-9s diloco %s\n", p,
                speed(stops_paying(p, &Projection::fp8)).c_str(),
                speed(stops_paying(p, &Projection::flat_q4)).c_str(),
                speed(stops_paying(p, &Projection::hier_q4)).c_str(),
                speed(stops_paying(p, &Projection::diloco)).c_str());
  return 0;
}

}  // namespace gradcomp_bench
