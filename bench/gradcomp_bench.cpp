// gradcomp-bench: codec throughput and error tables, compressed-collective bandwidth (GPUs), and
// a step-time projection for data-parallel jobs on multi-GPU nodes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gradcomp/gradcomp.h"
#if defined(GRADCOMP_HAVE_NCCL)
#include <nccl.h>

#include "gradcomp/nccl_communicator.h"
#endif

namespace {

using namespace gradcomp;

const char* kUsage = R"(usage:
  gradcomp-bench codec [--sizes 1e4,1e5,1e6,1e7,1e8] [--codecs q4,q4-rn,topk,topk-approx]
                       [--dtypes float32,bfloat16] [--device cpu|cuda|all] [--threads N]
                       [--reps N] [--json]
  gradcomp-bench collective [--sizes ...] [--reps N] [--json]        (CUDA GPUs, NCCL)
  gradcomp-bench project [--params 1e9,7e9] [--link-gbps 25,100,400] [--gpus-per-node 8]
                         [--nodes 16] [--encode-gbps G] [--overlap 0.5] [--json]
)";

struct Args {
  std::string mode;
  std::map<std::string, std::string> opts;
  bool json = false;
};

[[noreturn]] void fail(const std::string& msg) {
  std::fprintf(stderr, "gradcomp-bench: %s\n%s", msg.c_str(), kUsage);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) fail("missing mode");
  a.mode = argv[1];
  if (a.mode == "-h" || a.mode == "--help") {
    std::printf("%s", kUsage);
    std::exit(0);
  }
  if (a.mode != "codec" && a.mode != "collective" && a.mode != "project")
    fail("unknown mode '" + a.mode + "'");
  static const std::vector<std::string> known = {
      "--sizes",  "--codecs",    "--dtypes",        "--device", "--threads",     "--reps",
      "--params", "--link-gbps", "--gpus-per-node", "--nodes",  "--encode-gbps", "--overlap"};
  for (int i = 2; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--json") {
      a.json = true;
      continue;
    }
    if (std::find(known.begin(), known.end(), k) == known.end()) fail("unknown option '" + k + "'");
    if (i + 1 >= argc) fail("option '" + k + "' needs a value");
    a.opts[k] = argv[++i];
  }
  return a;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

double parse_number(const std::string& s, const char* what, double lo, double hi) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
    fail(std::string("bad value '") + s + "' for " + what);
  }
  return v;
}

std::vector<double> numbers(const Args& a, const char* key, const char* def, double lo, double hi) {
  auto it = a.opts.find(key);
  std::vector<double> out;
  for (const auto& s : split(it == a.opts.end() ? def : it->second))
    out.push_back(parse_number(s, key, lo, hi));
  if (out.empty()) fail(std::string("empty list for ") + key);
  return out;
}

