// The weight all-gathers' v2 CUDA kernels (int8, and 4-bit: GpuInt4AllGather) against the CPU
// backend, byte for byte: encode and decode across dtypes, uneven runs and block sizes, a NaN
// refused by name, a corrupt payload refused.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "gradcomp/all_gather.h"
#include "gradcomp/cpu.h"

namespace gradcomp {
namespace {

// Rows of several shapes: a run shorter than a block, uneven tails, several dtypes in one row,
// and the largest block size.
struct Shape {
  std::vector<Int8Run> runs;
  uint32_t block;
};

std::vector<Shape> shapes() {
  return {{{{math::kDtypeF32, 5}}, 16},
          {{{math::kDtypeF32, 1000}}, 64},
          {{{math::kDtypeF16, 4097}}, 4096},
          {{{math::kDtypeBF16, 777}}, 32},
          {{{math::kDtypeF32, 130}, {math::kDtypeBF16, 61}, {math::kDtypeF16, 200}}, 16},
          {{{math::kDtypeBF16, 100000}, {math::kDtypeF32, 33333}}, 128}};
}

// Normal values with outliers, zero blocks, tiny blocks (scales below 2^-100: the division path)
// and huge ones, as each run's dtype.
std::vector<uint8_t> row_of(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 0.02f);
  std::vector<uint8_t> bytes(int8_row_bytes(s.runs.data(), static_cast<int>(s.runs.size())));
  uint8_t* at = bytes.data();
  for (const Int8Run& r : s.runs) {
    for (int64_t i = 0; i < r.numel; ++i) {
      const int64_t blk = i / s.block;
      float v = n(rng) * (i % 97 == 5 ? 40.0f : 1.0f);
      if (blk % 7 == 3) v = 0.0f;
      if (blk % 7 == 5 && r.dtype == math::kDtypeF32) v *= 1e-35f;
      if (blk % 11 == 6 && r.dtype != math::kDtypeF16) v *= 1e30f;
      math::store_from_float(at, i, r.dtype, v);
    }
    at += r.numel * math::dtype_bytes(r.dtype);
  }
  return bytes;
}

struct Encoded {
  std::vector<uint8_t> payload;
  uint64_t nonfinite_at = 0;
};

// `shift`: bytes between the device allocation (256-byte aligned) and the row on the GPU;
// `int4`: the 4-bit codec (GCW4) instead of int8.
Encoded encode_with(Backend& backend, const Shape& s, const std::vector<uint8_t>& row,
                    size_t shift = 0, bool int4 = false) {
  const int nr = static_cast<int>(s.runs.size());
  const uint64_t slot = int4 ? int4_row_payload_bytes(s.runs.data(), nr, s.block)
                             : int8_row_payload_bytes(s.runs.data(), nr, s.block);
  Encoded out;
  out.payload.assign(slot, 0);
  Int8EncodeParams e;
  e.runs = s.runs.data();
  e.num_runs = nr;
  e.block_size = s.block;
  e.payload_bytes = slot;
  if (!backend.is_cuda()) {
    e.input = row.data();
    e.payload = out.payload.data();
    e.nonfinite_at = &out.nonfinite_at;
    int4 ? backend.int4_encode(e) : backend.int8_encode(e);
    return out;
  }
  DeviceBuffer in(row.size() + shift), payload(slot), mark(8);
  GRADCOMP_CUDA_CHECK(cudaMemcpy(in.get() + shift, row.data(), row.size(), cudaMemcpyHostToDevice));
  GRADCOMP_CUDA_CHECK(cudaMemset(payload.get(), 0xAB, slot));  // stale bytes must not survive
  GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
  e.input = in.get() + shift;
  e.payload = payload.get();
  e.nonfinite_at = reinterpret_cast<uint64_t*>(mark.get());
  int4 ? backend.int4_encode(e) : backend.int8_encode(e);
  out.payload = payload.host();
  const std::vector<uint8_t> m = mark.host();
  std::memcpy(&out.nonfinite_at, m.data(), 8);
  return out;
}

// Decodes `payloads` on the GPU into rows `shift` bytes into a device allocation, with 64 guard
// bytes behind them; returns the verdicts and the output with its guard (and `shift` bytes before
// it, which must stay untouched too).
std::vector<int32_t> decode_on_gpu(Backend& gpu, const Shape& s,
                                   const std::vector<std::vector<uint8_t>>& payloads,
                                   std::vector<uint8_t>* output, size_t shift = 0,
                                   bool int4 = false) {
  const int nr = static_cast<int>(s.runs.size()), w = static_cast<int>(payloads.size());
  const uint64_t slot = payloads[0].size(), row = int8_row_bytes(s.runs.data(), nr);
  std::vector<uint8_t> all;
  for (const auto& p : payloads) all.insert(all.end(), p.begin(), p.end());
  DeviceBuffer recv(all.data(), all.size()), out(shift + row * w + 64), verdicts(4 * (w + 1));
  GRADCOMP_CUDA_CHECK(cudaMemset(out.get(), 0x5A, shift + row * w + 64));
  GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<const uint8_t*> ptrs(w);
  for (int i = 0; i < w; ++i) ptrs[i] = recv.get() + slot * i;
  Int8DecodeParams d;
  d.payloads = ptrs.data();
  d.num_payloads = w;
  d.payload_bytes = slot;
  d.runs = s.runs.data();
  d.num_runs = nr;
  d.block_size = s.block;
  d.output = out.get() + shift;
  d.output_bytes = row * w;
  d.verdicts = reinterpret_cast<int32_t*>(verdicts.get());
  int4 ? gpu.int4_decode(d) : gpu.int8_decode(d);
  const std::vector<uint8_t> all_out = out.host();
  for (size_t i = 0; i < shift; ++i) EXPECT_EQ(all_out[i], 0x5A) << "wrote before the rows";
  output->assign(all_out.begin() + static_cast<std::ptrdiff_t>(shift), all_out.end());
  std::vector<int32_t> v(w + 1);
  const std::vector<uint8_t> vb = verdicts.host();
  std::memcpy(v.data(), vb.data(), vb.size());
  return v;
}

TEST(GpuInt8AllGather, EncodeEqualsTheCpuByteForByte) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  uint32_t seed = 1;
  for (const Shape& s : shapes()) {
    const std::vector<uint8_t> row = row_of(s, seed++);
    const Encoded want = encode_with(*cpu, s, row), got = encode_with(*gpu, s, row);
    EXPECT_EQ(want.nonfinite_at, 0u);
    EXPECT_EQ(got.nonfinite_at, 0u);
    EXPECT_TRUE(got.payload == want.payload)
        << "block " << s.block << ": " << first_difference(got.payload, want.payload);
  }
}

