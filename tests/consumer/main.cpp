// Consumer check: encode and decode a gradient through the installed library.
#include <cmath>
#include <cstdio>
#include <vector>

#include <gradcomp/gradcomp.h>

int main() {
  std::vector<float> grad(1000), out(1000);
  for (int i = 0; i < 1000; ++i) grad[i] = std::sin(0.01f * i);
  std::vector<uint8_t> payload(gradcomp::q4_payload_bytes(1000, 64));
  gradcomp::Segment in{grad.data(), 0, 1000}, dst{out.data(), 0, 1000};
  gradcomp::Q4EncodeParams e;
  e.segments = &in;
  e.num_segments = 1;
  e.numel = 1000;
  e.payload = payload.data();
  gradcomp::cpu::q4_encode(e);
  const uint8_t* p = payload.data();
  gradcomp::Q4DecodeParams d;
  d.payloads = &p;
  d.num_payloads = 1;
  d.payload_bytes = payload.size();
  d.numel = 1000;
  d.segments = &dst;
  d.num_segments = 1;
  gradcomp::cpu::q4_decode(d);
  double err = 0;
  for (int i = 0; i < 1000; ++i) err = std::fmax(err, std::fabs(out[i] - grad[i]));
  std::printf("gradcomp consumer: %zu-byte payload for 4000 bytes, max error %.4f\n", payload.size(), err);
  return err < 1.0 / 7 ? 0 : 1;
}
