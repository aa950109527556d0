// gradcomp-bench codec: throughput, compression and error of each codec on the CPU and CUDA.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cli.h"
#include "gradcomp/gradcomp.h"

namespace gradcomp_bench {
namespace {

using namespace gradcomp;

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

}  // namespace

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

}  // namespace gradcomp_bench
