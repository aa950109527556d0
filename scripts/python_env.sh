#!/usr/bin/env bash
# Creates (once) the Python environment outside the clone and prints its path. PyTorch is several
# GB, so it lives in a cache folder that survives fresh clones: $GRADCOMP_VENV or ~/.cache/gradcomp/venv.
set -euo pipefail
venv="${GRADCOMP_VENV:-$HOME/.cache/gradcomp/venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
if ! "$venv/bin/python" -c "import torch, numpy, sklearn, pytest, matplotlib" >/dev/null 2>&1; then
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q torch numpy scikit-learn pytest matplotlib setuptools wheel >&2
fi
echo "$venv"
