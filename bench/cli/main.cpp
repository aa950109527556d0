// gradcomp-bench: codec throughput and error tables, compressed-collective bandwidth (GPUs), and
// a step-time projection for data-parallel jobs on multi-GPU nodes.
#include <cstdio>

#include "cli.h"
#include "gradcomp/types.h"

int main(int argc, char** argv) {
  using namespace gradcomp_bench;
  const Args a = parse(argc, argv);
  try {
    if (a.mode == "codec") return codec_mode(a);
    if (a.mode == "project") return project_mode(a);
    return collective_mode(a);
  } catch (const gradcomp::Error& e) {
    std::fprintf(stderr, "gradcomp-bench: %s\n", e.what());
    return 1;
  }
}