TEST(GpuInt8AllGather, DecodeEqualsTheCpuAndWritesNothingOutsideItsRows) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  uint32_t seed = 50;
  for (const Shape& s : shapes()) {
    const int nr = static_cast<int>(s.runs.size());
    const uint64_t row = int8_row_bytes(s.runs.data(), nr);
    std::vector<std::vector<uint8_t>> payloads;
    std::vector<uint8_t> want;
    for (int w = 0; w < 3; ++w) {
      payloads.push_back(encode_with(*cpu, s, row_of(s, seed++)).payload);
      std::vector<uint8_t> one(row);
      ASSERT_EQ(cpu::int8_row_verdict(payloads.back().data(), s.runs.data(), nr, s.block), kInt8Ok);
      cpu::int8_decode_row(payloads.back().data(), s.runs.data(), nr, s.block, one.data());
      want.insert(want.end(), one.begin(), one.end());
    }
    std::vector<uint8_t> got;
    const std::vector<int32_t> v = decode_on_gpu(*gpu, s, payloads, &got);
    EXPECT_EQ(v, std::vector<int32_t>({0, 0, 0, 0}));
    const std::vector<uint8_t> rows(got.begin(), got.begin() + row * 3);
    EXPECT_TRUE(rows == want) << "block " << s.block << ": " << first_difference(rows, want);
    for (size_t i = row * 3; i < got.size(); ++i) ASSERT_EQ(got[i], 0x5A) << "guard byte " << i;
  }
}

