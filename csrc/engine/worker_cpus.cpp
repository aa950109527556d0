// Where the engine's worker thread runs: the request's parsing, the "auto" rule and its inputs.
#include "worker_cpus.h"

#include <dirent.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
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
  GRADCOMP_CHECK(cpu >= 0 && cpu < kMaxCpus, "worker_cpus '" << spec << "': '" << text
                                                             << "' is not a CPU number in [0, "
                                                             << kMaxCpus << ")");
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
    for (int c = std::max(a, 0); c <= b && c < kMaxCpus; ++c) cpus.insert(c);
  }
  return {cpus.begin(), cpus.end()};
}

std::string read_first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::vector<int> intersect(const std::vector<int>& a, const std::vector<int>& b) {
  std::vector<int> out;
  std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
  return out;
}

bool contains(const std::vector<int>& sorted, int c) {
  return std::binary_search(sorted.begin(), sorted.end(), c);
}

// A CPU mask of the kernel's size, however many CPUs the machine has.
class CpuMask {
 public:
  explicit CpuMask(int cpus) : cpus_(cpus), set_(CPU_ALLOC(cpus), &free_set) {
    CPU_ZERO_S(bytes(), set_.get());
  }
  size_t bytes() const { return CPU_ALLOC_SIZE(cpus_); }
  cpu_set_t* get() { return set_.get(); }
  std::vector<int> list() const {
    std::vector<int> out;
    for (int c = 0; c < cpus_; ++c)
      if (CPU_ISSET_S(c, bytes(), set_.get())) out.push_back(c);
    return out;
  }
  void set(const std::vector<int>& cpus) {
    CPU_ZERO_S(bytes(), set_.get());
    for (int c : cpus)
      if (c < cpus_) CPU_SET_S(c, bytes(), set_.get());
  }

 private:
  static void free_set(cpu_set_t* s) { CPU_FREE(s); }
  int cpus_;
  std::unique_ptr<cpu_set_t, void (*)(cpu_set_t*)> set_;
};

}  // namespace

// The calling thread's mask, in a set as large as the kernel's (EINVAL: too small).
std::vector<int> current_thread_cpus() {
  for (int n = 1024; n <= kMaxCpus; n *= 2) {
    CpuMask mask(n);
    if (sched_getaffinity(0, mask.bytes(), mask.get()) == 0) return mask.list();
    if (errno != EINVAL) break;
  }
  return {};
}

