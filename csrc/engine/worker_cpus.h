// Where the engine's worker thread runs: the request ("auto", "inherit", a CPU list) and the rule.
#pragma once

#include <string>
#include <thread>
#include <vector>

namespace gradcomp {
namespace detail {

struct CpuRequest {
  enum class Kind { kAuto, kInherit, kList } kind = Kind::kAuto;
  std::vector<int> cpus;  // kList: sorted, no repeats
};

// "auto", "inherit" or a list such as "0,2-3"; throws Error naming the bad part.
CpuRequest parse_cpu_request(const std::string& spec);

// What "auto" decides from what it sees (a pure function, for tests): `mine`, the CPUs of the
// thread that binds the engine; whether OpenMP binding is configured; the CPUs the process may
// use; the CPUs some thread is bound to alone. Returns the worker's CPUs (under OpenMP binding:
// the binding thread's own and every allowed one no thread is bound to), empty to keep the
// inherited mask, and says why in `why`.
std::vector<int> choose_auto_cpus(const std::vector<int>& mine, bool openmp_binds,
                                  const std::vector<int>& allowed, const std::vector<int>& bound,
                                  std::string* why);

// The CPUs for a worker the calling thread is about to start (reads its affinity, the OpenMP
// environment, the cgroup's cpuset and the process's threads). Empty: inherit. Throws Error for
// a list naming a CPU the process may not use.
std::vector<int> place_worker(const CpuRequest& request, std::string* why);

// The calling thread's CPUs, and a thread's CPUs set (empty list: nothing is done).
std::vector<int> current_thread_cpus();
std::vector<int> thread_cpus(std::thread& thread);
void set_thread_cpus(std::thread& thread, const std::vector<int>& cpus);

std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace detail
}  // namespace gradcomp
