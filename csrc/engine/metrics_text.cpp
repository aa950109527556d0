// A rank's counters in Prometheus's text format, and the atomic file write of the textfile
// collector.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>

#include "gradcomp/engine.h"

namespace gradcomp {
namespace {

std::string escaped(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

// The shortest text that reads back as the same double, %g-style (0.0001, not 1e-04: le labels
// are matched as strings).
std::string number(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general);
  return std::string(buf, r.ptr);
}
std::string number(uint64_t v) {
  return std::to_string(v);
}

class Exposition {
 public:
  explicit Exposition(const MetricLabels& l) {
    std::ostringstream o;
    o << "rank=\"" << l.rank << "\",local_rank=\"" << l.local_rank << "\",node=\""
      << escaped(l.node) << "\",codec=\"" << escaped(l.codec) << "\",front_end=\""
      << escaped(l.front_end) << "\"";
    labels_ = o.str();
  }
  template <typename T>
  void metric(const char* name, const char* type, const char* help, T value) {
    head(name, type, help);
    out_ << name << "{" << labels_ << "} " << number(value) << "\n";
  }
  void histogram(const char* name, const char* help, const ReductionStats& s) {
    head(name, "histogram", help);
    uint64_t cumulative = 0;
    for (int i = 0; i <= ReductionStats::kLatencyBuckets; ++i) {
      cumulative += s.latency_counts[i];
      out_ << name << "_bucket{" << labels_ << ",le=\"";
      if (i < ReductionStats::kLatencyBuckets) {
        out_ << number(ReductionStats::kLatencyBounds[i]);
      } else {
        out_ << "+Inf";
      }
      out_ << "\"} " << cumulative << "\n";
    }
    out_ << name << "_sum{" << labels_ << "} " << number(s.latency_seconds) << "\n";
    out_ << name << "_count{" << labels_ << "} " << cumulative << "\n";
  }
  std::string text() const { return out_.str(); }

 private:
  void head(const char* name, const char* type, const char* help) {
    out_ << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  }
  std::string labels_;
  std::ostringstream out_;
};

}  // namespace

MetricLabels metric_labels(int rank, std::string codec, std::string front_end) {
  MetricLabels l;
  l.rank = rank;
  for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      l.local_rank = std::atoi(v);
      break;
    }
  }
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) l.node = host;
  l.codec = std::move(codec);
  l.front_end = std::move(front_end);
  return l;
}

namespace {

// How a series reads its value from a rank's stats: a counter or a time as it stands, the
// compression ratio (uncompressed bytes over sent bytes, 0 before anything was sent), or the
// bucket latency histogram.
using Count = uint64_t ReductionStats::*;
using Seconds = double ReductionStats::*;
struct SentRatio {};
struct LatencyHistogram {};
using Reading = std::variant<Count, Seconds, SentRatio, LatencyHistogram>;

struct Series {
  const char* name;
  const char* type;  // counter, gauge or histogram
  const char* help;
  Reading reading;
};

using S = ReductionStats;

// The gradient reductions' series, in the order they are written.
const Series kGradientSeries[] = {
    {"gradcomp_steps_total", "counter", "Training steps begun.", &S::steps},
    {"gradcomp_buckets_total", "counter", "Gradient buckets reduced.", &S::buckets},
    {"gradcomp_compressed_buckets_total", "counter", "Buckets that went through the codec.",
     &S::compressed_buckets},
    {"gradcomp_sent_bytes_total", "counter", "Bytes this rank put on the wire.", &S::bytes_sent},
    {"gradcomp_inter_node_sent_bytes_total", "counter",
     "The part of the sent bytes that left the node.", &S::inter_node_bytes},
    {"gradcomp_uncompressed_bytes_total", "counter",
     "Bytes the uncompressed collective of the same buckets would have sent.",
     &S::uncompressed_bytes},
    {"gradcomp_compression_ratio", "gauge",
     "Uncompressed bytes over sent bytes since the start (0 before anything was sent).",
     SentRatio{}},
    {"gradcomp_codec_seconds_total", "counter",
     "Seconds of encoding and decoding (time outside the collectives).", &S::codec_seconds},
    {"gradcomp_communication_seconds_total", "counter", "Seconds in collectives.",
     &S::comm_seconds},
    {"gradcomp_bucket_seconds", "histogram",
     "Seconds from a bucket's start to its end (on CUDA: to its queueing).", LatencyHistogram{}},
    {"gradcomp_buckets_in_backward_total", "counter",
     "Buckets whose reduction ended before the step's last bucket was handed in.",
     &S::buckets_in_backward},
    {"gradcomp_overlapped_buckets_total", "counter",
     "Buckets decoded while the next one was on the wire.", &S::overlapped_buckets},
    {"gradcomp_nonfinite_buckets_total", "counter",
     "Buckets whose result held NaN or infinity (the step is skipped by a scaler).",
     &S::nonfinite_buckets},
    {"gradcomp_rejected_payloads_total", "counter",
     "Payloads that failed their checks (corrupted or foreign bytes).", &S::rejected_payloads},
    {"gradcomp_failed_buckets_total", "counter", "Bucket reductions that raised.",
     &S::failed_buckets},
    {"gradcomp_failed_steps_total", "counter", "Steps with a failed bucket.", &S::failed_steps},
    {"gradcomp_residual_bytes", "gauge", "Memory of error-feedback residuals now.",
     &S::residual_bytes},
};

// The parameter all-gathers' series (FSDP weights), written after the gradients'.
const Series kWeightSeries[] = {
    {"gradcomp_weight_all_gathers_total", "counter",
     "Parameter all-gathers run (one per module and all-gather).", &S::buckets},
    {"gradcomp_weight_sent_bytes_total", "counter",
     "Bytes this rank put on the wire for parameter all-gathers.", &S::bytes_sent},
    {"gradcomp_weight_uncompressed_bytes_total", "counter",
     "Bytes the all-gathers in the parameters' own dtype would have sent.", &S::uncompressed_bytes},
    {"gradcomp_weight_compression_ratio", "gauge",
     "Weight uncompressed bytes over weight sent bytes since the start (0 before any).",
     SentRatio{}},
    {"gradcomp_weight_codec_seconds_total", "counter",
     "Seconds of weight encoding and decoding (outside the all-gathers).", &S::codec_seconds},
    {"gradcomp_weight_communication_seconds_total", "counter", "Seconds in parameter all-gathers.",
     &S::comm_seconds},
    {"gradcomp_weight_failed_all_gathers_total", "counter",
     "Parameter all-gathers that raised (a non-finite weight, a peer's damaged payload).",
     &S::failed_buckets},
};

template <size_t N>
void write_series(Exposition& e, const Series (&table)[N], const ReductionStats& s) {
  for (const Series& series : table) {
    std::visit(
        [&](auto reading) {
          using R = decltype(reading);
          if constexpr (std::is_same_v<R, LatencyHistogram>) {
            e.histogram(series.name, series.help, s);
          } else if constexpr (std::is_same_v<R, SentRatio>) {
            e.metric(
                series.name, series.type, series.help,
                s.bytes_sent > 0 ? static_cast<double>(s.uncompressed_bytes) / s.bytes_sent : 0.0);
          } else {
            e.metric(series.name, series.type, series.help, s.*reading);
          }
        },
        series.reading);
  }
}

}  // namespace