// Runs whose elements and codes start 16-byte aligned (and rows that keep the next row so) take
// the 16-byte loads and stores; a row shifted by 4 bytes (naturally aligned, not to 16) takes the
// element-by-element kernels. Both give the CPU's bytes, in every dtype, with partial chunks.
TEST(GpuInt8AllGather, AlignedAndUnalignedLayoutsBothEqualTheCpu) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  const std::vector<Shape> split = {{{{math::kDtypeF32, 1004}}, 256},
                                    {{{math::kDtypeBF16, 2048}}, 64},
                                    {{{math::kDtypeF16, 1040}}, 16},
                                    {{{math::kDtypeF32, 3 * 4096 + 16}}, 4096},
                                    {{{math::kDtypeF32, 64}, {math::kDtypeBF16, 520}}, 32}};
  uint32_t seed = 300;
  for (const Shape& s : split) {
    const int nr = static_cast<int>(s.runs.size());
    const uint64_t row = int8_row_bytes(s.runs.data(), nr);
    ASSERT_EQ(row % 16, 0u) << "each shape keeps rows side by side aligned";
    for (size_t shift : {size_t{0}, size_t{4}}) {
      SCOPED_TRACE(::testing::Message() << "block " << s.block << " shift " << shift);
      const std::vector<uint8_t> input = row_of(s, seed++);
      const Encoded want = encode_with(*cpu, s, input), got = encode_with(*gpu, s, input, shift);
      EXPECT_EQ(got.nonfinite_at, 0u);
      EXPECT_TRUE(got.payload == want.payload) << first_difference(got.payload, want.payload);
      std::vector<std::vector<uint8_t>> payloads;
      std::vector<uint8_t> rows_want;
      for (int w = 0; w < 3; ++w) {
        payloads.push_back(encode_with(*cpu, s, row_of(s, seed++)).payload);
        std::vector<uint8_t> one(row);
        cpu::int8_decode_row(payloads.back().data(), s.runs.data(), nr, s.block, one.data());
        rows_want.insert(rows_want.end(), one.begin(), one.end());
      }
      std::vector<uint8_t> out;
      EXPECT_EQ(decode_on_gpu(*gpu, s, payloads, &out, shift), std::vector<int32_t>(4, 0));
      const std::vector<uint8_t> rows(out.begin(), out.begin() + row * 3);
      EXPECT_TRUE(rows == rows_want) << first_difference(rows, rows_want);
      for (size_t i = row * 3; i < out.size(); ++i) ASSERT_EQ(out[i], 0x5A) << "guard byte " << i;
    }
  }
}

TEST(GpuInt8AllGather, NonFiniteRowsAreFlaggedAsOnTheCpuAndNeverDecoded) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  const Shape s = shapes()[4];
  std::vector<uint8_t> row = row_of(s, 7);
  const float nan = NAN;
  std::memcpy(row.data() + 4 * 77, &nan, 4);  // element 77 of the fp32 run
  const Encoded want = encode_with(*cpu, s, row), got = encode_with(*gpu, s, row);
  EXPECT_EQ(want.nonfinite_at, 78u);
  EXPECT_EQ(got.nonfinite_at, 78u);
  EXPECT_TRUE(got.payload == want.payload) << first_difference(got.payload, want.payload);
  const Encoded good = encode_with(*cpu, s, row_of(s, 8));
  std::vector<uint8_t> out;
  const std::vector<int32_t> v = decode_on_gpu(*gpu, s, {good.payload, got.payload}, &out);
  EXPECT_EQ(v, std::vector<int32_t>({kInt8Ok, kInt8Nonfinite, 1}));
  for (uint8_t b : out) ASSERT_EQ(b, 0x5A);
}

