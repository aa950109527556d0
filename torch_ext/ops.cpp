// torch.ops.gradcomp.*: standalone compress / decompress of one tensor (CPU and CUDA).
#include <torch/library.h>

#include <cstring>
#include <string>

#include "tensor_params.h"

namespace gradcomp {
namespace torch_ext {
namespace {

// One q4 or q2 payload of x (codec format::kCodecQ4 or kCodecQ2; `op` names it in errors).
at::Tensor block_compress(uint8_t codec, const char* op, const at::Tensor& x_in, int64_t block_size,
                          bool stochastic, int64_t seed, int64_t step) {
  const std::string input = std::string(op) + " input";
  check_gradient_tensor(x_in, input.c_str());
  at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const uint64_t bytes = call_core([&] {
    const int block = static_cast<int>(block_size);
    return codec == format::kCodecQ2 ? q2_payload_bytes(n, block) : q4_payload_bytes(n, block);
  });
  at::Tensor payload = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  Segment seg = whole_segment(x);
  Q4EncodeParams p;
  p.codec = codec;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = static_cast<uint8_t>(to_dtype(x.scalar_type(), input.c_str()));
  p.numel = n;
  p.block_size = static_cast<uint32_t>(block_size);
  p.stochastic = stochastic;
  p.rng.seed = static_cast<uint64_t>(seed);
  p.rng.step = static_cast<uint32_t>(step);
  p.payload = payload.data_ptr<uint8_t>();
  call_core([&] { backend_for(x).q4_encode(p); });
  return payload;
}

at::Tensor q4_compress(const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed,
                       int64_t step) {
  return block_compress(format::kCodecQ4, "q4_compress", x, block_size, stochastic, seed, step);
}

// On CUDA only under the v2 kernels (the backend refuses q2 by name under v1).
at::Tensor q2_compress(const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed,
                       int64_t step) {
  return block_compress(format::kCodecQ2, "q2_compress", x, block_size, stochastic, seed, step);
}

at::Tensor topk_compress(const at::Tensor& x_in, double ratio, bool exact,
                         at::ScalarType value_dtype) {
  check_gradient_tensor(x_in, "topk_compress input");
  at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  TopKOptions o;
  o.ratio = ratio;
  o.exact = exact;
  o.value_dtype = to_dtype(value_dtype, "topk_compress value_dtype");
  call_core([&] { o.validate(); });
  GRADCOMP_TORCH_CHECK(n <= kTopKMaxNumel, "topk_compress input has ", n,
                       " elements; top-k allows at most 2^31 - 1 (32-bit indices)");
  const int64_t k = topk_k(n, ratio), cap = topk_capacity(n, o);
  const uint64_t bytes = call_core([&] { return topk_payload_bytes(cap, o.value_dtype); });
  at::Tensor payload = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  Backend& backend = backend_for(x);
  at::Tensor workspace = at::empty({static_cast<int64_t>(backend.topk_workspace_bytes(n)) + 16},
                                   x.options().dtype(at::kByte));
  Segment seg = whole_segment(x);
  TopKEncodeParams p;
  p.segments = &seg;
  p.num_segments = 1;
  p.dtype = static_cast<uint8_t>(to_dtype(x.scalar_type(), "topk_compress input"));
  p.numel = n;
  p.k = k;
  p.capacity = static_cast<uint32_t>(cap);
  p.exact = exact;
  p.value_dtype = static_cast<uint8_t>(o.value_dtype);
  p.payload = payload.data_ptr<uint8_t>();
  p.workspace = workspace.data_ptr();
  call_core([&] { backend.topk_encode(p); });
  return payload;
}

at::Tensor decompress(const at::Tensor& payload_in) {
  GRADCOMP_TORCH_CHECK(payload_in.scalar_type() == at::kByte && payload_in.dim() == 1,
                       "decompress expects a 1-D uint8 payload tensor, got ",
                       payload_in.scalar_type(), " with ", payload_in.dim(), " dimensions");
  at::Tensor payload = payload_in.contiguous();
  const uint64_t size = static_cast<uint64_t>(payload.numel());
  GRADCOMP_TORCH_CHECK(size >= kPayloadHeaderBytes, "decompress: payload of ", size,
                       " bytes is shorter than the 64-byte header");
  // The header is read on the host (the core's checks, with the payload's real size); the
  // decoders validate the sections again before writing.
  at::Tensor head = payload.slice(0, 0, kPayloadHeaderBytes).cpu();
  const PayloadInfo info =
      call_core([&] { return inspect_payload(head.data_ptr<uint8_t>(), size); });
  const int64_t n = info.numel;
  at::Tensor out = at::empty({n}, payload.options().dtype(to_scalar_type(info.dtype)));
  Segment seg = whole_segment(out);
  const uint8_t* ptr = payload.data_ptr<uint8_t>();
  Backend& backend = backend_for(payload);
  if (info.codec == Codec::kQ4 || info.codec == Codec::kQ2) {
    Q4DecodeParams d;
    d.codec = static_cast<uint8_t>(info.codec);
    d.payloads = &ptr;
    d.num_payloads = 1;
    d.payload_bytes = size;
    d.numel = n;
    d.block_size = info.param;
    d.segments = &seg;
    d.num_segments = 1;
    d.dtype = static_cast<uint8_t>(info.dtype);
    call_core([&] {
      backend.q4_decode(d);
      backend.take_decode_status();
    });
  } else {
    at::Tensor workspace =
        at::empty({std::max<int64_t>(16, static_cast<int64_t>(backend.topk_workspace_bytes(n)))},
                  payload.options().dtype(at::kByte));
    TopKDecodeParams d;
    d.payloads = &ptr;
    d.num_payloads = 1;
    d.payload_bytes = size;
    d.numel = n;
    d.capacity = info.param;
    d.value_dtype = static_cast<uint8_t>(info.value_dtype);
    d.segments = &seg;
    d.num_segments = 1;
    d.dtype = static_cast<uint8_t>(info.dtype);
    d.workspace = workspace.data_ptr();
    call_core([&] {
      backend.topk_decode(d);
      backend.take_decode_status();
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(gradcomp, m) {
  m.def("q4_compress(Tensor x, int block_size, bool stochastic, int seed, int step) -> Tensor");
  m.def("q2_compress(Tensor x, int block_size, bool stochastic, int seed, int step) -> Tensor");
  m.def("topk_compress(Tensor x, float ratio, bool exact, ScalarType value_dtype) -> Tensor");
  m.def("decompress(Tensor payload) -> Tensor");
}

TORCH_LIBRARY_IMPL(gradcomp, CPU, m) {
  m.impl("q4_compress", &q4_compress);
  m.impl("q2_compress", &q2_compress);
  m.impl("topk_compress", &topk_compress);
  m.impl("decompress", &decompress);
}

#if defined(GRADCOMP_HAVE_CUDA)
TORCH_LIBRARY_IMPL(gradcomp, CUDA, m) {
  m.impl("q4_compress", &q4_compress);
  m.impl("q2_compress", &q2_compress);
  m.impl("topk_compress", &topk_compress);
  m.impl("decompress", &decompress);
}
#endif

}  // namespace torch_ext
}  // namespace gradcomp