namespace {

// The hyperthreads of the core that holds `cpu` (itself alone when unknown).
std::vector<int> core_of(int cpu) {
  std::vector<int> siblings = parse_linux_list(read_first_line(
      "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/thread_siblings_list"));
  return siblings.empty() ? std::vector<int>{cpu} : siblings;
}

// Whether a mask is one CPU or the hyperthreads of one core: a thread bound by OpenMP
// (OMP_PLACES=threads or cores).
bool one_core(const std::vector<int>& cpus, std::map<int, std::vector<int>>* cores) {
  if (cpus.size() <= 1) return cpus.size() == 1;
  auto it = cores->find(cpus[0]);
  if (it == cores->end()) it = cores->emplace(cpus[0], core_of(cpus[0])).first;
  return intersect(cpus, it->second).size() == cpus.size();
}

// OpenMP binds its threads when asked to (GNU and LLVM/Intel runtimes' variables); the thread
// that starts the runtime is bound too, and every thread it starts later inherits that.
bool openmp_binds() {
  auto get = [](const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : lower(trim(v));
  };
  const std::string bind = get("OMP_PROC_BIND");
  if (bind == "false") return false;
  if (!bind.empty() || !get("OMP_PLACES").empty() || !get("GOMP_CPU_AFFINITY").empty()) return true;
  const std::string kmp = get("KMP_AFFINITY");
  for (const char* type : {"compact", "scatter", "balanced", "explicit", "logical", "physical"}) {
    if (kmp.find(type) != std::string::npos) return true;
  }
  return false;
}

// The CPUs the process's cpuset allows (cgroup v2 or v1), else the online ones.
std::vector<int> cpuset_cpus() {
  std::ifstream cgroups("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroups, line)) {
    std::vector<int> cpus;
    if (line.rfind("0::", 0) == 0) {
      // A cgroup without its own cpuset shows its parent's in cpuset.cpus.effective.
      cpus = parse_linux_list(
          read_first_line("/sys/fs/cgroup" + line.substr(3) + "/cpuset.cpus.effective"));
    } else {
      const size_t a = line.find(':'), b = line.find(':', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      std::stringstream controllers(line.substr(a + 1, b - a - 1));
      std::string c;
      bool cpuset = false;
      while (std::getline(controllers, c, ',')) cpuset = cpuset || c == "cpuset";
      if (!cpuset) continue;
      const std::string dir = "/sys/fs/cgroup/cpuset" + line.substr(b + 1);
      cpus = parse_linux_list(read_first_line(dir + "/cpuset.effective_cpus"));
      if (cpus.empty()) cpus = parse_linux_list(read_first_line(dir + "/cpuset.cpus"));
    }
    if (!cpus.empty()) return cpus;
  }
  return parse_linux_list(read_first_line("/sys/devices/system/cpu/online"));
}

// The CPUs of the NUMA node that holds `cpu` (nothing when unknown).
std::vector<int> numa_node_of(int cpu) {
  DIR* d = opendir("/sys/devices/system/node");
  if (d == nullptr) return {};
  std::vector<int> found;
  while (dirent* e = readdir(d)) {
    if (std::strncmp(e->d_name, "node", 4) != 0 || !std::isdigit(e->d_name[4])) continue;
    std::vector<int> cpus = parse_linux_list(
        read_first_line(std::string("/sys/devices/system/node/") + e->d_name + "/cpulist"));
    if (contains(cpus, cpu)) found = std::move(cpus);
  }
  closedir(d);
  return found;
}

// CPUs that some thread on this machine (as far as /proc shows) is bound to, alone or with its
// core's hyperthreads, gradcomp's own workers and the kernel's per-CPU threads aside: OpenMP's
// compute threads, this process's and other ranks'.
std::vector<int> bound_cpus(std::map<int, std::vector<int>>* cores) {
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
    if (read_first_line("/proc/" + pid + "/cmdline").empty()) return;  // a kernel thread
    for_each_entry("/proc/" + pid + "/task", [&](const std::string& tid) {
      std::ifstream status("/proc/" + pid + "/task/" + tid + "/status");
      std::string line, name;
      while (std::getline(status, line)) {
        if (line.rfind("Name:", 0) == 0) name = trim(line.substr(5));
        if (line.rfind("Cpus_allowed_list:", 0) != 0) continue;
        const std::vector<int> cpus = parse_linux_list(line.substr(18));
        if (name.rfind("gradcomp-", 0) != 0 && one_core(cpus, cores))
          bound.insert(cpus.begin(), cpus.end());
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

std::vector<int> choose_auto_cpus(const std::vector<int>& mine, bool mine_is_one_core,
                                  bool openmp_binds, const std::vector<int>& allowed,
                                  const std::vector<int>& bound, std::string* why) {
  std::ostringstream o;
  std::vector<int> chosen;
  const std::string cpus = format_cpu_list(mine);
  if (!mine_is_one_core) {
    o << "inherited: the binding thread may run on CPUs " << cpus
      << ", and the scheduler moves the worker to an idle one";
  } else if (!openmp_binds) {
    o << "inherited: the binding thread is bound to CPU " << cpus
      << " by the process's own mask (taskset, numactl), which the worker keeps";
  } else {
    // Its own core stays in: while backward waits for the buckets, the worker and the
    // collectives threads it starts may use it too.
    std::set<int> take(mine.begin(), mine.end());
    for (int c : allowed)
      if (!contains(bound, c)) take.insert(c);
    chosen.assign(take.begin(), take.end());
    if (chosen.size() == mine.size()) {
      chosen.clear();
      o << "inherited: OpenMP bound the binding thread to CPU " << cpus
        << ", and every other CPU near it has a thread bound to it";
    } else {
      o << "OpenMP bound the binding thread to CPU " << cpus << "; the worker runs on CPUs "
        << format_cpu_list(chosen) << ": that core and the free ones of its cpuset and NUMA node";
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
      const std::vector<int> allowed = cpuset_cpus();
      for (int c : request.cpus) {
        GRADCOMP_CHECK(contains(allowed, c), "worker_cpus: CPU "
                                                 << c << " is not available to this process (it "
                                                 << "may use " << format_cpu_list(allowed) << ")");
      }
      if (why != nullptr) *why = "CPUs " + format_cpu_list(request.cpus) + ", as asked";
      return request.cpus;
    }
    case CpuRequest::Kind::kAuto:
      break;
  }
  const std::vector<int> mine = current_thread_cpus();
  std::map<int, std::vector<int>> cores;
  const bool mine_one_core = one_core(mine, &cores);
  const bool omp = openmp_binds();
  // The rest is read only when OpenMP bound this thread to one core.
  if (!mine_one_core || !omp) return choose_auto_cpus(mine, mine_one_core, omp, {}, {}, why);
  // Within the cpuset and this core's NUMA node: a rank confined by taskset or numactl whose
  // OpenMP then bound it cannot be told from one OpenMP bound alone, and the node keeps the
  // worker beside the gradients' memory either way.
  std::vector<int> allowed = cpuset_cpus();
  const std::vector<int> node = numa_node_of(mine[0]);
  if (!node.empty()) allowed = intersect(allowed, node);
  return choose_auto_cpus(mine, true, true, allowed, bound_cpus(&cores), why);
}

ScopedThreadCpus::ScopedThreadCpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  std::vector<int> saved = current_thread_cpus();
  GRADCOMP_CHECK(!saved.empty(),
                 "worker_cpus: cannot read this thread's CPUs (" << std::strerror(errno) << ")");
  CpuMask mask(std::max(1024, cpus.back() + 1));
  mask.set(cpus);
  GRADCOMP_CHECK(sched_setaffinity(0, mask.bytes(), mask.get()) == 0,
                 "worker_cpus: the kernel refused CPUs " << format_cpu_list(cpus) << " ("
                                                         << std::strerror(errno) << ")");
  saved_ = std::move(saved);
}

ScopedThreadCpus::~ScopedThreadCpus() {
  if (saved_.empty()) return;
  CpuMask mask(std::max(1024, saved_.back() + 1));
  mask.set(saved_);
  // Restoring a mask this thread had a moment ago does not fail; nothing could be done if it did.
  (void)sched_setaffinity(0, mask.bytes(), mask.get());
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
