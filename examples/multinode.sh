#!/usr/bin/env bash
# shardlm on several nodes: run this script on every node, each with its own NODE_RANK, all with the same
# MASTER_ADDR (the first node's address, reachable from every node), MASTER_PORT and NNODES. The arguments
# are `shardlm train`'s:
#
#   node 0:  MASTER_ADDR=10.0.0.1 NODE_RANK=0 examples/multinode.sh llama2-7b --parallel.dp 16 --parallel.zero_stage 1 --out /shared/runs/7b
#   node 1:  MASTER_ADDR=10.0.0.1 NODE_RANK=1 examples/multinode.sh llama2-7b --parallel.dp 16 --parallel.zero_stage 1 --out /shared/runs/7b
#
# --out and data.path must be one shared filesystem (NFS, Lustre, ...) that every node sees at the same path:
# rank 0 writes the checkpoints, and on --resume every rank reads them. A run directory keeps no state on a
# node's local disk. Rerunning the same command after a failure resumes from the newest checkpoint.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"
: "${NODE_RANK:?set NODE_RANK: 0 on the first node, 1 on the second, ...}"
NNODES=${NNODES:-2}
MASTER_PORT=${MASTER_PORT:-29500}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$GPUS_PER_NODE" -gt 0 ] || GPUS_PER_NODE=1  # a CPU node: one gloo process
fi
# The network the ranks talk over: NCCL (GPUs) and gloo (CPUs, and the ranks' stop agreement on GPUs too) pick
# an interface by themselves, which on hosts with several can be one the other node cannot reach. Name it:
#   export NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0   # the interface holding MASTER_ADDR's network
#   export NCCL_IB_HCA=mlx5                                  # InfiniBand: the adapters NCCL may use
#   export NCCL_DEBUG=WARN                                   # INFO: which transport NCCL chose, and why
# A resumed run continues its own directory: pass --resume only when it holds a checkpoint.
OUT=""
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    --out) j=$((i + 1)); OUT=${!j} ;;
    --out=*) OUT=${!i#--out=} ;;
  esac
done
RESUME=()
if [ -n "$OUT" ] && compgen -G "$OUT/checkpoints/step_*/state.json" > /dev/null; then RESUME=(--resume "$OUT"); fi
exec "${TORCHRUN:-torchrun}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RUN_ID:-shardlm}" \
  -m shardlm train "$@" ${RESUME[@]+"${RESUME[@]}"}