std::string prometheus_text(const ReductionStats& s, const MetricLabels& labels) {
  Exposition e(labels);
  write_series(e, kGradientSeries, s);
  return e.text();
}

std::string prometheus_text(const ReductionStats& gradients, const ReductionStats& weights,
                            const MetricLabels& labels) {
  Exposition e(labels);
  write_series(e, kWeightSeries, weights);
  return prometheus_text(gradients, labels) + e.text();
}

namespace {

// Closes a descriptor and, unless released, removes the temporary it wrote.
struct TempFile {
  int fd = -1;
  std::string path;
  bool keep = false;
  ~TempFile() {
    if (fd >= 0) ::close(fd);
    if (!keep && !path.empty()) ::unlink(path.c_str());
  }
};

}  // namespace

void write_file_atomically(const std::string& path, const std::string& text) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  // A name of this call's own in the same directory (rename needs the same file system), created
  // exclusively and without following links: two writers never share a temporary, and a file or
  // link planted at a predictable name is refused instead of written through.
  static std::atomic<uint64_t> counter{0};
  TempFile tmp;
  for (int attempt = 0; tmp.fd < 0; ++attempt) {
    std::random_device rd;
    std::ostringstream name;
    name << path << ".tmp." << ::getpid() << '.' << counter.fetch_add(1) << '.' << std::hex
         << ((uint64_t{rd()} << 32) | rd());
    const int fd =
        ::open(name.str().c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) {
      tmp.fd = fd;
      tmp.path = name.str();
    } else {
      GRADCOMP_CHECK(errno == EEXIST && attempt < 16, "cannot write metrics to "
                                                          << path << " (" << name.str()
                                                          << "): " << std::strerror(errno));
    }
  }
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(tmp.fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    GRADCOMP_CHECK(n > 0, "cannot write metrics to " << tmp.path << ": " << std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  // Data on disk before the name points at it: a crash leaves the old file or the new one.
  GRADCOMP_CHECK(::fsync(tmp.fd) == 0,
                 "cannot sync metrics file " << tmp.path << ": " << std::strerror(errno));
  ::close(tmp.fd);
  tmp.fd = -1;
  GRADCOMP_CHECK(std::rename(tmp.path.c_str(), path.c_str()) == 0,
                 "cannot move " << tmp.path << " to " << path << ": " << std::strerror(errno));
  tmp.keep = true;
  // The rename itself lasts once the directory is synced.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  GRADCOMP_CHECK(dfd >= 0,
                 "cannot open directory " << dir << " of " << path << ": " << std::strerror(errno));
  const int synced = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  GRADCOMP_CHECK(synced == 0,
                 "cannot sync directory " << dir << " of " << path << ": " << std::strerror(err));
}

}  // namespace gradcomp