TEST(GpuInt8AllGather, CorruptPayloadsGetTheCpuVerdictAndNothingIsWritten) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  const Shape s = shapes()[1];
  const Encoded good = encode_with(*cpu, s, row_of(s, 9));
  for (size_t at : {size_t{0}, size_t{4}, size_t{7}, size_t{8}, size_t{16}, size_t{40},
                    good.payload.size() - 20}) {
    std::vector<uint8_t> bad = good.payload;
    bad[at] ^= 0x10;
    const int32_t want = cpu::int8_row_verdict(bad.data(), s.runs.data(), 1, s.block);
    ASSERT_NE(want, kInt8Ok);
    std::vector<uint8_t> out;
    const std::vector<int32_t> v = decode_on_gpu(*gpu, s, {good.payload, good.payload, bad}, &out);
    EXPECT_EQ(v, std::vector<int32_t>({kInt8Ok, kInt8Ok, want, 1})) << "byte " << at;
    for (uint8_t b : out) ASSERT_EQ(b, 0x5A);
  }
}

// One rank whose all-gather copies device memory to itself; the chosen call flips a byte.
class DeviceLoopback final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  bool device_memory() const override { return true; }
  int corrupt_call = -1;

 protected:
  void run_all_to_all(const void* send, void* recv, size_t bytes) override {
    run_all_gather(send, recv, bytes);
  }
  // The backend's stream is non-blocking: the device is synchronized around the copies.
  void run_all_gather(const void* send, void* recv, size_t bytes) override {
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(recv, send, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    if (calls_++ == corrupt_call) {
      uint8_t b = 0;
      uint8_t* at = static_cast<uint8_t*>(recv) + bytes - 20;  // inside the codes
      ASSERT_EQ(cudaMemcpy(&b, at, 1, cudaMemcpyDeviceToHost), cudaSuccess);
      b ^= 0x10;
      ASSERT_EQ(cudaMemcpy(at, &b, 1, cudaMemcpyHostToDevice), cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  void run_allreduce_mean(void*, int64_t, DType) override {}
  void run_reduce_scatter_mean(const void*, void*, int64_t, DType) override {}

 private:
  int calls_ = 0;
};

// Through CompressedAllGather on the v2 backend: the output equals the CPU's decode; a NaN and a
// corrupt payload are refused naming the bucket and the rank, the output untouched; under v1 the
// collective is refused naming GRADCOMP_KERNELS=v2.
TEST(GpuInt8AllGather, TheCollectiveRefusesNaNAndCorruptionByNameAndV1ByTheSwitch) {
  SKIP_WITHOUT_GPU();
  const Shape s = shapes()[1];
  const AllGatherRun run{DType::kFloat32, s.runs[0].numel};
  std::vector<uint8_t> row = row_of(s, 11);
  const uint64_t bytes = row.size();
  for (int c = 0; c < 3; ++c) {  // 0: clean, 1: a NaN, 2: a corrupt payload
    DeviceLoopback comm;
    comm.corrupt_call = c == 2 ? 1 : -1;  // call 0 is the layout exchange
    auto gpu = backend_of(KernelGeneration::kV2);
    CompressedAllGather ag(comm, *gpu, AllGatherOptions{});
    std::vector<uint8_t> in = row;
    if (c == 1) {
      const float nan = NAN;
      std::memcpy(in.data() + 4 * 500, &nan, 4);
    }
    DeviceBuffer input(in.data(), bytes), output(bytes);
    GRADCOMP_CUDA_CHECK(cudaMemset(output.get(), 0x5A, bytes));
    GRADCOMP_CUDA_CHECK(cudaDeviceSynchronize());
    AllGatherRequest r;
    r.input = input.get();
    r.output = output.get();
    r.runs = &run;
    r.num_runs = 1;
    r.bucket_id = 3;
    r.name = "layers.0";
    std::string error;
    try {
      ag.all_gather(r);
    } catch (const Error& e) {
      error = e.what();
    }
    const std::vector<uint8_t> got = output.host();
    if (c == 0) {
      EXPECT_EQ(error, "");
      std::vector<uint8_t> payload(int8_payload_bytes(&run, 1, 64)), want(bytes);
      ASSERT_TRUE(int8_encode_row(row.data(), &run, 1, 64, payload.data()));
      int8_decode_row(payload.data(), &run, 1, 64, want.data());
      EXPECT_TRUE(got == want) << first_difference(got, want);
      continue;
    }
    EXPECT_NE(error.find("layers.0 (bucket 3)"), std::string::npos) << error;
    EXPECT_NE(error.find(c == 1 ? "rank(s) 0 hold NaN or infinity" : "payload from rank 0 fails"),
              std::string::npos)
        << error;
    if (c == 1) EXPECT_NE(error.find("element 500 of run 0"), std::string::npos) << error;
    for (uint8_t b : got) ASSERT_EQ(b, 0x5A);
  }
  DeviceLoopback comm;
  auto v1 = backend_of(KernelGeneration::kV1);
  try {
    CompressedAllGather ag(comm, *v1, AllGatherOptions{});
    FAIL() << "v1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GRADCOMP_KERNELS=v2"), std::string::npos) << e.what();
  }
}

// ---- The 4-bit codec (GCW4): the same kernels' shape, two codes per byte -------------------

// Every shape above plus runs at odd row offsets (a code byte shared by two runs and, inside a
// run, by two blocks) and aligned ones; rows at 16-byte aligned and 4-byte shifted addresses
// (the fused 16-byte kernels and the scales-then-bytes ones): encode and decode equal the CPU.
TEST(GpuInt4AllGather, EncodeAndDecodeEqualTheCpuInEveryLayout) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  std::vector<Shape> all = shapes();
  all.push_back({{{math::kDtypeF32, 17}, {math::kDtypeBF16, 16}, {math::kDtypeF16, 33}}, 16});
  all.push_back({{{math::kDtypeF32, 3 * 4096 + 16}}, 4096});
  all.push_back({{{math::kDtypeF32, 64}, {math::kDtypeBF16, 520}}, 32});
  uint32_t seed = 700;
  for (const Shape& s : all) {
    const int nr = static_cast<int>(s.runs.size());
    const uint64_t row = int8_row_bytes(s.runs.data(), nr);
    for (size_t shift : {size_t{0}, size_t{4}}) {
      SCOPED_TRACE(::testing::Message()
                   << "block " << s.block << " runs " << nr << " shift " << shift);
      const std::vector<uint8_t> input = row_of(s, seed++);
      const Encoded want = encode_with(*cpu, s, input, 0, true);
      const Encoded got = encode_with(*gpu, s, input, shift, true);
      EXPECT_EQ(got.nonfinite_at, 0u);
      EXPECT_TRUE(got.payload == want.payload) << first_difference(got.payload, want.payload);
      std::vector<std::vector<uint8_t>> payloads;
      std::vector<uint8_t> rows_want;
      for (int w = 0; w < 3; ++w) {
        payloads.push_back(encode_with(*cpu, s, row_of(s, seed++), 0, true).payload);
        std::vector<uint8_t> one(row);
        cpu::int4_decode_row(payloads.back().data(), s.runs.data(), nr, s.block, one.data());
        rows_want.insert(rows_want.end(), one.begin(), one.end());
      }
      std::vector<uint8_t> out;
      EXPECT_EQ(decode_on_gpu(*gpu, s, payloads, &out, shift, true), std::vector<int32_t>(4, 0));
      const std::vector<uint8_t> rows(out.begin(), out.begin() + row * 3);
      EXPECT_TRUE(rows == rows_want) << first_difference(rows, rows_want);
      for (size_t i = row * 3; i < out.size(); ++i) ASSERT_EQ(out[i], 0x5A) << "guard byte " << i;
    }
  }
}

