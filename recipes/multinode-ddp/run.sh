#!/usr/bin/env bash
# Entry point for the multinode-ddp recipe: one torchrun per node, static rendezvous.
# Maps the orchestrator's variables onto torchrun's flags by hand, the way Baseten recipes do.
# NPROC_PER_NODE is the GPU count per node, or 1 on CPU (BT_NUM_GPUS is 0 there).
# Set TORCHRUN to choose the launcher; extra arguments go to train.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${TORCHRUN:-torchrun}" \
  --nnodes="${BT_GROUP_SIZE:-1}" \
  --node_rank="${BT_NODE_RANK:-0}" \
  --nproc_per_node="${NPROC_PER_NODE:-1}" \
  --rdzv-backend=static \
  --master_addr="${BT_LEADER_ADDR:-127.0.0.1}" \
  --master_port="${MASTER_PORT:-29500}" \
  "$here/train.py" "$@"
