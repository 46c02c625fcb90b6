"""`pretrain_gpt.py` with a tiny DeepSeek-V3 on 2 CPU ranks (multi-latent attention, a dense
layer then an MoE layer at EP 2 with a shared expert, sigmoid routing with the expert bias,
group-limited top-k and the sequence-wise loss, one multi-token prediction depth): Megatron-FSDP
ZeRO-3 built on the meta device matches the DDP engine, a run stopped and resumed from its
checkpoint is bitwise the uninterrupted one (ZeRO-3 on the meta device, the up-projections
recomputed, dropout on), and a checkpoint of other MLA shapes is refused naming the flags."""

from __future__ import annotations

import shutil

import pytest

from tests.unit_tests.distributed_harness import run_distributed
from tests.unit_tests.training.checkpoint_checks import (
    RUN,
    ZERO3,
    assert_histories_equal,
    main,
    main_error,
    read_tracker_text,
    resumed_part,
)
from tests.unit_tests.training.test_pretrain_gpt import _assert_fsdp_matches_ddp

MLA = tuple(
    (
        "--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 16 --qk-head-dim 8 "
        "--qk-pos-emb-head-dim 8 --v-head-dim 8 --rotary-scaling-factor 4 --mscale 0.9 "
        "--mscale-all-dim 0.6 --yarn-original-max-position-embeddings 8 --qk-layernorm "
        "--normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear"
    ).split()
)
"""A DeepSeek-style attention whose YaRN acts within the 16-token sequences."""
DEEPSEEK_V3 = (
    *MLA,
    *(
        "--num-experts 8 --moe-ffn-hidden-size 16 --moe-layer-freq [0,1] --moe-router-topk 2 "
        "--moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 "
        "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-bias-update-rate 1e-2 --moe-shared-expert-intermediate-size 16 "
        "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 "
        "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 "
        "--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1"
    ).split(),
)
"""DeepSeek-V3's model (`examples/megatron_lm/deepseek_v3_fsdp.sh`) at EP 2, tiny."""
RECOMPUTE = ("--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj")


def test_deepseek_v3_fsdp_on_meta_device_matches_ddp():
    flags = (*DEEPSEEK_V3, *RECOMPUTE)
    _assert_fsdp_matches_ddp(2, [*ZERO3, "--init-model-with-meta-device"], flags)


@pytest.fixture(scope="module")
def first_half(tmp_path_factory) -> tuple[str, list[str]]:
    """A --save directory of a DeepSeek-V3 run under ZeRO-3 on the meta device stopped after
    iteration 3, and its flags."""
    root = str(tmp_path_factory.mktemp("mla-first-half"))
    flags = [*RUN, *ZERO3, *DEEPSEEK_V3, *RECOMPUTE, "--init-model-with-meta-device"]
    history = run_distributed(
        main, 2, [*flags, "--exit-interval", "3", "--save", root, "--save-interval", "3"]
    )[0]
    assert len(history.losses) == 3
    return root, flags


def test_deepseek_v3_resume_is_bitwise_the_uninterrupted_run(first_half, tmp_path):
    root, flags = first_half
    straight = run_distributed(main, 2, flags)[0]
    resume_root = str(tmp_path / "resume")
    shutil.copytree(root, resume_root)
    resumed = run_distributed(main, 2, [*flags, "--load", resume_root, "--save", resume_root])
    assert resumed[0].start_iteration == 3
    assert_histories_equal(resumed[0], resumed_part(straight, 3))
    assert_histories_equal(resumed[1], resumed[0])
    assert read_tracker_text(resume_root) == "6\n"


def test_a_checkpoint_of_other_mla_shapes_is_refused_naming_the_flags(first_half, tmp_path):
    root, flags = first_half
    other = [*flags, "--kv-lora-rank", "32", "--rope-type", "rope", "--load", root]
    errors = run_distributed(main_error, 2, [*other, "--save", str(tmp_path)])
    kind, message = errors[0]
    assert kind == "CheckpointError", message
    assert "--kv-lora-rank 16 (here 32)" in message
    assert "--rope-type yarn (here rope)" in message
