#!/bin/bash
# Upstream Megatron-LM's examples/gptoss/02_train.sh with its flag set unchanged and the model
# scaled down to 2 ranks (GPUs, or CPU with --distributed-backend gloo). The script's own options
# come first; anything after `--` goes to pretrain_gpt.py.
# Usage: bash examples/megatron_lm/gpt_oss.sh --checkpoint-path DIR [--tensorboard-logs-path DIR]
#            [--tokenizer PATH|MOCK] [--data PATH|MOCK] [-- extra flags...]
# It asks for Transformer Engine and flash attention (CUDA); with those dropped (`--
# --transformer-impl local`, and without --use-flash-attn) it trains at its 2 pipeline stages:
# upstream's --enable-gpt-oss preset (YaRN RoPE), its windows, sinks, clamped GLU, MoE and FP8
# flags are built.

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

CHECKPOINT_PATH="NO_VALUE_PROVIDED"
TENSORBOARD_LOGS_PATH="./tensorboard_logs/"
TOKENIZER_ARG="MOCK"
DATA_ARG="MOCK"
while [[ $# -gt 0 ]]; do
    case $1 in
        --checkpoint-path) CHECKPOINT_PATH="$2"; shift 2 ;;
        --tensorboard-logs-path) TENSORBOARD_LOGS_PATH="$2"; shift 2 ;;
        --tokenizer) TOKENIZER_ARG="$2"; shift 2 ;;
        --data) DATA_ARG="$2"; shift 2 ;;
        --) shift; break ;;
        *) echo "Unknown option: $1" >&2; exit 1 ;;
    esac
done
if [ ! -d "$CHECKPOINT_PATH" ]; then
    echo "Error: --checkpoint-path must be an existing directory." >&2
    exit 1
fi
mkdir -p "$TENSORBOARD_LOGS_PATH"

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NUM_NODES=${NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NODE_RANK=${NODE_RANK:-0}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-"${PWD}/benchmark_cache_gpt_oss_20b"}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
    --node_rank $NODE_RANK
)

TP_SIZE=1
EP_SIZE=1
PP_SIZE=${PP_SIZE:-2}

MODEL_ARGS=(
    --no-masked-softmax-fusion
    --transformer-impl transformer_engine
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --no-rope-fusion
    --normalization RMSNorm
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 128
    --num-attention-heads 8
    --group-query-attention
    --num-query-groups 2
    --seq-length 64
    --max-position-embeddings 64
    --use-mcore-models
    --rotary-percent 1.0
    --rope-type rope
    --position-embedding-type rope
    --rotary-base 10000
    --no-bias-gelu-fusion
    --export-force-local-attention
    --no-bias-dropout-fusion
    --quick-geglu
    --glu-linear-offset 1.0
    --softmax-type learnable
    --window-attn-skip-freq 2
    --activation-func-clamp-value 7.0
    --window-size 127,0
    --enable-gpt-oss
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
    --moe-ffn-hidden-size 128
    --moe-router-dtype fp32
    --moe-z-loss-coeff 1e-3
    --moe-permute-fusion
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

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --lr 1.0e-5
    --train-samples 16
    --lr-decay-samples 12
    --lr-decay-style cosine
    --min-lr 1.0e-6
    --weight-decay 0.1
    --lr-warmup-fraction 0.05
    --clip-grad 1.0
    --bf16
    --use-flash-attn
    --attention-softmax-in-fp32
    --accumulate-allreduce-grads-in-fp32
    --disable-bf16-reduced-precision-matmul
    --recompute-activations
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size ${TP_SIZE}
    --pipeline-model-parallel-size ${PP_SIZE}
    --expert-model-parallel-size ${EP_SIZE}
    --sequence-parallel
    --context-parallel-size 1
    --use-distributed-optimizer
    --fp8-format hybrid
    --fp8-param-gather
    --fp8-amax-compute-algo max
    --fp8-amax-history-len 1024
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 50000000
    --eval-iters 0
    --save $CHECKPOINT_PATH
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --moe-per-layer-logging
    --no-load-optim
    --no-load-rng
    --log-throughput
)

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${DATA_ARGS_LIST[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${LOGGING_ARGS[@]}" \
    "$@"
