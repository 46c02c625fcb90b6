#!/usr/bin/env bash
# Pretrains the 1.34B GPT of the benchmark's configuration L with Megatron-FSDP ZeRO-3 on
# ${NPROC:-2} GPUs (NCCL): the model of tools/benchmark_lib/gpt_model.py (hidden 2048, 24 layers,
# 16 heads, vocab 32000, seq 2048, RoPE, untied output layer, LayerNorm, GELU MLP, biases, no
# dropout), micro-batch 2 per GPU, bf16 compute with fp32 main weights and fp32 gradient
# reduction, all-gathers prefetched on their own communicator and reduce-scatters overlapped
# with backward. Mock data, 50 iterations, a log line every 5 (TFLOP/s/GPU, peak memory).
# GLOBAL_BATCH (default 2 x NPROC: no accumulation) adds microbatches; extra arguments go to
# pretrain_gpt.py and win over these (e.g. --init-model-with-meta-device, --train-iters 100).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"
micro_batch=2
GLOBAL_BATCH="${GLOBAL_BATCH:-$((micro_batch * NPROC))}"

exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
  --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope \
  --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
  --micro-batch-size "$micro_batch" --global-batch-size "$GLOBAL_BATCH" \
  --bf16 --grad-reduce-in-fp32 \
  --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
  --overlap-grad-reduce --overlap-param-gather --create-all-gather-group \
  --train-iters 50 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 10 --lr-decay-style cosine \
  --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 \
  --mock-data --vocab-size 32000 \
  --log-interval 5 --eval-interval 25 --eval-iters 2 \
  --distributed-backend nccl "$@"
