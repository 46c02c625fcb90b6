#!/bin/bash
# Upstream Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh with its flag set unchanged and
# the model scaled down to run on 2 ranks (GPUs, or CPU with --distributed-backend gloo).
# Usage: bash examples/megatron_lm/llama3_8b_fp8.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH
#            [TOKENIZER_MODEL|MOCK [DATA_PREFIX|MOCK]]]] [extra flags...]
# DTYPE=fp8 (upstream's setting) trains in FP8 (hybrid format, delayed scaling), the distributed
# optimizer all-gathering the FP8 layers' weights as FP8 (--fp8-param-gather, docs/fp8.md);
# DTYPE=bf16 runs in bf16.

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CHECKPOINT_PATH=${1:-"checkpoints/llama3_8b_fp8"}
TENSORBOARD_LOGS_PATH=${2:-"tensorboard_logs/llama3_8b_fp8"}
TOKENIZER_ARG=${3:-"MOCK"}
DATA_ARG=${4:-"MOCK"}
shift $(( $# < 4 ? $# : 4 ))

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}
DTYPE=${DTYPE:-"fp8"}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-"${PWD}/benchmark_cache_llama3_8b_fp8"}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length 64
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --normalization RMSNorm
    --init-method-std 0.0134
    --attention-backend fused
    --apply-layernorm-1p
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --train-samples 16
    --lr-decay-samples 12
    --lr-warmup-samples 4
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)

DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        --fp8-format hybrid
        --fp8-amax-history-len 1024
        --fp8-amax-compute-algo max
        --fp8-param-gather
    )
fi

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel
)

TRAINING_ARGS+=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ "$DATA_ARG" == "MOCK" ]]; then
    DATA_ARGS_LIST=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 512
        --data-cache-path ${DATA_CACHE_PATH}
        --tiktoken-pattern v2
        --split '99,1,0'
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
    )
else
    DATA_ARGS_LIST=(
        --data-path $DATA_ARG
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model $TOKENIZER_ARG
        --data-cache-path ${DATA_CACHE_PATH}
        --split '99,1,0'
        --no-create-attention-mask-in-dataloader
        --no-mmap-bin-files
        --num-workers 1
        --vocab-size 512
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 1
    --eval-interval 2
    --save-interval 2
    --log-throughput
    --profile
    --profile-step-start 2
    --profile-step-end 3
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DTYPE_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "$@"
