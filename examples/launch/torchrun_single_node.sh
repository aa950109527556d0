#!/usr/bin/env bash
# One node, NPROC processes (one per GPU, or CPU ranks over Gloo): torchrun's standalone
# rendezvous, gradcomp's metrics on port 9400 + local rank. Arguments go to the training script.
#   NPROC=8 examples/launch/torchrun_single_node.sh --codec q4 --epochs 30
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
  "${SCRIPT:-$here/../ddp_train.py}" --metrics-port "${METRICS_PORT:-9400}" "$@"
