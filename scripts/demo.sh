#!/usr/bin/env bash
# The main job: sets up a fresh machine, builds and installs gradcomp, and runs the short
# end-to-end comparison (2 ranks on a 1 Gbit/s link: DDP fp32, PyTorch's bf16, PowerSGD and
# quantization hooks, gradcomp q4 and top-k), ending in its table.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
"$root/scripts/setup.sh"
venv="$("$root/scripts/python_env.sh")"
CMAKE_CUDA_ARCHITECTURES="${CMAKE_CUDA_ARCHITECTURES:-90}" "$venv/bin/pip" install -q --no-build-isolation -e .
"$venv/bin/python" bench/e2e.py --quick --out "${GRADCOMP_RESULTS:-$root/bench/results}"