TEST(GpuInt4AllGather, NonFiniteAndCorruptRowsGetTheCpuVerdictAndNothingIsWritten) {
  SKIP_WITHOUT_GPU();
  auto cpu = make_cpu_backend();
  auto gpu = backend_of(KernelGeneration::kV2);
  const Shape s = shapes()[4];
  const int nr = static_cast<int>(s.runs.size());
  std::vector<uint8_t> row = row_of(s, 17);
  const float nan = NAN;
  std::memcpy(row.data() + 4 * 77, &nan, 4);  // element 77 of the fp32 run
  const Encoded want = encode_with(*cpu, s, row, 0, true), got = encode_with(*gpu, s, row, 0, true);
  EXPECT_EQ(want.nonfinite_at, 78u);
  EXPECT_EQ(got.nonfinite_at, 78u);
  EXPECT_TRUE(got.payload == want.payload) << first_difference(got.payload, want.payload);
  const Encoded good = encode_with(*cpu, s, row_of(s, 18), 0, true);
  std::vector<uint8_t> out;
  EXPECT_EQ(decode_on_gpu(*gpu, s, {good.payload, got.payload}, &out, 0, true),
            std::vector<int32_t>({kInt8Ok, kInt8Nonfinite, 1}));
  for (uint8_t b : out) ASSERT_EQ(b, 0x5A);
  for (size_t at : {size_t{0}, size_t{4}, size_t{16}, size_t{40}, good.payload.size() - 20}) {
    std::vector<uint8_t> bad = good.payload;
    bad[at] ^= 0x10;
    const int32_t verdict = cpu::int4_row_verdict(bad.data(), s.runs.data(), nr, s.block);
    ASSERT_NE(verdict, kInt8Ok);
    EXPECT_EQ(decode_on_gpu(*gpu, s, {good.payload, bad}, &out, 0, true),
              std::vector<int32_t>({kInt8Ok, verdict, 1}))
        << "byte " << at;
    for (uint8_t b : out) ASSERT_EQ(b, 0x5A);
  }
  // An int8 payload is not a 4-bit one.
  const Encoded int8 = encode_with(*cpu, s, row_of(s, 18));
  std::vector<uint8_t> foreign = int8.payload;
  foreign.resize(good.payload.size());
  EXPECT_EQ(decode_on_gpu(*gpu, s, {foreign}, &out, 0, true),
            std::vector<int32_t>({kInt8BadMagic, 1}));
}

