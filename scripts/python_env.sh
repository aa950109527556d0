#!/usr/bin/env bash
# Creates (once) a Python environment outside the clone and prints its path. PyTorch is several
# GB, so it lives in a cache folder that survives fresh clones: $GRADCOMP_VENV or
# ~/.cache/gradcomp/venv with the newest torch; `python_env.sh 2.7.1` makes one with that torch
# (~/.cache/gradcomp/venv-torch2.7.1), for testing against the oldest supported version.
set -euo pipefail
torch_version="${1:-}"
if [ -n "$torch_version" ]; then
  venv="$HOME/.cache/gradcomp/venv-torch$torch_version"
  torch_spec="torch==$torch_version"
else
  venv="${GRADCOMP_VENV:-$HOME/.cache/gradcomp/venv}"
  torch_spec="torch"
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
check="import torch, numpy, sklearn, pytest, matplotlib, prometheus_client, yaml, kubernetes_validate"
[ -z "$torch_version" ] || check="$check; assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__"
if ! "$venv/bin/python" -c "$check" >/dev/null 2>&1; then
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q "$torch_spec" numpy scikit-learn pytest matplotlib prometheus_client pyyaml kubernetes-validate setuptools wheel >&2
fi
# CCCL >= 3.3 headers (cub::DeviceTopK) for the v2 top-k kernels, pinned; CMake finds them in
# this venv (or takes -DGRADCOMP_CCCL_INCLUDE_DIR=<venv>/lib/python3.*/site-packages/nvidia/cu13/include/cccl).
cccl_version="13.3.5.0.6"
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-cccl') == '$cccl_version'" >/dev/null 2>&1; then
  "$venv/bin/pip" install -q "nvidia-cuda-cccl==$cccl_version" >&2
fi
# cuobjdump and nvdisasm for the static SASS check (scripts/check_sass_budgets.sh): the CUDA 13.0
# toolkit here ships without them; these read sm_90 cubins.
disasm_version="13.5.37"
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-cuobjdump') == '$disasm_version' and m.version('nvidia-cuda-nvdisasm') == '$disasm_version'" >/dev/null 2>&1; then
  "$venv/bin/pip" install -q "nvidia-cuda-cuobjdump==$disasm_version" "nvidia-cuda-nvdisasm==$disasm_version" >&2
fi
# The newest-torch environment also gets the trainers gradcomp.integrations adapts, at pyproject.toml's
# `integrations` pins (read from there, so the two cannot drift); the oldest-torch one stays without them.
if [ -z "$torch_version" ]; then
  pins="$("$venv/bin/python" -c "import tomllib; print(' '.join(tomllib.load(open('$(dirname "$0")/../pyproject.toml', 'rb'))['project']['optional-dependencies']['integrations']))")"
  if ! "$venv/bin/pip" show -q pytorch-lightning accelerate transformers >/dev/null 2>&1 \
      || ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(any(m.version(p.split('==')[0]) != p.split('==')[1] for p in sys.argv[1:]))" $pins; then
    "$venv/bin/pip" install -q $pins >&2
  fi
fi
echo "$venv"
