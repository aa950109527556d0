// The checks every backend runs on a params struct before touching memory: the CPU and the CUDA
// backend call the same ones, so they refuse exactly the same inputs with the same message.
#pragma once

#include <cstdint>

#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {

// Segments must be contiguous, in order, with data behind every non-empty one, and
// [begin, begin + numel) must lie inside them. `what` names the call in the error.
void check_segments(const Segment* segments, int count, int64_t begin, int64_t numel,
                    const char* what);

// params_problem() of the struct (params.h), the segment table, and for decoders a pointer for
// every payload. Throws Error naming `what`.
void check_params(const Q4EncodeParams& p, const char* what);
void check_params(const Q4DecodeParams& p, const char* what);
void check_params(const TopKEncodeParams& p, const char* what);
void check_params(const TopKDecodeParams& p, const char* what);
void check_params(const PayloadCheckParams& p, const char* what);
void check_params(const TopKAccumulateParams& p, const char* what);
void check_params(const TopKMaskParams& p, const char* what);
void check_params(const NonfiniteScanParams& p, const char* what);

// The params of Backend::end_bucket, checked.
EndBucketParams end_bucket_params(const ResidualPair* pairs, int count, const char* what);

// What a Backend needs beyond the codec's own rules: the top-k workspace (the CPU codecs would
// allocate one per call; the kernels cannot).
void check_backend_workspace(const void* workspace, const char* what);

}  // namespace detail
}  // namespace gradcomp
