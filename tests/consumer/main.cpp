// Consumer check: the README's C++ usage, built against the installed package.
#include <gradcomp/gradcomp.h>
#if defined(GRADCOMP_HAVE_NCCL)
#include <gradcomp/nccl_communicator.h>  // the raw-NCCL transport is usable from the installed package too
#endif

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const int64_t n_a = 1000, n_b = 333;
  std::vector<float> a(n_a), b(n_b);
  for (int64_t i = 0; i < n_a; ++i) a[i] = std::sin(0.01f * i);
  for (int64_t i = 0; i < n_b; ++i) b[i] = std::cos(0.02f * i);
  const std::vector<float> a0 = a;
  float* grad_a = a.data();
  float* grad_b = b.data();

  gradcomp::InProcessGroup group(1);
  auto backend = gradcomp::make_cpu_backend();
  gradcomp::CompressionConfig config;
  gradcomp::CompressedAllreduce allreduce(group.communicator(0), *backend, config);
  gradcomp::Segment bucket[] = {{grad_a, 0, n_a}, {grad_b, n_a, n_b}};
  bool finite = allreduce.allreduce(bucket, 2, gradcomp::DType::kFloat32, /*bucket_id=*/0);
  allreduce.advance_step();
  gradcomp::CompressionState saved = allreduce.state();

  double err = 0;
  for (int64_t i = 0; i < n_a; ++i) err = std::fmax(err, std::fabs(a[i] - a0[i]));
  std::printf("gradcomp consumer: finite=%d step=%u residual buckets=%zu max error %.4f\n", finite,
              saved.step, saved.residuals.size(), err);
  return finite && saved.step == 1 && saved.residuals.size() == 1 && err < 2.0 / 7 ? 0 : 1;
}
