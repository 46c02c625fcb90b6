#!/usr/bin/env bash
# FP8 against bf16 on real text: pretrains the 1.34B GPT (hidden 2048, 24 layers, 16 heads) on the
# quick start's corpus (examples/data, byte-level tokens) twice with Megatron-FSDP ZeRO-3 on
# ${NPROC:-1} GPU(s): in bf16, then in FP8 (hybrid format, delayed scaling over a 1024-long amax
# history, the FP8 layers' weights gathered in FP8), the same seed, data and schedule, micro-batch
# 2 of 1024 tokens per GPU, ${ITERS:-500} iterations, a validation every 100. Then
# tools/plot_loss_curves.py prints both runs' final training loss and validation losses and
# draws the curves into runs/fp8_convergence/loss_curves.png.
# Extra arguments go to both pretrain_gpt.py runs and win over these.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
NPROC="${NPROC:-1}"
ITERS="${ITERS:-500}"
run_dir=runs/fp8_convergence
PYTHON="${PYTHON:-python3}"

mkdir -p "$run_dir"
prefix="$run_dir/data/austen"
if [[ ! -f "${prefix}_text_document.idx" ]]; then
  "$PYTHON" tools/preprocess_data.py --input examples/data/pride_and_prejudice_vol1.jsonl \
    --output-prefix "$prefix" --json-keys text --tokenizer-type ByteLevelTokenizer \
    --append-eod --workers 2
fi

fp8=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max
  --fp8-param-gather)
for precision in bf16 fp8; do
  extra=()
  [[ "$precision" == fp8 ]] && extra=("${fp8[@]}")
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 2 --global-batch-size "$((2 * NPROC))" --bf16 \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --overlap-grad-reduce --overlap-param-gather \
    --train-iters "$ITERS" --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 50 \
    --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 \
    --data-path "${prefix}_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
    --num-workers 0 --log-interval 1 --eval-interval 100 --eval-iters 10 \
    --distributed-backend nccl "${extra[@]}" "$@" 2>&1 | tee "$run_dir/$precision.log"
done
"$PYTHON" tools/plot_loss_curves.py "bf16=$run_dir/bf16.log" "fp8=$run_dir/fp8.log" \
  --title "1.34B GPT on Pride and Prejudice: bf16 and FP8 (hybrid, delayed)" \
  --out "$run_dir/loss_curves.png"