std::string opt(const Args& a, const char* key, const char* def) {
  auto it = a.opts.find(key);
  return it == a.opts.end() ? def : it->second;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- codec mode ----------------------------------------------------------------------------

struct CodecRow {
  int64_t n;
  std::string codec, dtype, device;
  double encode_gbps, decode_gbps, encode_vs_memcpy, compression, rel_l2, max_err;
};

struct Memory {
  Backend& backend;
  std::vector<void*> owned;
  void* get(size_t bytes) {
    owned.push_back(backend.allocate(bytes));
    return owned.back();
  }
  ~Memory() {
    for (void* p : owned) backend.release(p);
  }
};

CodecRow run_codec(Backend& backend, int64_t n, const std::string& codec, DType dtype, int reps) {
  Memory mem{backend, {}};
  const size_t in_bytes = static_cast<size_t>(n) * dtype_size(dtype);
  std::vector<uint8_t> host_in(in_bytes);
  std::vector<float> x(static_cast<size_t>(n));
  std::mt19937 gen(7);
  std::normal_distribution<float> dist;
  for (int64_t i = 0; i < n; ++i) {
    math::store_from_float(host_in.data(), i, static_cast<uint8_t>(dtype), dist(gen));
    x[i] = math::load_as_float(host_in.data(), i, static_cast<uint8_t>(dtype));
  }
  void* in = mem.get(in_bytes);
  void* out = mem.get(in_bytes);
  backend.copy_from_host(in, host_in.data(), in_bytes);
  void* copy_dst = mem.get(in_bytes);
  Segment seg{in, 0, n}, oseg{out, 0, n};
  const bool q4 = codec.rfind("q4", 0) == 0;
  TopKOptions topt;
  topt.exact = codec != "topk-approx";
  const int64_t cap = q4 ? 0 : topk_capacity(n, topt);
  const uint64_t pbytes = q4 ? q4_payload_bytes(n, 64) : topk_payload_bytes(cap, DType::kFloat32);
  auto* payload = static_cast<uint8_t*>(mem.get(pbytes));
  void* ws = q4 ? nullptr : mem.get(std::max<size_t>(16, backend.topk_workspace_bytes(n)));
  std::vector<double> enc, dec, cpy;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    if (!backend.is_cuda()) {
      std::memcpy(copy_dst, in, in_bytes);
      cpy.push_back(seconds_since(t0));
    }
    t0 = std::chrono::steady_clock::now();
    if (q4) {
      Q4EncodeParams p;
      p.segments = &seg;
      p.num_segments = 1;
      p.dtype = static_cast<uint8_t>(dtype);
      p.numel = n;
      p.stochastic = codec == "q4";
      p.rng.step = static_cast<uint32_t>(r);
      p.payload = payload;
      backend.q4_encode(p);
    } else {
      TopKEncodeParams p;
      p.segments = &seg;
      p.num_segments = 1;
      p.dtype = static_cast<uint8_t>(dtype);
      p.numel = n;
      p.k = topk_k(n, topt.ratio);
      p.capacity = static_cast<uint32_t>(cap);
      p.exact = topt.exact;
      p.payload = payload;
      p.workspace = ws;
      backend.topk_encode(p);
    }
    backend.take_decode_status();  // drains the stream on CUDA
    enc.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    const uint8_t* ptr = payload;
    if (q4) {
      Q4DecodeParams d;
      d.payloads = &ptr;
      d.num_payloads = 1;
      d.payload_bytes = pbytes;
      d.numel = n;
      d.segments = &oseg;
      d.num_segments = 1;
      d.dtype = static_cast<uint8_t>(dtype);
      backend.q4_decode(d);
    } else {
      TopKDecodeParams d;
      d.payloads = &ptr;
      d.num_payloads = 1;
      d.payload_bytes = pbytes;
      d.numel = n;
      d.capacity = static_cast<uint32_t>(cap);
      d.segments = &oseg;
      d.num_segments = 1;
      d.dtype = static_cast<uint8_t>(dtype);
      d.workspace = ws;
      backend.topk_decode(d);
    }
    backend.take_decode_status();
    dec.push_back(seconds_since(t0));
  }
  std::vector<uint8_t> host_out(in_bytes);
  backend.copy_to_host(host_out.data(), out, in_bytes);
  double num = 0, den = 0, max_err = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double y = math::load_as_float(host_out.data(), i, static_cast<uint8_t>(dtype));
    num += (y - x[i]) * (y - x[i]);
    den += static_cast<double>(x[i]) * x[i];
    max_err = std::max(max_err, std::fabs(y - x[i]));
  }
  const double moved = static_cast<double>(in_bytes + pbytes);
  CodecRow row;
  row.n = n;
  row.codec = codec;
  row.dtype = dtype_name(dtype);
  row.device = backend.is_cuda() ? "cuda" : "cpu";
  row.encode_gbps = moved / median(enc) / 1e9;
  row.decode_gbps = moved / median(dec) / 1e9;
  row.encode_vs_memcpy =
      backend.is_cuda() ? NAN : (moved / median(enc)) / (2.0 * in_bytes / median(cpy));
  row.compression = static_cast<double>(in_bytes) / pbytes;
  row.rel_l2 = den > 0 ? std::sqrt(num / den) : 0;
  row.max_err = max_err;
  return row;
}

