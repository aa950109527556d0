// Host-side checks of segment tables, shared by the CPU and CUDA backends so both reject alike.
#pragma once

#include <cstdint>

#include "gradcomp/types.h"

namespace gradcomp {
namespace detail {

// Segments must be contiguous, in order, with data behind every non-empty one, and
// [begin, begin + numel) must lie inside them. `what` names the call in the error.
inline void check_segments(const Segment* segments, int count, int64_t begin, int64_t numel,
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
  int64_t first = count > 0 ? segments[0].offset : 0;
  GRADCOMP_CHECK(numel >= 0, what << ": element count " << numel << " is negative");
  GRADCOMP_CHECK(numel == 0 || (begin >= first && begin + numel <= expect),
                 what << ": range [" << begin << ", " << begin + numel
                      << ") is outside the segments' elements [" << first << ", " << expect << ")");
}

}  // namespace detail
}  // namespace gradcomp
