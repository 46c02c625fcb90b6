"""Converts Hugging Face Llama-family checkpoints (and Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3 and gpt-oss) to this project's checkpoints, and back.

    # A local Hugging Face model directory (config.json, *.safetensors, its tokenizer) ->
    # a weights-only checkpoint, and the model flags that build the matching model:
    python tools/convert_hf.py import --hf-dir Llama-3.2-1B --save ckpts/llama \\
        --flags-file llama.flags
    eval "flags=($(cat llama.flags))"  # the file is one line of shell words
    python pretrain_gpt.py "${flags[@]}" --load ckpts/llama --finetune --save ckpts/ft ...

    # A checkpoint (the tracker's iteration, or --ckpt-step) -> a directory that
    # transformers.AutoModelForCausalLM.from_pretrained() loads:
    python tools/convert_hf.py export --load ckpts/ft --hf-dir llama-ft

Supported: LlamaForCausalLM (Llama 2 and 3, with Llama 3's RoPE scaling), MistralForCausalLM
(without sliding-window attention), Qwen2ForCausalLM (its QKV bias), Qwen3ForCausalLM (its
query-key norms), YaRN RoPE, tied or untied embeddings, the Mixture-of-Experts
MixtralForCausalLM, Qwen2MoeForCausalLM (shared expert, dense layers) and Qwen3MoeForCausalLM,
DeepseekV3ForCausalLM (multi-latent attention, YaRN, grouped sigmoid routing with the expert
bias, shared experts, multi-token prediction) and GptOssForCausalLM (sinks, sliding windows,
clamped GLU experts). Both directions stream: a tensor (import; an MoE layer's stacked experts)
or a transformer layer (export) at a time is in memory, never the model. Nothing is overwritten
without --force.
`docs/hugging_face.md` explains the use; `megatron.training.hf_conversion` does the work.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron.training.checkpoint_layout import CheckpointError  # noqa: E402
from megatron.training.hf_conversion import export_hf, import_hf  # noqa: E402


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the subcommand and its flags."""
    parser = argparse.ArgumentParser(
        description="Convert Hugging Face Llama-family (and Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, "
        "DeepSeek-V3, gpt-oss) checkpoints to this project's and back."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    to_ours = commands.add_parser(
        "import", help="Hugging Face model directory -> weights-only checkpoint + model flags"
    )
    to_ours.add_argument(
        "--hf-dir", required=True, help="local model directory (config.json, *.safetensors)."
    )
    to_ours.add_argument("--save", required=True, help="checkpoint directory to write into.")
    to_ours.add_argument("--flags-file", help="also write the model flags into this file.")
    to_ours.add_argument(
        "--target-tp",
        type=int,
        default=1,
        help="tensor-parallel size to train at: checked against the sizes it splits and added "
        "to the flags with --sequence-parallel (the checkpoint loads at any).",
    )
    to_ours.add_argument(
        "--target-ep",
        type=int,
        default=1,
        help="expert-parallel size to train at: checked against the experts and added to the "
        "flags (the checkpoint loads at any).",
    )
    to_ours.add_argument(
        "--force", action="store_true", help="replace an existing checkpoint and flags file."
    )

    to_hf = commands.add_parser("export", help="checkpoint -> Hugging Face model directory")
    to_hf.add_argument("--load", required=True, help="the --save directory of a run.")
    to_hf.add_argument(
        "--ckpt-step", type=int, help="iteration to export (default: the tracker file's)."
    )
    to_hf.add_argument("--hf-dir", required=True, help="model directory to write.")
    to_hf.add_argument(
        "--hf-config",
        help="config.json (or a model directory) to write, e.g. the imported model's; default: "
        "the one recorded at import, else derived from the checkpoint's flags.",
    )
    to_hf.add_argument("--force", action="store_true", help="replace an existing --hf-dir.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the subcommand in `argv` (None: the command line); returns its summary.

    Raises:
        CheckpointError: the input is missing or not convertible, or the output exists
            (without `--force`); the message names the problem and the fix.
    """
    args = get_args(argv)
    if args.command == "import":
        return import_hf(
            args.hf_dir,
            args.save,
            flags_file=args.flags_file,
            target_tp=args.target_tp,
            target_ep=args.target_ep,
            force=args.force,
        )
    return export_hf(
        args.load,
        args.hf_dir,
        ckpt_step=args.ckpt_step,
        hf_config=args.hf_config,
        force=args.force,
    )


if __name__ == "__main__":
    try:
        main()
    except CheckpointError as error:
        sys.exit(f"{os.path.basename(__file__)}: error: {error}")
