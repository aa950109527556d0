// TopKEncodeParams::nan_head (the reduce-scatter's device-side poison), proven on the host: the
// value the v2 kernels read, how its key orders in every pass, and the CPU backend's payload.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gradcomp/backend.h"
#include "gradcomp/format.h"
#include "test_util.h"
#include "v2/topk_v2_map.h"

namespace gradcomp {
namespace {

using namespace kernels::v2;
using testing::HostTensor;

// Residuals the NaN head meets (error feedback adds them before the key is taken).
const float kResiduals[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -3.5e-41f,
                            -1e30f,
                            std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::nanf("")};

// The kernels read the same NaN as the host path's NaN-head table holds in each dtype (fp32
// 0x7fc00000, bf16 0x7fc0, fp16 0x7e00), widened to fp32.
TEST(TopKV2NanHead, ReadsTheHostPathsNaNInEveryDtype) {
  EXPECT_EQ(kTopKNanHeadBits, 0x7FC00000u);
  EXPECT_EQ(math::float_bits(math::bf16_to_float(0x7FC0)), kTopKNanHeadBits);
  EXPECT_EQ(math::float_bits(math::half_to_float(0x7E00)), kTopKNanHeadBits);
  EXPECT_TRUE(topk_reads_nan_head(0, 1u));
  EXPECT_TRUE(topk_reads_nan_head(0, 0x80000000u));
  EXPECT_FALSE(topk_reads_nan_head(0, 0u));
  EXPECT_FALSE(topk_reads_nan_head(1, 1u));
  EXPECT_FALSE(topk_reads_nan_head(-1, 1u));
  // What the kernels read (with_nan_head): the head's NaN bits at element 0 under a set flag,
  // the loaded value everywhere else.
  EXPECT_EQ(math::float_bits(topk_element_with_nan_head(0, 1u, 2.5f)), kTopKNanHeadBits);
  EXPECT_EQ(topk_element_with_nan_head(0, 0u, 2.5f), 2.5f);
  EXPECT_EQ(topk_element_with_nan_head(1, 1u, -3.0f), -3.0f);
}

// After the residual is added the head is the canonical NaN, whose key is the largest: above
// +-Inf and every finite magnitude, in the top bin of each radix pass, chosen first by the digit
// chooser, counted "greater" against any other threshold; and element 0 is always sampled.
TEST(TopKV2NanHead, OrdersFirstInEveryPass) {
  const uint32_t inf_key = math::topk_key(std::numeric_limits<float>::infinity());
  for (float r : kResiduals) {
    const float acc = math::add_rn(math::bits_float(kTopKNanHeadBits), r);
    const uint32_t key = math::topk_key(acc);
    EXPECT_EQ(key, 0x7FFFFFFFu) << r;
    EXPECT_GT(key, inf_key) << r;
    for (int pass = 0; pass < math::kTopKPasses; ++pass) {
      const int bins = math::topk_pass_bins(pass);
      EXPECT_EQ(math::topk_digit(key, pass), static_cast<uint32_t>(bins - 1)) << "pass " << pass;
      // A pass's histogram: the NaN alone in the top bin, the other candidates below it.
      std::vector<uint32_t> hist(static_cast<size_t>(bins), 0);
      ++hist[math::topk_digit(key, pass)];
      hist[0] += 100;
      hist[static_cast<size_t>(bins / 2)] += 7;
      uint64_t above = 99;
      EXPECT_EQ(math::topk_choose_digit(hist.data(), bins, 1, &above),
                static_cast<uint32_t>(bins - 1))
          << "pass " << pass;
      EXPECT_EQ(above, 0u) << "pass " << pass;
      // Bits fixed by the earlier passes are all ones: it stays in the chosen prefix.
      const uint32_t mask = math::topk_pass_mask_above(pass);
      EXPECT_EQ(key & mask, mask) << "pass " << pass;
    }
    for (uint32_t threshold : {0u, 1u, 0x3F800000u, 0x7F7FFFFFu, inf_key, 0x7FC00000u})
      EXPECT_EQ(topk_count_pair(key, threshold), uint64_t{1} << 32) << threshold;
    EXPECT_EQ(topk_count_pair(key, key), 1u);
  }
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{4095}, int64_t{4096}, int64_t{4097},
                    int64_t{100003}, int64_t{1} << 30}) {
    EXPECT_EQ(topk_sample_index_shift(0, n), 0) << n;
    EXPECT_EQ(math::topk_sample_index(0, n, math::topk_sample_size(n)), 0) << n;
  }
}

