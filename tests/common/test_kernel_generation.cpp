// The kernel-generation switch: GRADCOMP_KERNELS, the codec option, and what reaches the engine.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gradcomp/codec_spec.h"
#include "gradcomp/types.h"

namespace gradcomp {
namespace {

// Sets GRADCOMP_KERNELS (or unsets it for nullptr) for one scope, then restores what was there.
class ScopedKernelsEnv {
 public:
  explicit ScopedKernelsEnv(const char* value) {
    if (const char* old = std::getenv("GRADCOMP_KERNELS")) old_ = old, had_ = true;
    set(value);
  }
  ~ScopedKernelsEnv() { set(had_ ? old_.c_str() : nullptr); }

 private:
  static void set(const char* value) {
    if (value != nullptr)
      setenv("GRADCOMP_KERNELS", value, 1);
    else
      unsetenv("GRADCOMP_KERNELS");
  }
  std::string old_;
  bool had_ = false;
};

std::string resolve_error(KernelGeneration requested) {
  try {
    resolve_kernel_generation(requested);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(KernelGeneration, NamesParseBothWaysAndABadNameSaysWhere) {
  for (KernelGeneration g :
       {KernelGeneration::kDefault, KernelGeneration::kV1, KernelGeneration::kV2})
    EXPECT_EQ(parse_kernel_generation(kernel_generation_name(g), "kernels"), g);
  EXPECT_EQ(parse_kernel_generation("", "kernels"), KernelGeneration::kDefault);
  try {
    parse_kernel_generation("v3", "Q4 kernels");
    FAIL() << "v3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Q4 kernels must be 'default', 'v1' or 'v2', got 'v3'"),
              std::string::npos)
        << e.what();
  }
}

TEST(KernelGeneration, DefaultIsV1UnlessTheEnvironmentSaysV2) {
  {
    ScopedKernelsEnv env(nullptr);
    EXPECT_EQ(resolve_kernel_generation(KernelGeneration::kDefault), KernelGeneration::kV1);
  }
  {
    ScopedKernelsEnv env("v2");
    EXPECT_EQ(resolve_kernel_generation(KernelGeneration::kDefault), KernelGeneration::kV2);
    EXPECT_EQ(resolve_kernel_generation(KernelGeneration::kV1), KernelGeneration::kV1)
        << "an explicit choice wins over the environment";
  }
  {
    ScopedKernelsEnv env("v1");
    EXPECT_EQ(resolve_kernel_generation(KernelGeneration::kV2), KernelGeneration::kV2);
  }
}

TEST(KernelGeneration, ABadEnvironmentValueIsRefusedNamingTheVariable) {
  ScopedKernelsEnv env("V2 ");
  EXPECT_NE(
      resolve_error(KernelGeneration::kDefault).find("the environment variable GRADCOMP_KERNELS"),
      std::string::npos);
  EXPECT_EQ(resolve_error(KernelGeneration::kV1), "")
      << "not read when the codec names a generation";
}

TEST(KernelGeneration, TheCodecOptionReachesTheEngineConfiguration) {
  Q4 q4;
  q4.kernels = KernelGeneration::kV2;
  EXPECT_EQ(engine_options(q4).config.kernels, KernelGeneration::kV2);
  TopK topk;
  topk.kernels = KernelGeneration::kV1;
  EXPECT_EQ(engine_options(topk).config.kernels, KernelGeneration::kV1);
  EXPECT_EQ(engine_options(Q4{}).config.kernels, KernelGeneration::kDefault);
  Q2 q2;
  q2.kernels = KernelGeneration::kV2;
  EXPECT_EQ(engine_options(q2).config.kernels, KernelGeneration::kV2);
  EXPECT_EQ(engine_options(Q2{}).config.kernels, KernelGeneration::kDefault);
}

}  // namespace
}  // namespace gradcomp
