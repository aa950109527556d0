// gradcomp-bench project: a step-time model for data-parallel jobs (DDP, FSDP) on multi-GPU nodes.
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

// FSDP over all W GPUs (a model): per step two parameter all-gathers (forward, and backward's
// re-gather) and one gradient reduce-scatter, each GPU holding a 1/W shard.
struct FsdpProjection {
  double fp32, bf16, q4, q4_int8;
  double bf16_node_bytes, q4_node_bytes, q4_int8_node_bytes;
};

// Wire bytes per element of gradcomp's FSDP collectives, from the core's payload sizes for one
// rank's shard (headers, scales and padding included): the q4 reduce-scatter's slot to each
// other rank, and the int8 all-gather's row.
double q4_reduce_scatter_bytes_per_element(int64_t shard) {
  CompressionConfig q4;  // q4, block 64, as FsdpHook's default
  return static_cast<double>(compressed_reduce_scatter_bytes_sent(q4, shard, 2)) / shard;
}
double int8_all_gather_bytes_per_element(int64_t shard) {
  const AllGatherRun row{DType::kFloat32, shard};
  return static_cast<double>(int8_payload_bytes(&row, 1, 64)) / shard;
}

FsdpProjection project_fsdp(double p, double gbps, double gpus, double nodes, double codec_gbps,
                            double overlap) {
  FsdpProjection r;
  const double world = gpus * nodes;
  const int64_t shard = std::max<int64_t>(1, static_cast<int64_t>(p / world));
  const double link = gbps * 1e9 / 8;
  const double compute = 6.0 * p * 4096 / 396e12;
  // FSDP prefetches the next module's all-gather during forward and backward and reduce-scatters
  // during backward: all of compute can hide communication, not only backward's 2/3.
  const double hide = overlap * compute;
  // NCCL's rings (the all-gathers, the uncompressed reduce-scatter) cross each node's link once:
  // (W-1)/W of the tensor. gradcomp's reduce-scatter is an all-to-all: each of the node's L GPUs
  // sends a slot to each of the W - L GPUs on other nodes.
  const double ring = (world - 1) / world * p;
  const double all_to_all = gpus * (world - gpus) / world * p;
  const double q4_rs = all_to_all * q4_reduce_scatter_bytes_per_element(shard);
  const double int8_ag = ring * int8_all_gather_bytes_per_element(shard);
  // Codec passes of ~8 bytes per element, as the DDP rows: the reduce-scatter encodes the whole
  // gradient and decodes W slots of the shard; each int8 all-gather encodes the shard and decodes
  // W rows. int8 at q4's throughput is an assumption (its v2 kernels have not run on a GPU).
  auto codec = [&](double elements) { return elements * 8.0 / (codec_gbps * 1e9); };
  const double q4_codec = codec(2.0 * p), int8_codec = 2.0 * codec(p + p / world);
  auto step = [&](double bytes, double codec_s) {
    return compute + std::max(0.0, bytes / link + codec_s - hide);
  };
  r.fp32 = step(3.0 * ring * 4.0, 0.0);
  r.bf16_node_bytes = 3.0 * ring * 2.0;  // MixedPrecisionPolicy(param_dtype=reduce_dtype=bf16)
  r.bf16 = step(r.bf16_node_bytes, 0.0);
  r.q4_node_bytes = 2.0 * ring * 2.0 + q4_rs;
  r.q4 = step(r.q4_node_bytes, q4_codec);
  r.q4_int8_node_bytes = 2.0 * int8_ag + q4_rs;
  r.q4_int8 = step(r.q4_int8_node_bytes, q4_codec + int8_codec);
  return r;
}

void print_fsdp(const std::vector<double>& params, const std::vector<double>& links, double gpus,
                double nodes, double codec_gbps, double overlap) {
  std::printf(
      "\nFSDP, MODEL, not a measurement: the same job sharded over all %g GPUs; per step two "
      "parameter all-gathers\nand one gradient reduce-scatter, %.0f%% of compute available to "
      "hide them. q4: gradcomp's reduce-scatter\n(an all-to-all) with bf16 all-gathers; "
      "q4+int8: and int8 weights on the all-gathers (codec time at q4's\nthroughput, "
      "assumed).\nWire bytes per element (the core's payload sizes, a 2^20-element shard): q4 "
      "%.4f, int8 %.4f.\n\n"
      "%-8s %-10s %10s %10s %10s %11s %13s %10s %15s %9s\n",
      gpus * nodes, overlap * 100, q4_reduce_scatter_bytes_per_element(1 << 20),
      int8_all_gather_bytes_per_element(1 << 20), "params", "link", "fp32 ms", "bf16 ms",
      "q4 rs ms", "q4+int8 ms", "bf16 MB/node", "q4 MB/node", "q4+int8 MB/node", "vs bf16");
  for (double p : params)
    for (double gbps : links) {
      const FsdpProjection r = project_fsdp(p, gbps, gpus, nodes, codec_gbps, overlap);
      std::printf("%-8.2g %-6g Gb/s %10.1f %10.1f %10.1f %11.1f %13.1f %10.1f %15.1f %8.2fx\n", p,
                  gbps, r.fp32 * 1e3, r.bf16 * 1e3, r.q4 * 1e3, r.q4_int8 * 1e3,
                  r.bf16_node_bytes / 1e6, r.q4_node_bytes / 1e6, r.q4_int8_node_bytes / 1e6,
                  r.bf16 / r.q4_int8);
    }
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
      const FsdpProjection f = project_fsdp(p, gbps, gpus, nodes, codec_gbps, overlap);
      if (a.json) {
        std::printf(
            "%s  {\"params\": %g, \"link_gbps\": %g, \"compute_s\": %.5f, \"bf16_step_s\": %.5f, "
            "\"fp8_step_s\": %.5f, \"flat_q4_step_s\": %.5f, \"hier_q4_step_s\": %.5f, "
            "\"diloco_step_s\": %.5f, \"flat_q4_node_bytes\": %.0f, "
            "\"hier_q4_node_bytes\": %.0f, \"fsdp_fp32_step_s\": %.5f, "
            "\"fsdp_bf16_step_s\": %.5f, \"fsdp_q4_step_s\": %.5f, "
            "\"fsdp_q4_int8_step_s\": %.5f, \"fsdp_bf16_node_bytes\": %.0f, "
            "\"fsdp_q4_node_bytes\": %.0f, \"fsdp_q4_int8_node_bytes\": %.0f, "
            "\"model\": true}",
            first ? "" : ",\n", p, gbps, r.compute, r.bf16, r.fp8, r.flat_q4, r.hier_q4, r.diloco,
            r.flat_q4_node_bytes, r.hier_q4_node_bytes, f.fp32, f.bf16, f.q4, f.q4_int8,
            f.bf16_node_bytes, f.q4_node_bytes, f.q4_int8_node_bytes);
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
  print_fsdp(params, links, gpus, nodes, codec_gbps, overlap);
  return 0;
}

}  // namespace gradcomp_bench
