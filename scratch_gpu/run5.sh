#!/bin/bash
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p $OUT
P="--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-fsdp-all-gather-in-start-param-sync --overlap-grad-reduce --overlap-param-gather --create-all-gather-group --grad-reduce-in-fp32 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 --position-embedding-type rope --vocab-size 32000 --micro-batch-size 1 --bf16 --hidden-dropout 0 --attention-dropout 0 --mock-data --eval-iters 0 --lr 1e-4 --train-iters 30 --log-interval 10 --global-batch-size 4"
for extra in "" "--suggested-communication-unit-size 101000000"; do
  for graph in "" "--cuda-graph-impl full_iteration"; do
    name="units${extra:+2}-${graph:+graphed}"
    timeout 200 torchrun --nproc-per-node 1 pretrain_gpt.py $P $extra $graph > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "training with|iteration +(10|20|30)/|Error" $OUT/$name.log | cut -c1-330
  done
done
