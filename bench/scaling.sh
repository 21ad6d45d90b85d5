#!/bin/bash
# Scaling efficiency in one call: each system at 1 GPU and at N GPUs (default 4), one run at a time, rows
# appended to bench/results.jsonl (or $RECORD). Usage: bash bench/scaling.sh [N] [SYSTEM ...]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
n=${1:-4}; shift || true
systems=${*:-shardlm-ddp shardlm-zero1 shardlm-zero2 shardlm-zero3}
record=${RECORD:-bench/results.jsonl}
for s in $systems; do
  CUDA_VISIBLE_DEVICES=0 python bench/data_parallel.py --gpus 1 --systems "$s" --record "$record" | grep '^{'
  python bench/data_parallel.py --gpus "$n" --systems "$s" --record "$record" | grep '^{'
done
