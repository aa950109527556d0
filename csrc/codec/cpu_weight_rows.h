// Decoding an all-gather's rows on the host, for either weight codec (GCW8, GCW4).
#pragma once

#include <cstdint>

#include "gradcomp/types.h"
#include "int8_params.h"

namespace gradcomp {
namespace cpu {

// Every payload's verdict first (verdicts[num_payloads] = whether any failed), and rows are
// written only when all pass, so a rejection leaves the whole output untouched.
template <class RowVerdict, class DecodeRow>
void decode_checked_rows(const Int8DecodeParams& p, const char* what, RowVerdict row_verdict,
                         DecodeRow decode_row) {
  for (int w = 0; w < p.num_payloads; ++w)
    GRADCOMP_CHECK(p.payloads[w] != nullptr, what << ": payload " << w << " is null");
  int32_t any = 0;
  for (int w = 0; w < p.num_payloads; ++w) {
    p.verdicts[w] = row_verdict(p.payloads[w], p.runs, p.num_runs, p.block_size);
    any |= p.verdicts[w] != kInt8Ok ? 1 : 0;
  }
  p.verdicts[p.num_payloads] = any;
  if (any != 0) return;
  const uint64_t row = int8_row_bytes(p.runs, p.num_runs);
  for (int w = 0; w < p.num_payloads; ++w)
    decode_row(p.payloads[w], p.runs, p.num_runs, p.block_size,
               static_cast<uint8_t*>(p.output) + row * static_cast<uint64_t>(w));
}

}  // namespace cpu
}  // namespace gradcomp
