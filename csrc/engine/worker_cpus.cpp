// Where the engine's worker thread runs: the request's parsing, the "auto" rule and its inputs.
#include "worker_cpus.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {
namespace {

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

int parse_cpu(const std::string& text, const std::string& spec) {
  const std::string t = trim(text);
  bool digits = !t.empty() && t.size() <= 5;
  for (char c : t) digits = digits && std::isdigit(static_cast<unsigned char>(c));
  const int cpu = digits ? std::atoi(t.c_str()) : -1;
  GRADCOMP_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "worker_cpus '" << spec << "': '" << text
                                                                << "' is not a CPU number in [0, "
                                                                << CPU_SETSIZE << ")");
  return cpu;
}

// A CPU list as Linux writes it ("0-3,8"); an unreadable or empty one gives nothing.
std::vector<int> parse_linux_list(const std::string& text) {
  std::set<int> cpus;
  std::stringstream in(trim(text));
  std::string part;
  while (std::getline(in, part, ',')) {
    const size_t dash = part.find('-');
    const int a = std::atoi(part.substr(0, dash).c_str());
    const int b = dash == std::string::npos ? a : std::atoi(part.substr(dash + 1).c_str());
    for (int c = a; c <= b && c < CPU_SETSIZE; ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::vector<int> from_set(const cpu_set_t& set) {
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

// OpenMP binds its threads when asked to (GNU and LLVM/Intel runtimes' variables); the thread
// that starts the runtime is bound too, and every thread it starts later inherits that.
bool openmp_binds() {
  auto get = [](const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : lower(trim(v));
  };
  const std::string bind = get("OMP_PROC_BIND");
  if (!bind.empty() && bind != "false") return true;
  if (!get("OMP_PLACES").empty() || !get("GOMP_CPU_AFFINITY").empty()) return true;
  const std::string kmp = get("KMP_AFFINITY");
  return !kmp.empty() && kmp.find("disabled") == std::string::npos &&
         kmp.find("none") == std::string::npos;
}

// The CPUs the process's cgroup allows (cgroup v2), else the online ones.
std::vector<int> allowed_cpus() {
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    if (line.rfind("0::", 0) != 0) continue;
    std::string path = "/sys/fs/cgroup" + line.substr(3);
    // A cgroup without its own cpuset shows its parent's in cpuset.cpus.effective.
    std::vector<int> cpus = parse_linux_list(read_first_line(path + "/cpuset.cpus.effective"));
    if (!cpus.empty()) return cpus;
  }
  std::vector<int> online = parse_linux_list(read_first_line("/sys/devices/system/cpu/online"));
  if (!online.empty()) return online;
  std::vector<int> all(std::max(1u, std::thread::hardware_concurrency()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
  return all;
}

// CPUs that some thread on this machine (as far as /proc shows) is bound to alone, gradcomp's
// own workers aside: OpenMP's compute threads, this process's and other ranks'.
std::vector<int> bound_cpus() {
  std::set<int> bound;
  auto for_each_entry = [](const std::string& dir, auto&& fn) {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return;
    while (dirent* e = readdir(d)) {
      if (std::isdigit(static_cast<unsigned char>(e->d_name[0]))) fn(std::string(e->d_name));
    }
    closedir(d);
  };
  for_each_entry("/proc", [&](const std::string& pid) {
    // Kernel threads (no command line) are bound per CPU by design and run only briefly.
    if (read_first_line("/proc/" + pid + "/cmdline").empty()) return;
    for_each_entry("/proc/" + pid + "/task", [&](const std::string& tid) {
      std::ifstream status("/proc/" + pid + "/task/" + tid + "/status");
      std::string line, name;
      while (std::getline(status, line)) {
        if (line.rfind("Name:", 0) == 0) name = trim(line.substr(5));
        if (line.rfind("Cpus_allowed_list:", 0) != 0) continue;
        const std::vector<int> cpus = parse_linux_list(line.substr(18));
        if (cpus.size() == 1 && name.rfind("gradcomp-", 0) != 0) bound.insert(cpus[0]);
        break;
      }
    });
  });
  return {bound.begin(), bound.end()};
}

}  // namespace

CpuRequest parse_cpu_request(const std::string& spec) {
  CpuRequest r;
  const std::string s = lower(trim(spec));
  if (s == "auto") return r;
  if (s == "inherit") {
    r.kind = CpuRequest::Kind::kInherit;
    return r;
  }
  GRADCOMP_CHECK(!s.empty(),
                 "worker_cpus must be 'auto', 'inherit' or a CPU list such as "
                 "'0,2-3', got an empty string");
  std::set<int> cpus;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ',')) {
    const size_t dash = part.find('-');
    const int a = parse_cpu(part.substr(0, dash), spec);
    const int b = dash == std::string::npos ? a : parse_cpu(part.substr(dash + 1), spec);
    GRADCOMP_CHECK(a <= b, "worker_cpus '" << spec << "': range '" << part << "' runs backwards");
    for (int c = a; c <= b; ++c) cpus.insert(c);
  }
  GRADCOMP_CHECK(!cpus.empty() && s.back() != ',',
                 "worker_cpus '" << spec << "' must be 'auto', 'inherit' or a CPU list");
  r.kind = CpuRequest::Kind::kList;
  r.cpus.assign(cpus.begin(), cpus.end());
  return r;
}

std::vector<int> choose_auto_cpus(const std::vector<int>& mine, bool openmp_binds,
                                  const std::vector<int>& allowed, const std::vector<int>& bound,
                                  std::string* why) {
  std::ostringstream o;
  std::vector<int> chosen;
  if (mine.size() != 1) {
    o << "inherited: the binding thread may run on " << mine.size()
      << " CPUs, and the scheduler moves the worker to an idle one";
  } else if (!openmp_binds) {
    o << "inherited: the binding thread is bound to CPU " << mine[0]
      << " by the process's own mask (taskset, numactl), which the worker keeps";
  } else {
    // Its own core stays in: while backward waits for the buckets, the worker and the
    // collectives threads it starts may use it too.
    for (int c : allowed) {
      if (c == mine[0] || !std::binary_search(bound.begin(), bound.end(), c)) chosen.push_back(c);
    }
    if (chosen.size() <= 1) {
      chosen.clear();
      o << "inherited: OpenMP bound the binding thread to CPU " << mine[0]
        << ", and every other CPU has a thread bound to it";
    } else {
      o << "OpenMP bound the binding thread to CPU " << mine[0] << "; the worker runs on CPUs "
        << format_cpu_list(chosen) << ": that one and those no thread is bound to";
    }
  }
  if (why != nullptr) *why = o.str();
  return chosen;
}

std::vector<int> place_worker(const CpuRequest& request, std::string* why) {
  switch (request.kind) {
    case CpuRequest::Kind::kInherit:
      if (why != nullptr) *why = "inherited, as asked";
      return {};
    case CpuRequest::Kind::kList: {
      const std::vector<int> allowed = allowed_cpus();
      for (int c : request.cpus) {
        GRADCOMP_CHECK(std::binary_search(allowed.begin(), allowed.end(), c),
                       "worker_cpus: CPU " << c << " is not available to this process (it may use "
                                           << format_cpu_list(allowed) << ")");
      }
      if (why != nullptr) *why = "CPUs " + format_cpu_list(request.cpus) + ", as asked";
      return request.cpus;
    }
    case CpuRequest::Kind::kAuto:
      break;
  }
  const std::vector<int> mine = current_thread_cpus();
  const bool omp = openmp_binds();
  // Reading every thread's status is only needed when OpenMP bound this thread to one CPU.
  if (mine.size() != 1 || !omp) return choose_auto_cpus(mine, omp, {}, {}, why);
  return choose_auto_cpus(mine, omp, allowed_cpus(), bound_cpus(), why);
}

std::vector<int> current_thread_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return {};
  return from_set(set);
}

std::vector<int> thread_cpus(std::thread& thread) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (pthread_getaffinity_np(thread.native_handle(), sizeof set, &set) != 0) return {};
  return from_set(set);
}

void set_thread_cpus(std::thread& thread, const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  const int rc = pthread_setaffinity_np(thread.native_handle(), sizeof set, &set);
  GRADCOMP_CHECK(rc == 0, "worker_cpus: cannot move the worker thread to CPUs "
                              << format_cpu_list(cpus) << " (error " << rc << ")");
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::ostringstream o;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (i > 0) o << ",";
    o << cpus[i];
    if (j > i) o << "-" << cpus[j];
    i = j + 1;
  }
  return o.str();
}

}  // namespace detail
}  // namespace gradcomp
