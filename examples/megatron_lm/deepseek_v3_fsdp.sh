#!/bin/bash
# Upstream Megatron-LM's examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (its training flags
# unchanged; the sbatch/srun wrapper left out) with the model scaled down to 2 ranks (GPUs, or CPU
# with --distributed-backend gloo).
# Usage: OUTPUT_PATH=DIR [DATA_PATH=PREFIX] bash examples/megatron_lm/deepseek_v3_fsdp.sh [extra flags...]
# It asks for the flex (HybridEP) token dispatcher, which is not built, and Transformer Engine
# with flash attention (GPU only). On CPU, delete the --use-flash-attn line and add
# --moe-token-dispatcher-type alltoall --transformer-impl local --distributed-backend gloo:
# the rest (multi-latent attention, multi-token prediction, DeepSeek-V3's MoE routing,
# Megatron-FSDP on the meta device) trains as written.

OUTPUT_PATH=${OUTPUT_PATH:-"output_deepseek_v3"}
DATA_PATH=${DATA_PATH:-MOCK}
USE_MEGATRON_FSDP=${USE_MEGATRON_FSDP:-1}
SHARDING_STRATEGY=${SHARDING_STRATEGY:-"optim_grads_params"}
PROFILE=${PROFILE:-0}
WANDB=${WANDB:-0}
TP=${TP:-1}
EP=${EP:-2}
MBS=${MBS:-1}
GBS=${GBS:-4}

if [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS=(--mock-data --vocab-size 512)
else
    DATA_ARGS=(
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model ${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}
        --data-path ${DATA_PATH}
    )
fi

PRETRAIN_ARGS=(
    --distributed-timeout-minutes 60
    --tensor-model-parallel-size ${TP}
    --expert-model-parallel-size ${EP}
    --expert-tensor-parallel-size 1
    --context-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --use-mcore-models
    --sequence-parallel
    --use-flash-attn
    --disable-bias-linear
    --micro-batch-size ${MBS}
    --global-batch-size ${GBS}
    --train-samples 16
    --exit-duration-in-mins 220
    --no-check-for-nan-in-loss-and-grad
    --manual-gc
    --manual-gc-interval 10
    --recompute-granularity selective
    --recompute-modules mlp moe mla_up_proj layernorm
    --transformer-impl transformer_engine
    --seq-length 64
    --data-cache-path ${OUTPUT_PATH}/cache
    "${DATA_ARGS[@]}"
    --split 99,1,0
    --no-mmap-bin-files
    --no-create-attention-mask-in-dataloader
    --num-workers 1
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 160
    --num-attention-heads 4
    --kv-channels 16
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by 32
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --multi-latent-attention
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --clip-grad 1.0
    --weight-decay 0.1
    --qk-layernorm
    --lr-decay-samples 12
    --lr-warmup-samples 4
    --lr-warmup-init 3.9e-7
    --lr 3.9e-6
    --min-lr 3.9e-7
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
    --num-experts 4
    --moe-layer-freq [0]*1+[1]*3
    --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32
    --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk 2
    --moe-token-dispatcher-type flex
    --moe-flex-dispatcher-backend hybridep
    --moe-router-pre-softmax
    --moe-grouped-gemm
    --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk 2
    --moe-router-num-groups 2
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-permute-fusion
    --moe-router-force-load-balancing
    --q-lora-rank 32
    --kv-lora-rank 16
    --qk-head-dim 16
    --qk-pos-emb-head-dim 8
    --v-head-dim 16
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
    --eval-iters 1
    --eval-interval 2
    --auto-detect-ckpt-format
    --load ${OUTPUT_PATH}/checkpoints
    --save ${OUTPUT_PATH}/checkpoints
    --save-interval 2
    --dist-ckpt-strictness log_all
    --init-method-std 0.02
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --log-num-zeros-in-grad
    --log-params-norm
    --log-validation-ppl-to-tensorboard
    --log-throughput
    --log-interval 1
    --logging-level 40
    --tensorboard-dir ${OUTPUT_PATH}/tensorboard
    --bf16
    --enable-experimental
)

if [ "${USE_MEGATRON_FSDP}" = 1 ]; then
    unset CUDA_DEVICE_MAX_CONNECTIONS
    PRETRAIN_ARGS+=(
        --use-megatron-fsdp
        --data-parallel-sharding-strategy ${SHARDING_STRATEGY}
        --no-gradient-accumulation-fusion
        --use-distributed-optimizer
        --calculate-per-token-loss
        --init-model-with-meta-device
        --ckpt-format fsdp_dtensor
        --fsdp-double-buffer
        --use-nccl-ub
        --megatron-fsdp-grad-comm-dtype bf16
        --megatron-fsdp-main-grads-dtype bf16
    )
fi

if [ "${PROFILE}" = 1 ]; then
    PRETRAIN_ARGS+=(
        --profile
        --profile-step-start 2
        --profile-step-end 3
        --profile-ranks 0
    )
fi

if [ "${WANDB}" = 1 ]; then
    PRETRAIN_ARGS+=(
        --wandb-project your_own_wandb_project
        --wandb-exp-name DeepSeek-V3-TP${TP}EP${EP}-MBS${MBS}GBS${GBS}
    )
fi

${LAUNCHER:-torchrun} --nproc_per_node ${GPUS_PER_NODE:-2} pretrain_gpt.py "${PRETRAIN_ARGS[@]}" "$@"
