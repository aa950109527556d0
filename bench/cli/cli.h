// gradcomp-bench: the command line shared by its modes (options, numbers, timing, failure).
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace gradcomp_bench {

extern const char* const kUsage;

struct Args {
  std::string mode;
  std::map<std::string, std::string> opts;
  bool json = false;
};

// Prints the message and the usage, and exits with status 2 (a command-line program's way out).
[[noreturn]] void fail(const std::string& msg);
Args parse(int argc, char** argv);
// The comma-separated numbers of option `key` (default `def`), each in [lo, hi].
std::vector<double> numbers(const Args& a, const char* key, const char* def, double lo, double hi);
std::string opt(const Args& a, const char* key, const char* def);
std::vector<std::string> split(const std::string& s);
double median(std::vector<double> v);
double seconds_since(std::chrono::steady_clock::time_point t0);

// The modes: each prints its table (or JSON) and returns the exit status.
int codec_mode(const Args& a);
int project_mode(const Args& a);
int collective_mode(const Args& a);

}  // namespace gradcomp_bench
