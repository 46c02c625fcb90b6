#!/bin/bash
# Upstream Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh: the "175B" GPT-3 with
# upstream's flag set and sizes: tensor parallelism 8 within each node of 8 GPUs, 16 pipeline
# stages (128 GPUs). TP and PP set other sizes; with fewer stages the weights need more than
# one node's 8-way split, so add sharding flags after the positional arguments, e.g.
# --use-megatron-fsdp (extra flags come last and win).
# Usage: bash examples/gpt3/train_gpt3_175b_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#            [VOCAB_FILE MERGE_FILE DATA_PATH | MOCK] [extra flags...]
# MOCK trains on mock data (--mock-data --vocab-size 50257: GPT-2's vocabulary).

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=${3:-MOCK} # gpt2-vocab.json, or MOCK
MERGE_FILE=$4 # gpt2-merges.txt
DATA_PATH=$5 # <prefix>_text_document
shift $(( $# < 5 ? $# : 5 ))

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NUM_NODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
    --train-iters 500000
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
    --lr-decay-iters 430000
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size ${TP:-8}
    --pipeline-model-parallel-size ${PP:-16}
)

if [ "$VOCAB_FILE" = MOCK ]; then
    DATA_ARGS=(--mock-data --vocab-size 50257 --split 949,50,1)
else
    DATA_ARGS=(
        --data-path $DATA_PATH
        --vocab-file $VOCAB_FILE
        --merge-file $MERGE_FILE
        --split 949,50,1
    )
fi

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

${LAUNCHER:-torchrun} ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    "${TRAINING_ARGS[@]}" \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]} \
    "$@"
