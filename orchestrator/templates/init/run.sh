#!/usr/bin/env bash
# Runs on every node, in the job's working directory ($BT_WORKING_DIR).
set -euo pipefail

echo "job ${BT_TRAINING_JOB_ID:-?} rank ${BT_NODE_RANK:-0}/${BT_GROUP_SIZE:-1} on $(hostname)"
echo "checkpoints go to ${BT_CHECKPOINT_DIR:-<checkpointing disabled>}"

# Replace with your training command, e.g.:
# torchrun --nnodes="$BT_GROUP_SIZE" --node_rank="$BT_NODE_RANK" \
#   --nproc_per_node="$BT_NUM_GPUS" --master_addr="$BT_LEADER_ADDR" --master_port=29500 train.py
python -c "print('hello from orchestrator')"
