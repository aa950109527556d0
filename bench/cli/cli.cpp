// gradcomp-bench's command line: option parsing, number lists, medians and timing.
#include "cli.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace gradcomp_bench {

const char* const kUsage = R"(usage:
  gradcomp-bench codec [--sizes 1e4,1e5,1e6,1e7,1e8] [--codecs q4,q4-rn,topk,topk-approx]
                       [--dtypes float32,bfloat16] [--device cpu|cuda|all] [--threads N]
                       [--reps N] [--json]
  gradcomp-bench collective [--sizes ...] [--reps N] [--json]        (CUDA GPUs, NCCL)
  gradcomp-bench project [--params 1e9,7e9] [--link-gbps 25,100,400] [--gpus-per-node 8]
                         [--nodes 16] [--nvlink-gbps 3600] [--encode-gbps G] [--overlap 0.5]
                         [--diloco-h 100]
                         [--json]   (a model: bf16, fp8, flat and hierarchical q4, DiLoCo)
)";

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
      "--sizes",       "--codecs",  "--dtypes",     "--device",        "--threads",
      "--reps",        "--params",  "--link-gbps",  "--gpus-per-node", "--nodes",
      "--encode-gbps", "--overlap", "--nvlink-gbps"};
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

namespace {

double parse_number(const std::string& s, const char* what, double lo, double hi) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
    fail(std::string("bad value '") + s + "' for " + what);
  }
  return v;
}

}  // namespace

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

}  // namespace gradcomp_bench
