// libFuzzer target: q4, q2 and top-k decoders and header inspection on arbitrary bytes.
#include <cstring>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/format.h"

using namespace gradcomp;

// Input: 4 control bytes (codec and top-k capacity: bit 0 top-k, else bit 1 q2, else q4; payload
// count and q4 / q2 block; size; output
// dtype and whether to redo the checksums), then payload bytes
// shared out between the payloads. Decoders must either throw gradcomp::Error or write within
// their output; AddressSanitizer reports anything else.
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const bool q4 = (data[0] & 1) == 0;
  const bool q2 = q4 && (data[0] & 2) != 0;
  const int payloads = 1 + data[1] % 3;
  const int64_t numel = 1 + (data[2] % 64) * 7;
  const uint8_t dtype = data[3] % 3;
  // Half the inputs get their checksums redone, so the checks behind them are fuzzed too.
  const bool reseal = (data[3] & 0x80) != 0;
  data += 4;
  size -= 4;
  try {
    (void)inspect_payload(data, size);
  } catch (const Error&) {
  }
  const size_t each = size / payloads;
  std::vector<std::vector<uint8_t>> copies;
  std::vector<const uint8_t*> ptrs;
  for (int w = 0; w < payloads; ++w) {
    copies.emplace_back(data + w * each, data + (w + 1) * each);  // exact-size heap buffers
    std::vector<uint8_t>& c = copies.back();
    if (reseal && c.size() >= kPayloadHeaderBytes) {
      const format::PayloadHeader h = format::read_header(c.data());
      const uint64_t total = format::payload_bytes_of(h);
      if (total >= kPayloadHeaderBytes && total <= c.size() && total % 4 == 0) {
        const format::PayloadHeader sealed =
            format::with_body_checksum(h, format::body_checksum(c.data(), total));
        std::memcpy(c.data(), &sealed, sizeof sealed);
      }
    }
    ptrs.push_back(c.data());
  }
  std::vector<uint8_t> out(static_cast<size_t>(numel) * (dtype == 0 ? 4 : 2));
  Segment seg{out.data(), 0, numel};
  try {
    if (q4) {
      Q4DecodeParams d;
      d.codec = q2 ? format::kCodecQ2 : format::kCodecQ4;
      d.payloads = ptrs.data();
      d.num_payloads = payloads;
      d.payload_bytes = each;
      d.numel = numel;
      d.block_size = 16u << ((data[-3] >> 2) % 5);
      d.segments = &seg;
      d.num_segments = 1;
      d.dtype = dtype;
      d.divisor = static_cast<float>(payloads);
      if (q2) {
        cpu::q2_decode(d);
      } else {
        cpu::q4_decode(d);
      }
    } else {
      TopKDecodeParams d;
      d.payloads = ptrs.data();
      d.num_payloads = payloads;
      d.payload_bytes = each;
      d.numel = numel;
      d.capacity = static_cast<uint32_t>(1 + data[-4] % numel);
      d.value_dtype = (data[-4] >> 1) % 3;
      d.segments = &seg;
      d.num_segments = 1;
      d.dtype = dtype;
      d.divisor = static_cast<float>(payloads);
      cpu::topk_decode(d);
    }
  } catch (const Error&) {
  }
  return 0;
}