// CompressedAllGather with the 4-bit codec on the v2 backend decodes as the CPU does; v1 refuses
// it naming GRADCOMP_KERNELS=v2.
TEST(GpuInt4AllGather, TheCollectiveRunsOnV2AndV1IsRefusedByTheSwitch) {
  SKIP_WITHOUT_GPU();
  const Shape s = shapes()[1];
  const AllGatherRun run{DType::kFloat32, s.runs[0].numel};
  const std::vector<uint8_t> row = row_of(s, 19);
  AllGatherOptions o;
  o.codec = WeightCodec::kInt4;
  {
    DeviceLoopback comm;
    auto gpu = backend_of(KernelGeneration::kV2);
    CompressedAllGather ag(comm, *gpu, o);
    DeviceBuffer input(row.data(), row.size()), output(row.size());
    AllGatherRequest r;
    r.input = input.get();
    r.output = output.get();
    r.runs = &run;
    r.num_runs = 1;
    r.name = "layers.0";
    ag.all_gather(r);
    std::vector<uint8_t> payload(int4_row_payload_bytes(s.runs.data(), 1, 64)), want(row.size());
    ASSERT_EQ(cpu::int4_encode_row(row.data(), s.runs.data(), 1, 64, payload.data()), 0u);
    cpu::int4_decode_row(payload.data(), s.runs.data(), 1, 64, want.data());
    const std::vector<uint8_t> got = output.host();
    EXPECT_TRUE(got == want) << first_difference(got, want);
  }
  DeviceLoopback comm;
  auto v1 = backend_of(KernelGeneration::kV1);
  try {
    CompressedAllGather ag(comm, *v1, o);
    FAIL() << "v1 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GRADCOMP_KERNELS=v2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gradcomp