int codec_mode(const Args& a) {
  const auto sizes = numbers(a, "--sizes", "1e4,1e5,1e6,1e7,1e8", 1, 2e9);
  const auto codecs = split(opt(a, "--codecs", "q4,q4-rn,topk,topk-approx"));
  const auto dtypes = split(opt(a, "--dtypes", "float32,bfloat16"));
  const std::string device = opt(a, "--device", "all");
  const int threads = static_cast<int>(numbers(a, "--threads", "1", 1, 1024)[0]);
  const int reps = static_cast<int>(numbers(a, "--reps", "5", 1, 1000)[0]);
  for (const auto& c : codecs)
    if (c != "q4" && c != "q4-rn" && c != "topk" && c != "topk-approx")
      fail("unknown codec '" + c + "'");
  std::vector<DType> dts;
  for (const auto& d : dtypes) {
    if (d == "float32")
      dts.push_back(DType::kFloat32);
    else if (d == "float16")
      dts.push_back(DType::kFloat16);
    else if (d == "bfloat16")
      dts.push_back(DType::kBFloat16);
    else
      fail("unknown dtype '" + d + "'");
  }
  if (device != "cpu" && device != "cuda" && device != "all")
    fail("--device must be cpu, cuda or all");
  std::vector<std::unique_ptr<Backend>> backends;
  if (device != "cuda") backends.push_back(make_cpu_backend(threads));
#if defined(GRADCOMP_HAVE_CUDA)
  if (device != "cpu" && cuda::device_available()) backends.push_back(cuda::make_cuda_backend());
#endif
  if (backends.empty()) fail("no CUDA device here: use --device cpu");
  std::vector<CodecRow> rows;
  const size_t total = backends.size() * sizes.size() * codecs.size() * dts.size();
  for (auto& b : backends)
    for (double s : sizes)
      for (const auto& c : codecs)
        for (DType d : dts) {
          std::fprintf(stderr, "\r[%zu/%zu] %s %s n=%.0e %s   ", rows.size() + 1, total,
                       b->is_cuda() ? "cuda" : "cpu", c.c_str(), s, dtype_name(d));
          rows.push_back(run_codec(*b, static_cast<int64_t>(s), c, d, reps));
        }
  std::fprintf(stderr, "\r%60s\r", "");
  if (a.json) {
    std::printf("[\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& r = rows[i];
      std::printf(
          "  {\"n\": %lld, \"codec\": \"%s\", \"dtype\": \"%s\", \"device\": \"%s\", "
          "\"encode_gbps\": %.4f, "
          "\"decode_gbps\": %.4f, \"encode_vs_memcpy\": %.4f, \"compression\": %.3f, "
          "\"rel_l2_error\": %.5f, "
          "\"max_error\": %.5f}%s\n",
          static_cast<long long>(r.n), r.codec.c_str(), r.dtype.c_str(), r.device.c_str(),
          r.encode_gbps, r.decode_gbps, std::isnan(r.encode_vs_memcpy) ? -1.0 : r.encode_vs_memcpy,
          r.compression, r.rel_l2, r.max_err, i + 1 < rows.size() ? "," : "");
    }
    std::printf("]\n");
    return 0;
  }
  std::printf("%-6s %-12s %-9s %10s %10s %10s %8s %8s %9s %9s\n", "device", "codec", "dtype",
              "elements", "enc GB/s", "dec GB/s", "vs copy", "ratio", "rel L2", "max err");
  for (const auto& r : rows) {
    std::printf("%-6s %-12s %-9s %10lld %10.3f %10.3f %8.3f %8.2f %9.5f %9.5f\n", r.device.c_str(),
                r.codec.c_str(), r.dtype.c_str(), static_cast<long long>(r.n), r.encode_gbps,
                r.decode_gbps, r.encode_vs_memcpy, r.compression, r.rel_l2, r.max_err);
  }
  std::printf(
      "(GB/s count the bytes that must move: input read + payload written. vs copy: encode rate "
      "over a\n"
      " memcpy of the input measured in the same run, CPU only.)\n");
  return 0;
}

