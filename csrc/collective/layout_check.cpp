// The layout agreement before a bucket's first compressed exchange: fingerprints and their report.
#include "layout_check.h"

#include <sstream>
#include <string>
#include <vector>

#include "backend_buffer.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {

LayoutFingerprint layout_fingerprint(const CompressionConfig& config, uint64_t bucket_id,
                                     int64_t numel, int64_t codec_numel, int world, DType dtype) {
  LayoutFingerprint f;
  std::memset(&f, 0, sizeof f);
  f.bucket_id = bucket_id;
  f.numel = numel;
  f.world = static_cast<uint32_t>(world);
  f.codec = static_cast<uint8_t>(config.codec);
  f.dtype = static_cast<uint8_t>(dtype);
  f.residual_dtype = static_cast<uint8_t>(config.residual_dtype);
  f.param = block_codec(config.codec)
                ? static_cast<uint32_t>(config.q4.block_size)
                : static_cast<uint32_t>(topk_capacity(codec_numel, config.topk));
  f.error_feedback = config.error_feedback ? 1 : 0;
  return f;
}

void exchange_layout_report(Communicator& group, Backend& backend, LayoutReport& report,
                            const std::function<int(int)>& global_of,
                            const std::function<void(const std::function<void()>&)>& run) {
  const int world = group.world_size();
  const LayoutFingerprint mine = report.mine;
  std::vector<LayoutReport> all(world);
  BackendBuffer send(backend, sizeof report), recv(backend, sizeof report * world);
  backend.copy_from_host(send.get(), &report, sizeof report);
  run([&] { group.all_gather(send.get(), recv.get(), sizeof report); });
  backend.copy_to_host(all.data(), recv.get(), sizeof report * world);
  for (int w = 0; w < world && report.other_rank < 0; ++w) {
    if (all[w].other_rank < 0) continue;
    report = all[w];
    report.mine = mine;
  }
  for (int w = 0; w < world && report.other_rank < 0; ++w) {
    if (all[w].mine == all[0].mine) continue;
    report.first = all[0].mine;
    report.other = all[w].mine;
    report.first_rank = global_of(0);
    report.other_rank = global_of(w);
  }
}

namespace {

std::string describe(int rank, const LayoutFingerprint& f) {
  std::ostringstream o;
  o << "rank " << rank << " has " << (f.collective == 1 ? "reduce-scatter " : "") << "bucket "
    << f.bucket_id << " with " << f.numel << " elements (dtype " << int(f.dtype) << ", codec "
    << int(f.codec) << ", param " << f.param << ", " << f.local_world << " ranks per node";
  if (f.piece != 0) o << ", pieces of " << f.piece << " elements";
  o << ")";
  return o.str();
}

}  // namespace

void raise_layout_mismatch(const LayoutReport& report) {
  if (report.other_rank < 0) return;
  GRADCOMP_CHECK(false, "layout mismatch at the first compressed step: "
                            << describe(report.first_rank, report.first) << ", "
                            << describe(report.other_rank, report.other)
                            << "; every rank must build identical buckets");
}

}  // namespace detail
}  // namespace gradcomp
