#!/bin/bash
# The deepspeed launcher with a hostfile (passwordless ssh between nodes), run on the first node.
#   bash infra/slurm/hostfile-deepspeed.sh configs/tiny.yaml
set -euo pipefail
CONFIG=${1:-configs/tiny.yaml}
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/$/ slots=8/' > hostfile
MASTER_ADDR=$(head -n 1 hostfile | cut -d' ' -f1)
.venv/bin/gptforge run -c "$CONFIG" --only pretrain --set distributed.hostfile=hostfile \
  --set distributed.master_addr="$MASTER_ADDR" --set distributed.nnodes="$(wc -l < hostfile)" \
  --set distributed.nproc_per_node=8 --set distributed.launcher=deepspeed
