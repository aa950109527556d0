#!/usr/bin/env bash
# Copies GoogleTest and Google Benchmark (headers, libraries, CMake configs) and the gloo headers
# and the pinned CCCL >= 3.3 headers (cub::DeviceTopK, from the project's venv)
# into .gpu-deps/, which the device run carries: the GPU machine has no network and none of them.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.gpu-deps/usr"
rm -rf "$root/.gpu-deps"
mkdir -p "$dest/include" "$dest/lib/x86_64-linux-gnu/cmake"
cp -r /usr/include/gtest /usr/include/gmock /usr/include/benchmark "$dest/include/"
# ProcessGroupGloo.hpp includes gloo headers, which the torch wheel does not ship.
cp -r /usr/include/gloo "$dest/include/"
cp -a /usr/lib/x86_64-linux-gnu/libgtest*.a /usr/lib/x86_64-linux-gnu/libgmock*.a \
  /usr/lib/x86_64-linux-gnu/libbenchmark* "$dest/lib/x86_64-linux-gnu/"
cp -r /usr/lib/x86_64-linux-gnu/cmake/GTest /usr/lib/x86_64-linux-gnu/cmake/benchmark "$dest/lib/x86_64-linux-gnu/cmake/"
venv="$("$root/scripts/python_env.sh")"
cccl=$(ls -d "$venv"/lib/python3*/site-packages/nvidia/cu13/include/cccl | head -n 1)
cp -r "$cccl" "$root/.gpu-deps/cccl"
du -sh "$root/.gpu-deps"
