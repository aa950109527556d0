// Writes valid q4, q2 and top-k decoder inputs as a seed corpus for gradcomp_fuzz_decode.
#include <cstdio>
#include <string>
#include <vector>

#include "gradcomp/cpu.h"
#include "gradcomp/format.h"

using namespace gradcomp;

static void write(const std::string& path, const std::vector<uint8_t>& control,
                  const std::vector<uint8_t>& payload) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return;
  std::fwrite(control.data(), 1, control.size(), f);
  std::fwrite(payload.data(), 1, payload.size(), f);
  std::fclose(f);
}

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : ".";
  for (int sel = 0; sel < 8; ++sel) {
    const int64_t numel = 1 + sel * 7;
    std::vector<float> x(numel);
    for (int64_t i = 0; i < numel; ++i) x[i] = static_cast<float>((i * 37 % 11) - 5) * 0.3f;
    Segment seg{x.data(), 0, numel};
    std::vector<uint8_t> q(q4_payload_bytes(numel, 16));
    Q4EncodeParams e;
    e.segments = &seg;
    e.num_segments = 1;
    e.numel = numel;
    e.block_size = 16;
    e.payload = q.data();
    cpu::q4_encode(e);
    // Control bytes: even first byte (q4), one payload, size selector, dtype; block 16 = data[2] %
    // 5 == 0.
    write(dir + "/q4_" + std::to_string(sel), {0, 0, static_cast<uint8_t>(sel), 0}, q);
    // q2 (first byte 2), stochastic, in one payload and (sel odd) as two equal ones.
    std::vector<uint8_t> q2(q2_payload_bytes(numel, 16));
    e.codec = format::kCodecQ2;
    e.payload = q2.data();
    cpu::q2_encode(e);
    if (sel % 2 == 1) q2.insert(q2.end(), q2.begin(), q2.end());
    write(dir + "/q2_" + std::to_string(sel),
          {2, static_cast<uint8_t>(sel % 2), static_cast<uint8_t>(sel), 0}, q2);
    e.codec = format::kCodecQ4;
    const uint8_t cap_sel =
        static_cast<uint8_t>(1 | ((sel % numel) << 1));  // odd: top-k, value f32
    const int64_t cap = 1 + cap_sel % numel;
    std::vector<uint8_t> t(topk_payload_bytes(cap, DType::kFloat32));
    TopKEncodeParams te;
    te.segments = &seg;
    te.num_segments = 1;
    te.numel = numel;
    te.k = cap;
    te.capacity = static_cast<uint32_t>(cap);
    te.value_dtype = (cap_sel >> 1) % 3;
    t.resize(topk_payload_bytes(cap, static_cast<DType>(te.value_dtype)));
    te.payload = t.data();
    cpu::topk_encode(te);
    write(dir + "/topk_" + std::to_string(sel), {cap_sel, 0, static_cast<uint8_t>(sel), 1}, t);
  }
  return 0;
}
