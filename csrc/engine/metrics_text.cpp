// A rank's counters in Prometheus's text format, and the atomic file write of the textfile
// collector.
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

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

std::string prometheus_text(const ReductionStats& s, const MetricLabels& labels) {
  Exposition e(labels);
  e.metric("gradcomp_steps_total", "counter", "Training steps begun.", s.steps);
  e.metric("gradcomp_buckets_total", "counter", "Gradient buckets reduced.", s.buckets);
  e.metric("gradcomp_compressed_buckets_total", "counter", "Buckets that went through the codec.",
           s.compressed_buckets);
  e.metric("gradcomp_sent_bytes_total", "counter", "Bytes this rank put on the wire.",
           s.bytes_sent);
  e.metric("gradcomp_inter_node_sent_bytes_total", "counter",
           "The part of the sent bytes that left the node.", s.inter_node_bytes);
  e.metric("gradcomp_uncompressed_bytes_total", "counter",
           "Bytes the uncompressed collective of the same buckets would have sent.",
           s.uncompressed_bytes);
  e.metric("gradcomp_compression_ratio", "gauge",
           "Uncompressed bytes over sent bytes since the start (0 before anything was sent).",
           s.bytes_sent > 0 ? static_cast<double>(s.uncompressed_bytes) / s.bytes_sent : 0.0);
  e.metric("gradcomp_codec_seconds_total", "counter",
           "Seconds of encoding and decoding (time outside the collectives).", s.codec_seconds);
  e.metric("gradcomp_communication_seconds_total", "counter", "Seconds in collectives.",
           s.comm_seconds);
  e.histogram("gradcomp_bucket_seconds",
              "Seconds from a bucket's start to its end (on CUDA: to its queueing).", s);
  e.metric("gradcomp_buckets_in_backward_total", "counter",
           "Buckets whose reduction ended before the step's last bucket was handed in.",
           s.buckets_in_backward);
  e.metric("gradcomp_overlapped_buckets_total", "counter",
           "Buckets decoded while the next one was on the wire.", s.overlapped_buckets);
  e.metric("gradcomp_nonfinite_buckets_total", "counter",
           "Buckets whose result held NaN or infinity (the step is skipped by a scaler).",
           s.nonfinite_buckets);
  e.metric("gradcomp_rejected_payloads_total", "counter",
           "Payloads that failed their checks (corrupted or foreign bytes).", s.rejected_payloads);
  e.metric("gradcomp_failed_buckets_total", "counter", "Bucket reductions that raised.",
           s.failed_buckets);
  e.metric("gradcomp_failed_steps_total", "counter", "Steps with a failed bucket.", s.failed_steps);
  e.metric("gradcomp_residual_bytes", "gauge", "Memory of error-feedback residuals now.",
           s.residual_bytes);
  return e.text();
}

void write_file_atomically(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    GRADCOMP_CHECK(f.good(), "cannot write metrics to " << tmp << ": " << std::strerror(errno));
    f << text;
    f.flush();
    GRADCOMP_CHECK(f.good(), "cannot write metrics to " << tmp << ": " << std::strerror(errno));
  }
  GRADCOMP_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0,
                 "cannot move " << tmp << " to " << path << ": " << std::strerror(errno));
}

}  // namespace gradcomp
