#!/bin/bash
# Upstream Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh with its flag set unchanged
# and the model scaled down to run on 2 ranks (GPUs, or CPU with --distributed-backend gloo).
# Usage: bash examples/megatron_lm/gpt3_175b.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#            [VOCAB_FILE MERGE_FILE DATA_PATH | MOCK] [extra flags...]
# It asks for tensor and pipeline parallelism (TP=8, PP=16 upstream): set TP=1 PP=1 to run.

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-2}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=${3:-MOCK}
MERGE_FILE=$4
DATA_PATH=$5
shift $(( $# < 5 ? $# : 5 ))

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 2
    --hidden-size 64
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --step-batch-size-schedule "0:4 64:8"
    --train-iters 4
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-iters 4
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size ${TP:-8}
    --pipeline-model-parallel-size ${PP:-16}
)

if [ "$VOCAB_FILE" = MOCK ]; then
    DATA_ARGS=(--mock-data --vocab-size 512 --split 949,50,1)
else
    DATA_ARGS=(
        --data-path $DATA_PATH
        --vocab-file $VOCAB_FILE
        --merge-file $MERGE_FILE
        --split 949,50,1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --save-interval 2
    --eval-interval 2
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 1
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    "${TRAINING_ARGS[@]}" \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "$@"
