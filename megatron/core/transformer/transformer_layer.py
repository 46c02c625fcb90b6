"""One pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x)).

Hidden states are in Megatron's [s, b, h] layout ([s/T, b, h] on each of T tensor-parallel
ranks under sequence parallelism). Each `TransformerLayer` is the unit that data parallel
engines shard (FSDP) and that full activation recompute checkpoints.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule, resolve_tp_group
from megatron.core.transformer.moe.experts import ExpertGemm
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.recompute import recompute as recompute_checkpoint
from megatron.core.transformer.spec_utils import ModuleSpec, build_module, get_module
from megatron.core.transformer.transformer_config import TransformerConfig, recomputes


@dataclass
class TransformerLayerSubmodules:
    """Specs of the parts of a `TransformerLayer`.

    Attributes:
        input_layernorm: Norm before attention; `IdentityOp` when the QKV projection fuses it.
        self_attention: The attention block (e.g. a `SelfAttention` spec).
        pre_mlp_layernorm: Norm before the MLP; `IdentityOp` when fc1 fuses it.
        mlp: The MLP block (e.g. an `MLP` or `MoELayer` spec).
    """

    input_layernorm: ModuleSpec | type = IdentityOp
    self_attention: ModuleSpec | type | None = None
    pre_mlp_layernorm: ModuleSpec | type = IdentityOp
    mlp: ModuleSpec | type | None = None


class TransformerLayer(MegatronModule):
    """A pre-norm transformer layer with dropout on each residual branch.

    Args:
        config: The transformer configuration.
        submodules: Specs of the layer's parts.
        layer_number: 1-based index of the layer in the model.
        hidden_dropout: Dropout on the residual branches; None means `config.hidden_dropout`.
        pg_collection: Process groups: `tp` splits attention and the MLP (see
            `resolve_tp_group`), `ep` the experts of an `MoELayer` MLP; None means
            parallel_state's.

    Raises:
        ValueError: `apply_residual_connection_post_layernorm` is asked of a spec whose norms are
            fused into the linears (the normalised activations are then never materialised).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        *,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout

        tp_group = resolve_tp_group(pg_collection)
        norm_kwargs = dict(
            config=config,
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
            # Under sequence parallelism each rank normalises its part of the sequence.
            tp_group=tp_group if config.sequence_parallel else None,
        )
        self.input_layernorm = build_module(submodules.input_layernorm, **norm_kwargs)
        self.self_attention = build_module(
            submodules.self_attention,
            config=config,
            layer_number=layer_number,
            pg_collection=pg_collection,
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, **norm_kwargs)
        self.is_moe_layer = issubclass(get_module(submodules.mlp), MoELayer)
        if self.is_moe_layer:
            self.mlp = build_module(
                submodules.mlp,
                config=config,
                layer_number=layer_number,
                pg_collection=pg_collection,
            )
        else:
            self.mlp = build_module(submodules.mlp, config=config, tp_group=tp_group)

        fused_norm = isinstance(self.input_layernorm, IdentityOp) or isinstance(
            self.pre_mlp_layernorm, IdentityOp
        )
        if config.apply_residual_connection_post_layernorm and fused_norm:
            raise ValueError(
                "apply_residual_connection_post_layernorm=True needs separate norm modules, but "
                "this layer spec fuses the norms into the linear layers (e.g. the Transformer "
                "Engine spec); use the local spec or set it to False."
            )
        # Selective recompute, decided once rather than in every forward. A norm fused into the
        # next linear (`IdentityOp`) has nothing to recompute, as in Megatron-LM.
        recompute_norms = recomputes(config, "layernorm")
        self.recompute_input_layernorm = recompute_norms and not isinstance(
            self.input_layernorm, IdentityOp
        )
        self.recompute_pre_mlp_layernorm = recompute_norms and not isinstance(
            self.pre_mlp_layernorm, IdentityOp
        )
        # "mlp" is the dense MLP; an MoE layer recomputes itself ("moe", "shared_experts").
        self.recompute_mlp = recomputes(config, "mlp") and not self.is_moe_layer

    def _bias_dropout_add(
        self, output: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        if bias is not None:
            output = output + bias
        if self.hidden_dropout > 0 and self.training:  # a no-op otherwise, still dispatched
            output = F.dropout(output, p=self.hidden_dropout)
        return residual + output

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs attention and MLP, each with its residual connection; compiled with
        `torch.compile` when `config.compile_layers` (the module's hooks, e.g. a data-parallel
        engine's, run outside the compiled code).

        Args:
            hidden_states: [s, b, h] ([s/T, b, h] under sequence parallelism).
            attention_mask: None for causal attention, or a boolean mask (True = masked out).
            rotary_pos_emb: Rotary angles [s, 1, 1, rot_dim], or None.

        Returns:
            `(hidden_states, context)`, Megatron-LM's layer output: hidden states [s, b, h] and
            the cross-attention context, always None here (self-attention only).
        """
        run = type(self)._forward
        if self.config.compile_layers:
            backend = self.config.compile_backend
            cpp_wrapper = (
                self.config.compile_cpp_wrapper
                and backend == "inductor"
                and hidden_states.is_cuda
                and self._cpp_wrapper_builds()
            )
            run = _compiled(run, backend, cpp_wrapper)
        return run(self, hidden_states, attention_mask, rotary_pos_emb), None

    def _forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_pos_emb: torch.Tensor | None,
    ) -> torch.Tensor:
        post_norm_residual = self.config.apply_residual_connection_post_layernorm
        # Without dropout between them, a block's output projection adds the residual itself,
        # in its GEMM where it can (`RowParallelLinear`'s `residual`): no kernel and no autograd
        # node of its own.
        adds_residual = not (self.hidden_dropout > 0 and self.training)

        normed = self._run(self.input_layernorm, self.recompute_input_layernorm, hidden_states)
        residual = normed if post_norm_residual else hidden_states
        if adds_residual and getattr(self.self_attention, "adds_residual", False):
            hidden_states, _ = self.self_attention(
                normed,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                residual=residual,
            )
        else:
            output, bias = self.self_attention(
                normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb
            )
            hidden_states = self._bias_dropout_add(output, bias, residual)

        normed = self._run(self.pre_mlp_layernorm, self.recompute_pre_mlp_layernorm, hidden_states)
        residual = normed if post_norm_residual else hidden_states
        if adds_residual and not self.recompute_mlp and getattr(self.mlp, "adds_residual", False):
            hidden_states, _ = self.mlp(normed, residual=residual)
            return hidden_states
        output, bias = self._run(self.mlp, self.recompute_mlp, normed)
        return self._bias_dropout_add(output, bias, residual)

    def _cpp_wrapper_builds(self) -> bool:
        """Whether inductor's C++ wrapper builds for this layer's graphs in this torch. Before
        2.12 it calls `torch._grouped_mm` through a C shim function that torch's headers do not
        declare, so a layer whose experts run grouped GEMMs keeps the Python wrapper there, in
        every dtype (said once in a warning)."""
        if _CPP_WRAPPER_CALLS_GROUPED_MM or not self.is_moe_layer:
            return True
        if self.mlp.experts.gemm is not ExpertGemm.GROUPED:
            return True
        _warn_python_wrapper_for_grouped_mm()
        return False

    def _run(
        self, module: torch.nn.Module, recompute: bool, inputs: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """`module(inputs)`, checkpointed when `recompute` (in training, with autograd on): only
        the input is stored, and the module runs again in backward (non-reentrant, so hooks and
        the RNG state are replayed)."""
        if recompute and self.training and torch.is_grad_enabled():
            return recompute_checkpoint(module, inputs)
        return module(inputs)


_CPP_WRAPPER_CALLS_GROUPED_MM = torch.__version__ >= "2.12"
"""Whether inductor's C++ wrapper can call `torch._grouped_mm`: its CUDA C shim has the function
from torch 2.12 (`TransformerLayer._cpp_wrapper_builds`)."""


@functools.cache
def _warn_python_wrapper_for_grouped_mm() -> None:
    """Says once per process that grouped-GEMM MoE layers keep the Python wrapper (cached:
    Python's once-per-location filter let the warning through at several iterations of a run
    that compiled layers)."""
    warnings.warn(
        "compile_cpp_wrapper: the compiled MoE layers with grouped GEMM experts use inductor's "
        f"Python wrapper, as the C++ wrapper of torch {torch.__version__} cannot call "
        "torch._grouped_mm (torch 2.12 and later can); the other layers keep the C++ one.",
        stacklevel=2,
    )


@functools.cache
def _compiled(
    function: Callable[..., torch.Tensor], backend: str, cpp_wrapper: bool
) -> Callable[..., torch.Tensor]:
    """`function` (a layer class's `_forward`) compiled with `backend`: one compiled function
    for every layer, whose graphs the layers of one shape share (their parameters are inputs of
    the graphs, not constants). `cpp_wrapper` (inductor only) generates the graphs' wrappers
    in C++."""
    options = _cpp_wrapper_options() if cpp_wrapper else None
    return torch.compile(function, backend=backend, options=options)


def _cpp_wrapper_options() -> dict[str, object]:
    """Inductor's options for a C++ wrapper: `cpp_wrapper` and the settings inductor's own
    `get_cpp_wrapper_config` gives the wrapper in this torch (as its `TORCHINDUCTOR_CPP_WRAPPER=1`
    does), for every graph. Torch 2.11 applies those settings to the forward graph only, not to
    the backward, which it compiles at the first backward, whose wrapper then finds no kernel
    binaries to launch; later versions apply them to both graphs themselves, and the same
    settings given here change nothing there."""
    from torch._inductor.compile_fx import get_cpp_wrapper_config

    return {"cpp_wrapper": True, **get_cpp_wrapper_config()}
