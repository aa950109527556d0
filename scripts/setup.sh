#!/usr/bin/env bash
# Installs what the build needs on a fresh Debian machine (idempotent; does nothing when present).
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v clang++ >/dev/null || need+=(clang)
[ -f /usr/include/gtest/gtest.h ] || need+=(libgtest-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need+=(libbenchmark-dev)
[ -f /usr/include/gloo/algorithm.h ] || need+=(libgloo-dev)  # headers for ProcessGroupGloo.hpp
# A real Prometheus server, promtool and node_exporter for tests/python/test_monitoring.py.
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-node-exporter >/dev/null || need+=(prometheus-node-exporter)
# A single-node Slurm for tests/python/test_launch_recipes.py.
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd slurm-client)
# Compiler cache: the core is compiled by several builds of one CI run (tests, the torch layer for
# each torch version, the wheel) with the same flags; scripts/test_all.sh points them at one cache.
command -v ccache >/dev/null || need+=(ccache)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || need+=(libclang-rt-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
if [ -x /usr/local/cuda/bin/nvcc ]; then
  case ":$PATH:" in *":/usr/local/cuda/bin:"*) ;; *) export PATH="/usr/local/cuda/bin:$PATH" ;; esac
fi
