#!/usr/bin/env bash
# Static SASS check, no GPU: every kernel compiled for sm_90 as CMake builds it; the v1 kernels
# reported, the v2 kernels held to kernels/sass_budgets.txt. Prints both tables.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${GRADCOMP_VENV:-$HOME/.cache/gradcomp/venv}
site=$(ls -d "$venv"/lib/python3*/site-packages | head -n 1)
export CUOBJDUMP=${CUOBJDUMP:-$site/nvidia/cu13/bin/cuobjdump}
export PATH=/usr/local/cuda/bin:$PATH
if [ ! -x "$CUOBJDUMP" ]; then
  echo "check_sass_budgets: no cuobjdump at $CUOBJDUMP (scripts/python_env.sh installs it)" >&2
  exit 2
fi
flags=(-Icsrc/include -Ikernels -std=c++17 --fmad=false -Xcompiler=-ffp-contract=off -DNDEBUG)
cccl="$site/nvidia/cu13/include/cccl"
[ -d "$cccl" ] && flags+=("-I$cccl")
echo "== v1 kernels (kernels/*.cu), reported =="
scripts/sass_report.sh kernels -- "${flags[@]}"
echo "== v2 kernels (kernels/v2/*.cu), budget kernels/sass_budgets.txt =="
scripts/sass_report.sh -b kernels/sass_budgets.txt kernels/v2 -- "${flags[@]}"
echo "check_sass_budgets: every v2 budget met"
