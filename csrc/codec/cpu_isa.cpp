// Which CPU loops the q4 codec runs: instruction-set detection, selection and dispatch.
#include <atomic>

#include "cpu_q4_loops.h"

namespace gradcomp {
namespace cpu {
namespace detail {

void q4_encode_chunk(const Q4EncodeChunk& chunk, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return encode_chunk_x86(chunk, isa == Isa::kAvx512);
#endif
  (void)isa;
  encode_chunk_portable(chunk);
}

bool q4_decode_chunk(const Q4DecodeChunk& chunk, Isa isa) {
#if GRADCOMP_X86
  if (isa != Isa::kPortable) return decode_chunk_x86(chunk);
#endif
  (void)isa;
  return decode_chunk_portable(chunk);
}

}  // namespace detail

namespace {
constexpr int kIsaUnset = -1;
std::atomic<int> active_isa_code{kIsaUnset};
}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return "portable";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::kPortable:
      return true;
    case Isa::kAvx2:
#if GRADCOMP_X86
      return __builtin_cpu_supports("avx2");
#else
      return false;
#endif
    case Isa::kAvx512:
#if GRADCOMP_X86
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f");
#else
      return false;
#endif
  }
  return false;
}

Isa active_isa() {
  int code = active_isa_code.load(std::memory_order_relaxed);
  if (code == kIsaUnset) {
    Isa best = Isa::kPortable;
    if (isa_supported(Isa::kAvx2)) best = Isa::kAvx2;
    if (isa_supported(Isa::kAvx512)) best = Isa::kAvx512;
    code = static_cast<int>(best);
    active_isa_code.store(code, std::memory_order_relaxed);
  }
  return static_cast<Isa>(code);
}

void set_active_isa(Isa isa) {
  GRADCOMP_CHECK(isa_supported(isa),
                 "CPU instruction set " << isa_name(isa) << " is not supported by this CPU");
  active_isa_code.store(static_cast<int>(isa), std::memory_order_relaxed);
}

}  // namespace cpu
}  // namespace gradcomp