// The CPU backend reads a set flag as the NaN-head table the host path builds (bytes of payload
// and residual equal), selects element 0 first, and ignores a clear flag.
TEST(TopKV2NanHead, CpuBackendEqualsTheHostPathsTable) {
  auto backend = make_cpu_backend();
  const int64_t numel = 3001, begin = 5, split = 1200;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (bool exact : {true, false}) {
      HostTensor x = HostTensor::from_floats(dtype, testing::normal_floats(begin + numel, 41));
      const size_t esize = dtype_size(dtype);
      // The range [begin, begin + numel) over two segments.
      const Segment plain[2] = {{x.data(), 0, split},
                                {x.bytes.data() + split * esize, split, begin + numel - split}};
      std::vector<uint8_t> nan_value(esize);
      const uint32_t nan_bits = dtype == DType::kFloat32
                                    ? kTopKNanHeadBits
                                    : (dtype == DType::kBFloat16 ? 0x7FC0u : 0x7E00u);
      std::memcpy(nan_value.data(), &nan_bits, esize);
      const Segment poisoned[3] = {{x.data(), 0, begin},
                                   {nan_value.data(), begin, 1},
                                   {x.bytes.data() + (begin + 1) * esize, begin + 1, numel - 1}};
      const std::vector<float> residual = testing::normal_floats(numel, 42, 0.1f);
      const int64_t k = 30, capacity = exact ? k : 40;
      std::vector<uint8_t> workspace(backend->topk_workspace_bytes(numel) + 1);
      auto encode = [&](const Segment* segments, int num_segments, const uint32_t* flag,
                        std::vector<float>* residual_out) {
        std::vector<uint8_t> payload(topk_payload_bytes(capacity, DType::kFloat32), 0xCD);
        residual_out->assign(static_cast<size_t>(numel), 0.0f);
        TopKEncodeParams p;
        p.segments = segments;
        p.num_segments = num_segments;
        p.dtype = static_cast<uint8_t>(dtype);
        p.begin = begin;
        p.numel = numel;
        p.residual_in = residual.data();
        p.residual_out = residual_out->data();
        p.k = k;
        p.capacity = static_cast<uint32_t>(capacity);
        p.exact = exact;
        p.payload = payload.data();
        p.workspace = workspace.data();
        p.nan_head = flag;
        backend->topk_encode(p);
        return payload;
      };
      const uint32_t set = 1, clear = 0;
      std::vector<float> r_table, r_flag, r_plain, r_clear;
      const std::vector<uint8_t> by_table = encode(poisoned, 3, nullptr, &r_table);
      const std::vector<uint8_t> by_flag = encode(plain, 2, &set, &r_flag);
      const std::vector<uint8_t> unpoisoned = encode(plain, 2, nullptr, &r_plain);
      const std::string where = std::string(dtype_name(dtype)) + (exact ? " exact" : " approx");
      EXPECT_EQ(by_flag, by_table) << where;
      EXPECT_EQ(std::memcmp(r_flag.data(), r_table.data(), r_flag.size() * 4), 0) << where;
      EXPECT_EQ(encode(plain, 2, &clear, &r_clear), unpoisoned) << where;
      EXPECT_NE(by_flag, unpoisoned) << where;
      // Element 0 of the range is the payload's first entry, its value NaN.
      const uint32_t* idx = reinterpret_cast<const uint32_t*>(by_flag.data() + kPayloadHeaderBytes);
      const format::PayloadHeader h = format::read_header(by_flag.data());
      ASSERT_GT(h.count, 0u) << where;
      EXPECT_EQ(idx[0], 0u) << where;
      float v0 = 0.0f;
      std::memcpy(&v0, by_flag.data() + format::section1_offset(h), 4);
      EXPECT_TRUE(std::isnan(v0)) << where;
    }
  }
}

}  // namespace
}  // namespace gradcomp
