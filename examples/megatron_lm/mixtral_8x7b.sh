#!/bin/bash
# Upstream Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh with its flag set
# unchanged and the model scaled down to 2 ranks (GPUs, or CPU with --distributed-backend gloo).
# Usage: bash examples/megatron_lm/mixtral_8x7b.sh CHECKPOINT_PATH [TOKENIZER_MODEL DATA_PATH |
#            MOCK] [extra flags...]
# It asks for 4 pipeline stages (PP=4) and EP=2, more than 2 ranks hold: PP=1 runs it with MoE
# layers split over EP=2 ranks, PP=2 EP=1 at two stages.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29500"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=${2:-MOCK}
DATA_PATH=$3
shift $(( $# < 3 ? $# : 3 ))

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 64
    --max-position-embeddings 256
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

if [ "$TOKENIZER_MODEL" = MOCK ]; then
    DATA_ARGS=(--mock-data --vocab-size 512 --split 99990,8,2)
else
    DATA_ARGS=(
        --tokenizer-type Llama2Tokenizer
        --tokenizer-model ${TOKENIZER_MODEL}
        --data-path $DATA_PATH
        --split 99990,8,2
    )
fi

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 4
    --lr 1e-4
    --train-iters 4
    --lr-decay-iters 3
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 1
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size ${PP:-4}
    --expert-model-parallel-size ${EP:-2}
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 2
    --eval-iters 1
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard"
    --no-load-optim
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Mixtral"}
        --wandb-exp-name ${WANDB_NAME:-"Mixtral_8x7B"}
    )
fi

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${MODEL_ARGS[@]} \
    ${MOE_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${LOGGING_ARGS[@]} \
    "$@"
