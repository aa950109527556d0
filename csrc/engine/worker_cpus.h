// Where the engine's worker thread runs: the request ("auto", "inherit", a CPU list) and the rule.
#pragma once

#include <string>
#include <vector>

namespace gradcomp {
namespace detail {

struct CpuRequest {
  enum class Kind { kAuto, kInherit, kList } kind = Kind::kAuto;
  std::vector<int> cpus;  // kList: sorted, no repeats
};

// CPU numbers a request may name: [0, kMaxCpus).
constexpr int kMaxCpus = 1 << 16;

// "auto", "inherit" or a list such as "0,2-3"; throws Error naming the bad part.
CpuRequest parse_cpu_request(const std::string& spec);

// What "auto" decides from what it sees (a pure function, for tests): `mine`, the CPUs of the
// thread that binds the engine, and whether they are one core (one CPU, or the hyperthreads of
// one core); whether OpenMP binding is configured; the CPUs the worker may use at all; the CPUs
// some thread is bound to (alone, or with its core's hyperthreads). Returns the worker's CPUs
// (under OpenMP binding: the binding thread's own and every allowed one no thread is bound to),
// empty to keep the inherited mask, and says why in `why`.
std::vector<int> choose_auto_cpus(const std::vector<int>& mine, bool mine_is_one_core,
                                  bool openmp_binds, const std::vector<int>& allowed,
                                  const std::vector<int>& bound, std::string* why);

// The CPUs for a worker the calling thread is about to start (reads its affinity, the OpenMP
// environment, the cgroup's cpuset, the NUMA node and the threads in /proc). Empty: inherit.
// Throws Error for a list naming a CPU the process may not use.
std::vector<int> place_worker(const CpuRequest& request, std::string* why);

// The calling thread's CPUs.
std::vector<int> current_thread_cpus();

// Moves the calling thread to `cpus` (nothing for an empty list) until destroyed, so that a
// thread it starts meanwhile begins there: a refused mask throws before that thread exists.
class ScopedThreadCpus {
 public:
  explicit ScopedThreadCpus(const std::vector<int>& cpus);
  ~ScopedThreadCpus();
  ScopedThreadCpus(const ScopedThreadCpus&) = delete;
  ScopedThreadCpus& operator=(const ScopedThreadCpus&) = delete;

 private:
  std::vector<int> saved_;
};

std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace detail
}  // namespace gradcomp
