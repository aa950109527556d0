#!/usr/bin/env bash
# The main job: builds gradcomp on a fresh machine and runs the codec benchmark, ending in a table.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
"$root/scripts/setup.sh"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" >/dev/null
cmake --build build -j "$(nproc)" --target gradcomp_bench_codecs
./build/bench/gradcomp_bench_codecs --benchmark_min_time="${GRADCOMP_BENCH_MIN_TIME:-0.3}" \
  --benchmark_counters_tabular=true
