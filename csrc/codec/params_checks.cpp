// The shared params checks of the CPU and CUDA backends.
#include "params_checks.h"

namespace gradcomp {
namespace detail {
namespace {

void check_payload_pointers(const uint8_t* const* payloads, int count, const char* what) {
  for (int w = 0; w < count; ++w)
    GRADCOMP_CHECK(payloads[w] != nullptr, what << ": payload " << w << " is null");
}

}  // namespace

void check_segments(const Segment* segments, int count, int64_t begin, int64_t numel,
                    const char* what) {
  GRADCOMP_CHECK(count >= 0 && (count == 0 || segments != nullptr), what << ": no segment table");
  int64_t expect = count > 0 ? segments[0].offset : 0;
  for (int i = 0; i < count; ++i) {
    GRADCOMP_CHECK(segments[i].offset == expect && segments[i].numel >= 0,
                   what << ": segment " << i << " has offset " << segments[i].offset
                        << ", expected " << expect << " (segments must be contiguous in order)");
    GRADCOMP_CHECK(segments[i].numel == 0 || segments[i].data != nullptr,
                   what << ": segment " << i << " has no data");
    expect += segments[i].numel;
  }
  const int64_t first = count > 0 ? segments[0].offset : 0;
  GRADCOMP_CHECK(numel >= 0, what << ": element count " << numel << " is negative");
  GRADCOMP_CHECK(numel == 0 || (begin >= first && begin + numel <= expect),
                 what << ": range [" << begin << ", " << begin + numel
                      << ") is outside the segments' elements [" << first << ", " << expect << ")");
}

void check_params(const Q4EncodeParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (block size " << p.block_size
                                          << ", range start " << p.begin << ", elements " << p.numel
                                          << ", dtype code " << int(p.dtype) << ")");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, what);
}

void check_params(const Q4DecodeParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (block size " << p.block_size
                                          << ", " << p.num_payloads << " payloads of "
                                          << p.payload_bytes << " bytes, elements " << p.numel
                                          << ", dtype code " << int(p.dtype) << ")");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, what);
  check_payload_pointers(p.payloads, p.num_payloads, what);
}

void check_params(const TopKEncodeParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (elements " << p.numel << ", k "
                                          << p.k << ", capacity " << p.capacity << ", dtype code "
                                          << int(p.dtype) << ")");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, what);
}

void check_params(const TopKDecodeParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (" << p.num_payloads
                                          << " payloads of " << p.payload_bytes
                                          << " bytes, elements " << p.numel << ", capacity "
                                          << p.capacity << ", dtype code " << int(p.dtype) << ")");
  check_segments(p.segments, p.num_segments, p.begin, p.numel, what);
  check_payload_pointers(p.payloads, p.num_payloads, what);
}

void check_params(const PayloadCheckParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (" << p.num_payloads
                                          << " payloads of " << p.payload_bytes << " bytes)");
  check_payload_pointers(p.payloads, p.num_payloads, what);
  for (int w = 0; w < p.num_payloads; ++w)
    GRADCOMP_CHECK(p.numel[w] >= 0,
                   what << ": payload " << w << " has element count " << p.numel[w]);
}

void check_params(const TopKAccumulateParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (elements " << p.numel
                                          << ", momentum " << p.momentum << ", clip threshold "
                                          << p.clip_threshold << ")");
  check_segments(p.segments, p.num_segments, 0, p.numel, what);
}

void check_params(const TopKMaskParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (elements " << p.numel
                                          << ", capacity " << p.capacity << ")");
}

void check_params(const NonfiniteScanParams& p, const char* what) {
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (elements " << p.numel
                                          << ", dtype code " << int(p.dtype) << ")");
  const int64_t first = p.num_segments > 0 && p.segments != nullptr ? p.segments[0].offset : 0;
  check_segments(p.segments, p.num_segments, first, p.numel, what);
  int64_t total = 0;
  for (int i = 0; i < p.num_segments; ++i) total += p.segments[i].numel;
  GRADCOMP_CHECK(total == p.numel, what << ": the segments hold " << total
                                        << " elements, the params say " << p.numel);
}

EndBucketParams end_bucket_params(const ResidualPair* pairs, int count, const char* what) {
  EndBucketParams p;
  p.num_pairs = count;
  if (count > 0 && count <= EndBucketParams::kMaxPairs) {
    GRADCOMP_CHECK(pairs != nullptr, what << ": no residual pairs");
    for (int i = 0; i < count; ++i) p.pairs[i] = pairs[i];
  }
  const char* problem = params_problem(p);
  GRADCOMP_CHECK(problem == nullptr, what << ": " << problem << " (" << count << " pairs)");
  return p;
}

void check_backend_workspace(const void* workspace, const char* what) {
  GRADCOMP_CHECK(workspace != nullptr,
                 what << ": no workspace (a Backend needs topk_workspace_bytes(numel) of it)");
}

}  // namespace detail
}  // namespace gradcomp
