#!/usr/bin/env bash
# Several nodes: run this on every node with the same HEAD (any node's address) and JOB_ID.
# torchrun's c10d rendezvous on HEAD:29400 waits for NNODES nodes and restarts every worker up to
# MAX_RESTARTS times when one fails (elastic restart); gradcomp's hierarchy takes torchrun's
# LOCAL_WORLD_SIZE (ranks per node) itself.
#   HEAD=10.0.0.1 NNODES=2 NPROC=8 JOB_ID=run42 examples/launch/torchrun_multi_node.sh --codec q4
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
: "${HEAD:?set HEAD to the address of one node (the rendezvous host)}"
# The interface NCCL uses between nodes, and what it reports (cluster guides set these).
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
exec "${PYTHON:-python3}" -m torch.distributed.run --nnodes "${NNODES:-2}" --nproc-per-node "${NPROC:-8}" \
  --rdzv-backend c10d --rdzv-endpoint "$HEAD:${RDZV_PORT:-29400}" --rdzv-id "${JOB_ID:-gradcomp}" \
  --max-restarts "${MAX_RESTARTS:-3}" \
  "${SCRIPT:-$here/../ddp_train.py}" --metrics-port "${METRICS_PORT:-9400}" \
  --metrics-addr "${METRICS_ADDR:-127.0.0.1}" "$@"  # METRICS_ADDR=0.0.0.0 for a scraper on another host
