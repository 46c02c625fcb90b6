"""Hugging Face checkpoints to this project's (`import_hf`) and back (`export_hf`), streaming.

`import_hf` writes the weights of a Hugging Face model directory as a weights-only checkpoint
(iteration 0) that `pretrain_gpt.py --load DIR --finetune` trains, and returns the model flags
that build the matching model. Each tensor of the checkpoint is made from its Hugging Face
tensors only when torch.distributed.checkpoint writes it, into a data file of its own, so the
memory held is one tensor and its sources (a fused QKV or fc1 matrix and its parts, or an MoE
layer's stacked experts and each expert's matrices), never the model. The checkpoint's
`common.pt` records the model flags' values (`args`, which loading checks against the model's)
and the Hugging Face `config.json` (`HF_CONFIG_KEY`). Expert tensors are written whole
([num_experts, ...]), so the checkpoint loads at any expert-parallel size.

`export_hf` writes a checkpoint's model weights (not the FP8 delayed-scaling state of a run
trained with it: amax histories and scales are no Hugging Face weights) as a directory that
`transformers.AutoModelForCausalLM.from_pretrained` loads: `config.json` (the one recorded at
import, one given, or one derived from the saved flags), one safetensors file
per transformer layer (plus one for the embedding, one for the final norm and output layer, and
one per multi-token prediction depth) and their index. It reads and writes one such group at a
time.

The Llama family's tensors are `tensors.py`'s, DeepSeek-V3's `deepseek_v3_tensors.py`'s
(`_tensor_plan`), whose depths' copies of the embedding and output layer are checked on import
and written on export.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem

from megatron.core.utils import write_atomically
from megatron.training.checkpoint_layout import (
    STAGING_SUFFIX,
    commit_checkpoint,
    make_common,
    read_common,
    read_metadata,
    saved_entries,
)
from megatron.training.checkpointing import GPT_OSS_MODEL_ARGS, MLA_MODEL_ARGS, YARN_MODEL_ARGS
from megatron.training.flag_groups.moe import resolved_moe_args
from megatron.training.hf_conversion import deepseek_v3, deepseek_v3_tensors
from megatron.training.hf_conversion.config import (
    ARCHITECTURE_ARGS,
    CONFIG_FILENAME,
    HFConversionError,
    hf_config_from_model_args,
    hf_vocab_size,
    model_args_from_hf_config,
    model_flags,
    read_hf_config,
    vocab_args,
)
from megatron.training.hf_conversion.moe import DENSE_MOE_ARGS
from megatron.training.hf_conversion.safetensors_files import HFWeights, write_index, write_shard
from megatron.training.hf_conversion.tensors import (
    IGNORED_SUFFIXES,
    Conversion,
    conversions,
    hf_shapes,
    to_hf,
    to_megatron,
)
from megatron.training.offline_checkpoint import (
    check_writable,
    find_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

HF_CONFIG_KEY = "hf_config"
"""The entry of an imported checkpoint's `common.pt` that holds the Hugging Face config."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
"""Files that show that a model directory holds its tokenizer."""


