#!/usr/bin/env bash
# README's main job: set up, then pretrain a tiny GPT with Megatron-FSDP (ZeRO-3) on
# ${NPROC:-2} ranks through pretrain_gpt.py: GPUs with NCCL when every rank has one, else CPU
# with gloo (about 30 s of training on 2 cores). Mock data (a learnable counting language),
# 2 microbatches per rank per step; the loss falls from ~5.5 to ~0.1 in 200 iterations.
# Extra arguments go to pretrain_gpt.py and win over these (e.g. --train-iters 50).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
bash tools/setup_env.sh

if "$PYTHON" -c "import sys, torch; sys.exit(torch.cuda.device_count() < ${NPROC})"; then
  backend=nccl
else
  backend=gloo
fi
micro_batch=4
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
  --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 64 \
  --position-embedding-type rope --normalization RMSNorm --swiglu \
  --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size "$micro_batch" --global-batch-size "$((micro_batch * 2 * NPROC))" \
  --train-iters 200 --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --mock-data --vocab-size 256 --num-workers 0 \
  --log-interval 10 --eval-interval 100 --eval-iters 4 \
  --distributed-backend "$backend" "$@"