// ---- projection mode -----------------------------------------------------------------------

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

// ---- collective mode (CUDA) ----------------------------------------------------------------

int collective_mode(const Args& a) {
#if defined(GRADCOMP_HAVE_NCCL)
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1)
    fail("collective mode needs CUDA GPUs; none found");
  const auto sizes = numbers(a, "--sizes", "1e6,1e7,1e8", 1, 2e9);
  const int reps = static_cast<int>(numbers(a, "--reps", "5", 1, 1000)[0]);
  std::vector<int> devs(gpus);
  for (int i = 0; i < gpus; ++i) devs[i] = i;
  std::vector<ncclComm_t> comms(gpus);
  GRADCOMP_NCCL_CHECK(ncclCommInitAll(comms.data(), gpus, devs.data()));
  std::printf("%-10s %-14s %10s %10s %10s\n", "elements", "method", "time us", "algbw GB/s",
              "busbw GB/s");
  for (double s : sizes) {
    const int64_t n = static_cast<int64_t>(s);
    for (const char* method : {"nccl-fp32", "nccl-bf16", "gradcomp-q4"}) {
      std::vector<double> times(gpus);
      std::vector<std::thread> threads;
      for (int g = 0; g < gpus; ++g) {
        threads.emplace_back([&, g] {
          GRADCOMP_CUDA_CHECK(cudaSetDevice(g));
          cudaStream_t stream;
          GRADCOMP_CUDA_CHECK(cudaStreamCreate(&stream));
          const bool bf16 = std::strcmp(method, "nccl-bf16") == 0;
          void* buf = nullptr;
          GRADCOMP_CUDA_CHECK(cudaMalloc(&buf, n * (bf16 ? 2 : 4)));
          GRADCOMP_CUDA_CHECK(cudaMemset(buf, 0, n * (bf16 ? 2 : 4)));
          std::vector<double> t;
          NcclCommunicator comm(comms[g], stream);
          cuda::CudaBackendOptions o;
          o.device = g;
          o.stream = stream;
          auto backend = cuda::make_cuda_backend(o);
          CompressedAllreduce engine(comm, *backend, CompressionConfig{});
          Segment seg{buf, 0, n};
          for (int r = 0; r < reps + 1; ++r) {
            GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto t0 = std::chrono::steady_clock::now();
            if (std::strcmp(method, "gradcomp-q4") == 0) {
              engine.allreduce(&seg, 1, DType::kFloat32, 0);
            } else {
              GRADCOMP_NCCL_CHECK(ncclAllReduce(buf, buf, n, bf16 ? ncclBfloat16 : ncclFloat32,
                                                ncclSum, comms[g], stream));
            }
            GRADCOMP_CUDA_CHECK(cudaStreamSynchronize(stream));
            if (r > 0) t.push_back(seconds_since(t0));
          }
          times[g] = median(t);
          cudaFree(buf);
          cudaStreamDestroy(stream);
        });
      }
      for (auto& t : threads) t.join();
      const double time = *std::max_element(times.begin(), times.end());
      const double algbw = n * 4.0 / time / 1e9;  // fp32 gradient bytes averaged per second
      std::printf("%-10lld %-14s %10.1f %10.2f %10.2f\n", static_cast<long long>(n), method,
                  time * 1e6, algbw, algbw * 2.0 * (gpus - 1) / gpus);
    }
  }
  for (auto c : comms) ncclCommDestroy(c);
  (void)a.json;
  return 0;
#else
  (void)a;
  fail("collective mode needs a CUDA build with NCCL");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    if (a.mode == "codec") return codec_mode(a);
    if (a.mode == "project") return project_mode(a);
    return collective_mode(a);
  } catch (const gradcomp::Error& e) {
    std::fprintf(stderr, "gradcomp-bench: %s\n", e.what());
    return 1;
  }
}