class _ProducingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, for a state dict of meta tensors: each tensor is made by
    its producer when DCP writes it (keyed by DCP's flattened name, "model.<name>")."""

    def __init__(self, producers: Mapping[str, Callable[[], torch.Tensor]]):
        super().__init__()
        self._producers = producers

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        return self._producers[write_item.index.fqn]()


def import_hf(
    hf_dir: str,
    save: str,
    *,
    flags_file: str | None = None,
    target_tp: int = 1,
    target_ep: int = 1,
    force: bool = False,
) -> dict[str, Any]:
    """Writes the Hugging Face model in `hf_dir` as a weights-only checkpoint (iteration 0)
    under `save`, and prints (and writes to `flags_file`) the model flags to train it with.

    Returns:
        `path` (the checkpoint's directory), `flags`, `args` (the flags' values), `tensors`,
        `parameters` and `bytes` (of the tensors).

    Raises:
        HFConversionError: the model is not convertible (named) or its weights do not fit its
            config; nothing was written.
        CheckpointError: the checkpoint or `flags_file` exists (without `force`).
    """
    config = read_hf_config(hf_dir)
    args = model_args_from_hf_config(config)
    model_vocab = hf_vocab_size(config)
    _check_target_tp(target_tp, args, model_vocab)
    _check_target_ep(target_ep, args["num_experts"])
    weights = HFWeights(hf_dir)
    if args["multi_latent_attention"]:
        args["mtp_num_layers"] = deepseek_v3.mtp_depths(config, weights.shapes)
    tokenizer_vocab = _tokenizer_vocab(hf_dir)
    args.update(vocab_args(model_vocab, tokenizer_vocab, os.path.abspath(hf_dir), target_tp))
    plan, hf_shapes_expected = _tensor_plan(args, config, model_vocab)
    _check_weights(weights, hf_shapes_expected, plan, args, hf_dir)
    _check_copies(weights, plan, hf_dir)
    check_writable(save, 0, force, iteration_option=None)
    if flags_file is not None:
        _check_flags_file(flags_file, force)

    shapes: dict[str, torch.Tensor] = {}
    producers: dict[str, Callable[[], torch.Tensor]] = {}
    for conversion in plan:
        if conversion.layout == "copy":
            continue  # the tensor another conversion makes (`_check_copies`)
        sources = [
            torch.empty(weights.shapes[name], dtype=weights.dtypes[name], device="meta")
            for name in conversion.hf_names
        ]
        if len({source.dtype for source in sources}) > 1:
            raise HFConversionError(
                f"{', '.join(conversion.hf_names)} have different dtypes; they are fused into "
                f"one tensor ({conversion.name}), so they must share one."
            )
        shapes[conversion.name] = to_megatron(conversion, sources, args)
        producers[f"model.{conversion.name}"] = functools.partial(
            _produce, weights, conversion, args
        )
    common = make_common(args=args)
    common[HF_CONFIG_KEY] = config
    final = write_checkpoint(
        save,
        {"model": shapes},
        common,
        force,
        planner=_ProducingSavePlanner(producers),
        one_file_per_tensor=True,
        iteration_option=None,
    )
    flags = model_flags(args)
    if target_tp != 1:
        # Sequence parallelism: Megatron-LM's choice with TP, and MoE layers need it there.
        flags += ["--tensor-model-parallel-size", str(target_tp), "--sequence-parallel"]
    if target_ep != 1:
        flags += ["--expert-model-parallel-size", str(target_ep)]
    _report_flags(flags, args, config, model_vocab, save, flags_file)
    return {
        "path": final,
        "flags": flags,
        "args": args,
        "tensors": len(shapes),
        "parameters": sum(tensor.numel() for tensor in shapes.values()),
        "bytes": sum(tensor.numel() * tensor.element_size() for tensor in shapes.values()),
    }


def export_hf(
    load: str,
    hf_dir: str,
    *,
    ckpt_step: int | None = None,
    hf_config: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Writes the model weights of the checkpoint `ckpt_step` (None: the tracker's) under
    `load` as the Hugging Face model directory `hf_dir`.

    Args:
        load: A `--save` directory.
        hf_dir: The directory to write (replaced only with `force`).
        ckpt_step: The iteration to export.
        hf_config: A `config.json` (or a model directory holding one) to write, for a
            checkpoint trained from an import whose config it then checks against the saved
            flags; None takes the config recorded at import, or derives one from those flags.
        force: Replace an existing `hf_dir`.

    Returns:
        `path`, `tensors`, `parameters`, `bytes` and `architecture`.

    Raises:
        CheckpointError: the checkpoint is missing or damaged, is not of a Llama-family model
            or does not fit the config, or `hf_dir` exists (without `force`).
    """
    path = find_checkpoint(load, ckpt_step)
    _check_output_dir(hf_dir, load, force)
    common = read_common(path)
    # The weights only: a module's extra state saved as bytes (the FP8 delayed-scaling state,
    # `decoder.fp8_state._extra_state`) has no place in Hugging Face files.
    saved = {
        nesting[1]: item
        for nesting, item in saved_entries(read_metadata(path)).items()
        if nesting[0] == "model" and isinstance(item, TensorStorageMetadata)
    }
    embedding = saved.get("embedding.word_embeddings.weight")
    if embedding is None:
        raise HFConversionError(f"{path} holds no word embedding: it is not a GPT checkpoint.")
    dtype = str(embedding.properties.dtype).removeprefix("torch.")
    config, args = _export_config(common, hf_config, path, embedding.size[0], dtype)
    if args["multi_latent_attention"]:
        # The depths the checkpoint holds (the config may state some it has not: an import
        # from weights without them keeps the original config).
        args["mtp_num_layers"] = (common.get("args") or {}).get("mtp_num_layers")
        config = deepseek_v3.with_mtp_depths(config, args["mtp_num_layers"])
    vocab = hf_vocab_size(config)
    if vocab > embedding.size[0]:
        raise HFConversionError(
            f"config.json's vocab_size {vocab} exceeds the checkpoint's {embedding.size[0]} "
            "embedding rows: the config is of another model; pass its own with --hf-config."
        )
    args = {**args, "padded_vocab_size": embedding.size[0]}
    plan, hf_shapes_expected = _tensor_plan(args, config, vocab)
    _check_saved(saved, plan, hf_shapes_expected, args, path)
    # transformers 5 writes "dtype", 4 "torch_dtype" (which 5 reads too).
    for key in [key for key in ("dtype", "torch_dtype") if key in config] or ["torch_dtype"]:
        config[key] = dtype

    staging = os.path.normpath(hf_dir) + STAGING_SUFFIX
    if os.path.exists(staging):
        shutil.rmtree(staging)  # this tool's leftover: never committed
    os.makedirs(staging)
    groups = list(dict.fromkeys(conversion.group for conversion in plan))
    weight_map: dict[str, str] = {}
    sizes = []
    try:
        for number, group in enumerate(groups, start=1):
            members = [conversion for conversion in plan if conversion.group == group]
            names = {conversion.name for conversion in members}
            state = read_checkpoint(
                path, lambda nesting, names=names: nesting[0] == "model" and nesting[1] in names
            )
            tensors: dict[str, torch.Tensor] = {}
            for conversion in members:
                tensor = state["model"][conversion.name]  # read twice by a tied copy
                tensors.update(zip(conversion.hf_names, to_hf(conversion, tensor, args, vocab)))
            file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
            write_shard(os.path.join(staging, file), tensors)
            weight_map.update(dict.fromkeys(tensors, file))
            sizes += [(t.numel(), t.numel() * t.element_size()) for t in tensors.values()]
            del state, tensors  # before the next group is read
        write_index(staging, weight_map, sum(size for _, size in sizes))
        with open(os.path.join(staging, CONFIG_FILENAME), "w", encoding="utf-8") as stream:
            json.dump(config, stream, indent=2, sort_keys=True)
            stream.write("\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    commit_checkpoint(staging, hf_dir)  # replaces an existing directory (--force) last
    print(f"> wrote {hf_dir}: {config['architectures'][0]}, {len(groups)} safetensors files")
    return {
        "path": hf_dir,
        "architecture": config["architectures"][0],
        "tensors": len(weight_map),
        "parameters": sum(count for count, _ in sizes),
        "bytes": sum(size for _, size in sizes),
    }


def _produce(weights: HFWeights, conversion: Conversion, args: Mapping[str, Any]) -> torch.Tensor:
    return to_megatron(conversion, [weights.read(name) for name in conversion.hf_names], args)


def _tensor_plan(
    args: Mapping[str, Any], config: Mapping[str, Any], vocab: int
) -> tuple[list[Conversion], dict[str, tuple[int, ...]]]:
    """Every tensor conversion of the model `args` describe, and the shapes of its Hugging Face
    tensors (with `vocab` embedding rows): DeepSeek-V3's (in the rotary layout `config` says)
    for multi-latent attention, else the Llama family's."""
    if args["multi_latent_attention"]:
        interleaved = deepseek_v3.rope_interleaved(config)
        return (
            deepseek_v3_tensors.conversions(args, interleaved),
            deepseek_v3_tensors.hf_shapes(args, interleaved, vocab),
        )
    return conversions(args), hf_shapes(args, vocab)


def _check_target_tp(target_tp: int, args: dict[str, Any], model_vocab: int) -> None:
    """Checks `--target-tp` against the sizes it splits. The checkpoint holds whole (global)
    tensors whatever the size: it loads at any tensor-parallel size that divides them."""
    if target_tp < 1:
        raise HFConversionError(f"--target-tp {target_tp}: give a positive tensor-parallel size.")
    sizes = {
        "num_attention_heads": args["num_attention_heads"],
        "num_key_value_heads": args["num_query_groups"],
        "intermediate_size": args["ffn_hidden_size"],
        "vocab_size": model_vocab,
        "shared_expert_intermediate_size": args.get("moe_shared_expert_intermediate_size"),
    }
    if args.get("moe_ffn_hidden_size") not in (None, args["ffn_hidden_size"]):
        # Qwen2-MoE's routed experts: expert tensor parallelism splits them by the same size.
        sizes["moe_intermediate_size"] = args["moe_ffn_hidden_size"]
    misfits = [f"{name} {size}" for name, size in sizes.items() if size and size % target_tp]
    if misfits:
        raise HFConversionError(
            f"--target-tp {target_tp} does not divide the model's {', '.join(misfits)} (each "
            "tensor-parallel rank holds an equal part); choose a tensor-parallel size that "
            "divides them."
        )


def _check_target_ep(target_ep: int, experts: int | None) -> None:
    """Checks `--target-ep` against the model's experts (None: a dense model). The checkpoint
    is the same at any value: it holds each expert tensor whole."""
    if target_ep < 1:
        raise HFConversionError(f"--target-ep {target_ep}: give a positive expert-parallel size.")
    if target_ep != 1 and experts is None:
        raise HFConversionError(
            f"--target-ep {target_ep}: the model is dense (no experts to split); convert with "
            "--target-ep 1."
        )
    if experts is not None and experts % target_ep:
        raise HFConversionError(
            f"--target-ep {target_ep} does not divide the model's {experts} experts (each "
            "expert-parallel rank holds as many); choose a divisor of "
            f"{experts}."
        )


def _tokenizer_vocab(hf_dir: str) -> int | None:
    """The number of ids of the tokenizer saved in `hf_dir` (None without one)."""
    if not any(os.path.isfile(os.path.join(hf_dir, name)) for name in TOKENIZER_FILES):
        return None
    from megatron.core.datasets.tokenizers.huggingface import HuggingFaceTokenizer

    try:
        return HuggingFaceTokenizer(hf_dir).vocab_size
    except ImportError as error:
        raise HFConversionError(
            f"{hf_dir} holds a tokenizer, whose ids size the vocabulary; reading it needs "
            "transformers: pip install transformers"
        ) from error
    except (OSError, ValueError) as error:
        raise HFConversionError(f"{hf_dir}'s tokenizer does not load: {error}") from error


def _check_weights(
    weights: HFWeights,
    expected: Mapping[str, tuple[int, ...]],
    plan: list[Conversion],
    args: Mapping[str, Any],
    hf_dir: str,
) -> None:
    """Checks that the weights are exactly the `expected` tensors in their shapes (copies of
    the embedding and output layer may be left out)."""
    _check_output_layer(weights, args, hf_dir)
    present = {name for name in weights.shapes if not name.endswith(IGNORED_SUFFIXES)}
    if not args["untie_embeddings_and_output_weights"]:
        present.discard("lm_head.weight")  # a copy of the tied embedding
    copies = {name for c in plan if c.layout == "copy" for name in c.hf_names}
    problems = []
    missing = sorted(expected.keys() - present - copies)
    unexpected = sorted(present - expected.keys())
    if missing:
        problems.append(f"missing {missing[:4]}")
    if unexpected:
        problems.append(f"not in a {args['num_layers']}-layer model: {unexpected[:4]}")
    problems += [
        f"{name} is {list(weights.shapes[name])}, not {list(shape)}"
        for name, shape in expected.items()
        if name in weights.shapes and weights.shapes[name] != shape
    ][:4]
    if problems:
        raise HFConversionError(
            f"{hf_dir}'s weights do not fit its config.json: {'; '.join(problems)}. Pass a "
            "directory whose config.json describes its weights."
        )


def _check_copies(weights: HFWeights, plan: list[Conversion], hf_dir: str) -> None:
    """Refuses a copy of the embedding or output layer (a multi-token prediction depth's
    `embed_tokens`, `shared_head.head`) that differs from it: this project's depths share them."""
    sources = {c.name: c.hf_names[0] for c in plan if c.layout == "vocab"}
    for conversion in plan:
        if conversion.layout != "copy":
            continue
        (copy,) = conversion.hf_names
        source = sources[conversion.name]
        if copy in weights.shapes and not weights.equal(copy, source):
            raise HFConversionError(
                f"{hf_dir}: {copy} differs from {source}; this project's multi-token prediction "
                "depths share the model's embedding and output layer, so they convert only where "
                f"the copies are equal (as DeepSeek-V3's are). Delete {copy} from the safetensors "
                "to import the model's own."
            )


def _check_output_layer(weights: HFWeights, args: Mapping[str, Any], hf_dir: str) -> None:
    """Refuses an output layer that `config.json`'s `tie_word_embeddings` contradicts.

    With `tie_word_embeddings` true and an `lm_head.weight` that is not the embedding,
    transformers 5 loads the two apart (and warns) while transformers 4 ties them and drops
    `lm_head.weight`: the directory is two different models, and which one was meant only the
    user knows (importing transformers 5's would also make export contradict the recorded
    config). With it false and no `lm_head.weight`, transformers initialises the output layer
    at random.
    """
    head, embedding = "lm_head.weight", "model.embed_tokens.weight"
    tied = not args["untie_embeddings_and_output_weights"]
    if tied and head in weights.shapes and embedding in weights.shapes:
        if not weights.equal(head, embedding):
            raise HFConversionError(
                f"{hf_dir}: config.json's tie_word_embeddings is true, but its weights hold an "
                f"{head} that differs from {embedding} (transformers 5 loads the two apart, "
                f"transformers 4 ties {head} to {embedding} and ignores the file's). Set "
                f"tie_word_embeddings to false in config.json if the model has an output layer "
                f"of its own, or delete {head} from the safetensors if it shares the embedding."
            )
    if not tied and head not in weights.shapes:
        raise HFConversionError(
            f"{hf_dir}: config.json's tie_word_embeddings is false (transformers' default where "
            f"it is left out), but its weights hold no {head} (transformers would initialise the "
            "output layer at random). Set tie_word_embeddings to true in config.json if the "
            f"output layer shares {embedding}, or add the model's {head}."
        )


def _check_flags_file(flags_file: str, force: bool) -> None:
    """Refuses a `--flags-file` that could not be written, before the checkpoint is."""
    if os.path.isdir(flags_file):
        raise HFConversionError(f"--flags-file {flags_file} is a directory; pass a file path.")
    if os.path.exists(flags_file) and not force:
        raise HFConversionError(
            f"--flags-file {flags_file} exists already; pass --force to replace it, or another "
            "--flags-file."
        )
    folder = os.path.dirname(os.path.abspath(flags_file))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise HFConversionError(
            f"--flags-file {flags_file}: its directory {folder} does not exist or is not "
            "writable; create it, or pass another --flags-file."
        )


def _report_flags(
    flags: list[str],
    args: Mapping[str, Any],
    config: Mapping[str, Any],
    model_vocab: int,
    save: str,
    flags_file: str | None,
) -> None:
    line = shlex.join(flags)
    if flags_file is not None:
        write_atomically(flags_file, lambda stream: stream.write(f"{line}\n".encode()))
    where = f" (also in {flags_file})" if flags_file else ""
    print(f"> model flags for pretrain_gpt.py{where}:\n{line}")
    stated = config.get("num_nextn_predict_layers")
    if args["multi_latent_attention"] and stated and args["mtp_num_layers"] is None:
        print(
            f"> config.json's num_nextn_predict_layers is {stated}, but the weights hold no "
            "multi-token prediction layer (transformers' save_pretrained leaves them out): "
            "imported without --mtp-num-layers"
        )
    if args["padded_vocab_size"] > model_vocab:
        print(
            f"> the tokenizer has more ids than the {model_vocab} embedding rows: the embedding "
            f"is padded with zero rows to {args['padded_vocab_size']} (export drops them)"
        )
    if "vocab_size" in args:
        print(
            f"> no tokenizer in the model directory: --vocab-size {model_vocab} serves "
            "--mock-data; for --data-path pass the model's tokenizer (--tokenizer-type "
            "HuggingFaceTokenizer --tokenizer-model DIR) instead"
        )
    print(
        f"> train from these weights: pretrain_gpt.py <flags> --load {save} --finetune --save DIR"
    )


def _export_config(
    common: Mapping[str, Any], hf_config: str | None, path: str, rows: int, dtype: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The `config.json` to export and the model flags' values it gives, checked against the
    checkpoint's saved flags."""
    # A checkpoint saved before the MoE (gpt-oss, MLA) flags existed is of a model without them.
    saved = {
        **DENSE_MOE_ARGS,
        **GPT_OSS_MODEL_ARGS,
        "multi_latent_attention": False,
        **(common.get("args") or {}),
    }
    if saved["num_experts"] is not None and saved["moe_ffn_hidden_size"] is None:
        saved["moe_ffn_hidden_size"] = saved.get("ffn_hidden_size")  # the flag's meaning of None
    if hf_config is not None:
        config, source = read_hf_config(hf_config), f"--hf-config {hf_config}"
    elif HF_CONFIG_KEY in common:
        config, source = dict(common[HF_CONFIG_KEY]), "the config recorded at import"
    else:
        missing = [name for name in ARCHITECTURE_ARGS if name not in saved]
        if missing:
            raise HFConversionError(
                f"{path} records neither a Hugging Face config nor the model's flags (it lacks "
                f"{missing[:3]}); pass the model's config.json with --hf-config."
            )
        config = hf_config_from_model_args(saved, rows, dtype)
        print(
            f"> config.json derived from the checkpoint's flags ({config['architectures'][0]}); "
            "pass --hf-config for the original model's (its name and special token ids)"
        )
        return config, model_args_from_hf_config(config)
    args = model_args_from_hf_config(config)
    names = [*ARCHITECTURE_ARGS, *(("rope_scaling_factor",) if args["use_rope_scaling"] else ())]
    if args["multi_latent_attention"] and saved["multi_latent_attention"]:
        names += MLA_MODEL_ARGS
    if args["position_embedding_type"] == "yarn":
        names += YARN_MODEL_ARGS
    # The model each side describes, not how its flags spell it (--moe-layer-freq 1 or [1,1]).
    was, now = ({**values, **resolved_moe_args(values)} for values in (saved, args))
    differ = [
        f"{name} {was[name]!r} (the config's: {now[name]!r})"
        for name in names
        if name in saved and was[name] != now[name]
    ]
    if differ:
        raise HFConversionError(
            f"{path} was saved with model flags that {source} does not describe: "
            f"{'; '.join(differ)}. Pass the config.json of this model with --hf-config."
        )
    print(f"> config.json: {source}")
    return config, args


def _check_saved(
    saved: Mapping[str, TensorStorageMetadata],
    plan: list[Conversion],
    shapes: Mapping[str, tuple[int, ...]],
    args: Mapping[str, Any],
    path: str,
) -> None:
    """Checks that the checkpoint holds exactly the model's tensors, in the config's shapes
    (`shapes`: those of the Hugging Face tensors)."""
    expected = {
        conversion.name: to_megatron(
            conversion,
            [torch.empty(shapes[name], device="meta") for name in conversion.hf_names],
            args,
        ).shape
        for conversion in plan
    }
    missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved - expected.keys())
    problems = [f"missing {missing[:4]}"] if missing else []
    if unexpected:
        problems.append(f"not in the config's model: {unexpected[:4]}")
    problems += [
        f"{name} is {list(saved[name].size)}, not {list(shape)}"
        for name, shape in expected.items()
        if name in saved and saved[name].size != shape
    ][:4]
    if problems:
        raise HFConversionError(
            f"{path} does not fit the config.json: {'; '.join(problems)}. Pass the config of "
            "this model with --hf-config."
        )


def _check_output_dir(hf_dir: str, load: str, force: bool) -> None:
    target, source = os.path.realpath(hf_dir), os.path.realpath(load)
    if os.path.commonpath([target, source]) in (target, source):
        raise HFConversionError(
            f"--hf-dir {hf_dir} and --load {load} are one inside the other; export into a "
            "directory of its own."
        )
    if os.path.isfile(hf_dir):
        raise HFConversionError(f"--hf-dir {hf_dir} is a file; pass a directory.")
    if os.path.isdir(hf_dir) and os.listdir(hf_dir) and not force:
        raise HFConversionError(
            f"--hf-dir {hf_dir} exists and is not empty; pass --force to replace it, or another "
            "--hf-dir."
        )
