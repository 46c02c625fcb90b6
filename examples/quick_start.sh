#!/usr/bin/env bash
# README's main job: set up, preprocess a small public-domain text (examples/data: Volume I of
# Pride and Prejudice) into Megatron's indexed format with the byte-level tokenizer, then
# pretrain a tiny GPT on it with Megatron-FSDP (ZeRO-3) on ${NPROC:-2} ranks through
# pretrain_gpt.py: GPUs with NCCL when every rank has one, else CPU with gloo. Checkpoints go to
# runs/quick_start/checkpoints (every 100 iterations and at the end); a second run resumes from
# the latest of them instead of starting over (to train further, raise --train-iters and add
# --override-opt_param-scheduler, docs/running.md).
# Extra arguments go to pretrain_gpt.py and win over these (e.g. --train-iters 50).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
NPROC="${NPROC:-2}"
run_dir=runs/quick_start
source tools/setup_env.sh  # sets PYTHON

prefix="$run_dir/data/austen"
if [[ ! -f "${prefix}_text_document.idx" ]]; then
  "$PYTHON" tools/preprocess_data.py --input examples/data/pride_and_prejudice_vol1.jsonl \
    --output-prefix "$prefix" --json-keys text --tokenizer-type ByteLevelTokenizer \
    --append-eod --workers 2
fi

if "$PYTHON" -c "import sys, torch; sys.exit(torch.cuda.device_count() < ${NPROC})"; then
  backend=nccl
else
  backend=gloo
fi
micro_batch=4
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
  --num-layers 4 --hidden-size 128 --num-attention-heads 8 --seq-length 128 \
  --position-embedding-type rope --normalization RMSNorm --swiglu \
  --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size "$micro_batch" --global-batch-size "$((micro_batch * 2 * NPROC))" \
  --train-iters 200 --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --data-path "${prefix}_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
  --num-workers 0 --log-interval 10 --eval-interval 100 --eval-iters 4 \
  --save "$run_dir/checkpoints" --load "$run_dir/checkpoints" --save-interval 100 \
  --distributed-backend "$backend" "$@"
