"""`compile_layers`: transformer layers compiled by `torch.compile` train as the eager model
does, alone (recompute, dropout, MoE, gpt-oss's windows and sinks) and under the DDP engine and
Megatron-FSDP, whose hooks stay outside the compiled code; gradient-accumulation fusion keeps
working inside the compiled graph, and each layer is one graph with or without it.

Most cases compile with the `aot_eager` backend: it traces, splits at the graph breaks and
differentiates as `inductor` does, but runs PyTorch's own kernels, so the results equal the
eager model's. `inductor` itself is checked on CPU (where a C++ compiler exists; once with its
C++ wrapper forced, which layers ask for on CUDA only) and on GPU with either wrapper.
"""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from megatron.core.activations import quick_gelu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp import FullyShardedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import grad_accumulation
from megatron.core.transformer import transformer_layer
from megatron.core.transformer.transformer_config import inductor_finds_cpp_compiler
from tests.unit_tests.distributed.fsdp.fsdp_training import (
    GLOBAL_BATCH,
    MEGATRON_LOOP_MICROBATCHES,
    STEPS,
    megatron_loop,
)
from tests.unit_tests.distributed_harness import current_device, run_distributed
from tests.unit_tests.model_builders import (
    SEQ_LENGTH,
    VOCAB_SIZE,
    build_tiny_gpt,
    make_token_batches,
    tiny_gpt_config,
)
from tests.unit_tests.models.test_gpt_moe import MOE
from tests.unit_tests.training.test_cuda_graph_training import (
    BASE,
    ENGINES,
    GRAPHED,
    NO_DROPOUT,
    _assert_same_training,
    _pretrain,
    _pretrain_graphed,
)

_GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CASES = {
    "plain": {},
    "selective-recompute": dict(
        recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]
    ),
    "full-recompute": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    ),
    "dropout": dict(hidden_dropout=0.1, attention_dropout=0.1),
    "swiglu-rmsnorm": dict(gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm"),
    "moe": MOE,
    "moe-grouped": dict(MOE, moe_grouped_gemm=True),
    "gpt-oss": dict(
        num_query_groups=2,
        window_size=(3, 0),
        window_attn_skip_freq=2,
        softmax_type="learnable",
        gated_linear_unit=True,
        activation_func=quick_gelu,
        glu_linear_offset=1.0,
        activation_func_clamp_value=7.0,
    ),
}


def _build(
    fields: dict,
    compiled: bool,
    backend: str = "aot_eager",
    device: torch.device | None = None,
) -> GPTModel:
    """The tiny GPT of `fields` on `device` (None: the rank's, `current_device()`)."""
    config = tiny_gpt_config(compile_layers=compiled, compile_backend=backend, **fields)
    device = current_device() if device is None else device
    if config.num_moe_experts is None:
        return build_tiny_gpt(config, position_embedding_type="rope").to(device)
    torch.manual_seed(1234)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        position_embedding_type="rope",
    ).to(device)


def _train_alone(fields: dict, compiled: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """AdamW steps on the whole batch in one process: the losses and the final weights."""
    model = _build(fields, compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, (tokens, labels) in enumerate(make_token_batches(STEPS, GLOBAL_BATCH)):
        torch.manual_seed(step)  # the same dropout masks in both runs
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_layers_train_like_eager_ones(case, fusion):
    """With fusion and no engine, the fusing linears' weight gradients reach `.grad` from
    their operator's backward."""
    fields = dict(CASES[case], gradient_accumulation_fusion=fusion)
    eager_losses, eager_weights = _train_alone(fields, compiled=False)
    losses, weights = _train_alone(fields, compiled=True)
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    initial = _build(fields, compiled=False).state_dict()
    assert all(not torch.equal(weight, initial[name]) for name, weight in weights.items())
    for name, weight in eager_weights.items():
        torch.testing.assert_close(weights[name], weight, msg=name)


@pytest.mark.skipif(
    not torch.cuda.is_available() and not inductor_finds_cpp_compiler(),
    reason="inductor on CPU needs a C++ compiler",
)
@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize(
    "case",
    # The other cases compile for minutes on CPU; on CUDA they run inductor's C++ wrapper (the
    # default there) around the MoE layer's routing and experts (grouped GEMMs in fp32: the
    # masked GEMMs, as the grouped GEMM traces in bf16 only), FlexAttention's windows and
    # sinks, and a recomputed layer.
    ["plain"]
    + [
        pytest.param(name, marks=_GPU_ONLY)
        for name in ("swiglu-rmsnorm", "full-recompute", "moe", "moe-grouped", "gpt-oss")
    ],
)
def test_inductor_layers_compute_the_eager_loss_and_gradients(case, fusion):
    """Generated kernels reorder fp32 sums (a layer norm's, a fused bias gradient's), so the
    bound is fp32 reassociation across a 2-layer model, not bitwise equality. With fusion and
    no engine the weight gradients reach `.grad`, as autograd's would. On a machine with a GPU
    the model runs there (this process has no process group to say so)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    tokens, labels = tokens.to(device), labels.to(device)
    fields = dict(CASES[case], gradient_accumulation_fusion=fusion)
    results = []
    for compiled in (False, True):
        model = _build(fields, compiled, backend="inductor", device=device)
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_moe_layers_with_grouped_gemm_compute_the_eager_results():
    """`torch._grouped_mm` traces in bf16 only, so this case runs in bf16, where inductor's
    fused kernels round differently from eager ops (they keep intermediates in fp32): the
    compiled layers' loss and each gradient must be as close to an fp32 run of the same
    weights as the eager bf16 layers' are, within twice their distance. Every token goes to
    every expert: with fewer, a token whose scores nearly tie is routed by rounding, which
    moves the gradients far more than rounding itself does."""
    device = torch.device("cuda")
    tokens, labels = (t.to(device) for t in make_token_batches(1, GLOBAL_BATCH)[0])
    fields = dict(MOE, moe_grouped_gemm=True, moe_router_topk=MOE["num_moe_experts"])
    bf16 = dict(fields, bf16=True, params_dtype=torch.bfloat16)
    eager = _build(bf16, compiled=False, backend="inductor", device=device)
    weights = eager.state_dict()
    compiled = _build(bf16, compiled=True, backend="inductor", device=device)
    compiled.load_state_dict(weights)
    reference = _build(fields, compiled=False, backend="inductor", device=device)
    reference.load_state_dict(
        {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    )
    results = []
    for model in (reference, eager, compiled):
        loss = model(tokens, labels=labels).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (eager_loss, eager_grads), (loss, grads) = results
    assert (loss - ref_loss).abs() <= 2 * (eager_loss - ref_loss).abs() + 1e-3 * ref_loss.abs()
    for name, ref in ref_grads.items():
        bound = 2 * (eager_grads[name] - ref).norm() + 1e-3 * ref.norm()
        assert (grads[name] - ref).norm() <= bound, name


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=_GPU_ONLY),
    ],
)
def test_only_inductor_on_cuda_inputs_asks_for_the_cpp_wrapper(device):
    """The C++ wrapper is inductor's, and is asked for on CUDA only (on the CPU its build costs
    more compile time than its launches save host time); `compile_cpp_wrapper=False` turns it
    off."""
    tokens, labels = (t.to(device) for t in make_token_batches(1, GLOBAL_BATCH)[0])
    cases = [
        ("aot_eager", True, False),
        ("inductor", True, device == "cuda"),
        ("inductor", False, False),
    ]
    for backend, cpp_wrapper, expected in cases:
        fields = dict(compile_cpp_wrapper=cpp_wrapper)
        model = _build(fields, compiled=True, backend=backend).to(device)
        with mock.patch.object(
            transformer_layer, "_compiled", side_effect=lambda function, *_: function
        ) as compiled:
            model(tokens, labels=labels)
        assert compiled.call_args_list == [mock.call(mock.ANY, backend, expected)] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("calls_grouped_mm", [False, True])
def test_grouped_gemm_layers_keep_the_python_wrapper_where_it_cannot_call_grouped_mm(
    calls_grouped_mm,
):
    """Torch 2.11's C++ wrapper calls `torch._grouped_mm` through a C shim function its
    headers lack, and does not build: there the layers whose experts run grouped GEMMs ask for
    the Python wrapper, with a warning, and the dense layers keep the C++ one."""
    tokens, labels = (t.cuda() for t in make_token_batches(1, GLOBAL_BATCH)[0])
    fields = dict(MOE, moe_grouped_gemm=True, moe_layer_freq=[1, 0])
    model = _build(fields, compiled=True, backend="inductor", device=torch.device("cuda"))
    transformer_layer._warn_python_wrapper_for_grouped_mm.cache_clear()
    with (
        mock.patch.object(transformer_layer, "_CPP_WRAPPER_CALLS_GROUPED_MM", calls_grouped_mm),
        mock.patch.object(
            transformer_layer, "_compiled", side_effect=lambda function, *_: function
        ) as compiled,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        model(tokens, labels=labels)
    expected = [(True, calls_grouped_mm), (False, True)]
    assert [
        (layer.is_moe_layer, call.args[2])
        for layer, call in zip(model.decoder.layers, compiled.call_args_list, strict=True)
    ] == expected
    said = [str(w.message) for w in caught if "torch._grouped_mm" in str(w.message)]
    assert len(said) == (0 if calls_grouped_mm else 1)


def test_the_cpp_wrapper_without_a_cpp_compiler_names_the_fix():
    """On CUDA machines the config checks for inductor's C++ compiler, which the wrapper needs:
    its absence is an error naming the flag that does without it."""
    from megatron.core.transformer import transformer_config

    def config(**fields):
        transformer_config._check_cpp_compiler.cache_clear()
        return tiny_gpt_config(compile_layers=True, compile_backend="inductor", **fields)

    with torch._inductor.config.patch({"cpp.cxx": (None, "no-such-compiler++")}):
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            with pytest.raises(ValueError, match=r"no-such-compiler.*--no-compile-cpp-wrapper"):
                config()
            assert not config(compile_cpp_wrapper=False).compile_cpp_wrapper
        with mock.patch.object(torch.cuda, "is_available", return_value=False):
            assert config().compile_cpp_wrapper  # no CUDA: the wrapper is Python, no check
    transformer_config._check_cpp_compiler.cache_clear()


def test_the_backward_operator_sends_no_gradient_while_inductor_runs_a_sample():
    """Inductor may run a graph's Python form on sample tensors to learn what its C++ wrapper
    launches (its two-pass route); the fusing linear's backward operator then returns the input
    gradient and sends no weight gradient. Outside such a run and outside the layer's backward,
    it is an error."""
    from torch._inductor.virtualized import V

    generator = torch.Generator().manual_seed(0)
    grad_output, input_ = torch.randn(2, 3, 6, generator=generator).unbind()
    weight = torch.nn.Parameter(torch.randn(6, 8, generator=generator))
    backward = torch.ops.megatron.linear_into_main_grad_backward
    with pytest.raises(RuntimeError, match="ran outside the backward of the linear layer"):
        backward(grad_output, input_, weight)
    with V.set_graph_handler(object()):
        grad_input = backward(grad_output, input_, weight)
    torch.testing.assert_close(grad_input, grad_output @ weight, rtol=0, atol=0)
    assert weight.grad is None


@pytest.mark.parametrize(
    "device, cpp_wrapper",
    [
        pytest.param(
            "cpu",
            True,
            marks=pytest.mark.skipif(
                not inductor_finds_cpp_compiler(), reason="inductor on CPU needs a C++ compiler"
            ),
            id="cpu-cpp-wrapper",
        ),
        pytest.param("cuda", True, marks=_GPU_ONLY, id="cuda-cpp-wrapper"),
        pytest.param("cuda", False, marks=_GPU_ONLY, id="cuda-python-wrapper"),
    ],
)
def test_inductor_layers_send_each_weight_gradient_once(device, cpp_wrapper):
    """Inductor with the wrapper in C++ (the default on CUDA; on the CPU, where layers do not
    ask for it, forced, which runs this torch's handling of the wrapper's backward) or in Python,
    fusion on and no engine: two backwards compute each of the 2 layers' 4 weight gradients once
    each, reaching `.grad` as the eager model's do. Inductor's caches are off so that it
    generates (and the test counts) both graphs' wrappers."""
    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()
    tokens, labels = (t.to(device) for t in make_token_batches(1, GLOBAL_BATCH)[0])
    fields = dict(gradient_accumulation_fusion=True, compile_cpp_wrapper=cpp_wrapper)
    models = [
        _build(fields, compiled=False).to(device),
        _build(fields, compiled=True, backend="inductor").to(device),
    ]
    for _ in range(2):
        models[0](tokens, labels=labels).mean().backward()
    codegen, compiled = GraphLowering.codegen_with_cpp_wrapper, transformer_layer._compiled
    cpp_codegens = []

    def counting_codegen(graph: GraphLowering) -> object:
        cpp_codegens.append(graph)
        return codegen(graph)

    def forced_cpp_wrapper(function: Callable, backend: str, _: bool) -> Callable:
        return compiled(function, backend, cpp_wrapper)

    with (
        torch._inductor.config.patch(force_disable_caches=True),
        mock.patch.object(GraphLowering, "codegen_with_cpp_wrapper", counting_codegen),
        mock.patch.object(transformer_layer, "_compiled", side_effect=forced_cpp_wrapper),
        mock.patch.object(
            grad_accumulation, "weight_grad_into", wraps=grad_accumulation.weight_grad_into
        ) as weight_grad_into,
    ):
        for _ in range(2):
            models[1](tokens, labels=labels).mean().backward()
    assert len(cpp_codegens) == (2 if cpp_wrapper else 0)  # the forward's and backward's
    assert weight_grad_into.call_count == 2 * 2 * 4
    eager, compiled = ({n: p.grad for n, p in model.named_parameters()} for model in models)
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _layer_weight(model: GPTModel) -> torch.nn.Parameter:
    return model.decoder.layers[0].mlp.linear_fc1.weight


def test_fused_weight_gradients_without_an_engine_accumulate_into_grad_as_autograd_does():
    """Compiled layers with fusion on and no engine: each weight gradient goes to `.grad`,
    added to one already there, as the eager model's (plain `F.linear` without an engine).
    The compiled layers' linears compute them in their backward operator."""
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    grads, computed = [], []
    for compiled in (False, True):
        model = _build(dict(gradient_accumulation_fusion=True), compiled)
        with mock.patch.object(
            grad_accumulation, "weight_grad_into", wraps=grad_accumulation.weight_grad_into
        ) as weight_grad_into:
            for _ in range(2):  # the second backward adds to the first's `.grad`
                model(tokens, labels=labels).mean().backward()
        computed.append(weight_grad_into.call_count)
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert computed == [0, 2 * 2 * 4]  # 2 backwards of 2 layers of 4 linears
    eager, compiled = grads
    assert all(grad is not None for grad in compiled.values())
    for name, grad in eager.items():
        torch.testing.assert_close(compiled[name], grad, rtol=0, atol=0, msg=name)


def test_a_backward_that_leaves_the_weights_out_gives_them_no_gradient():
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    results = []
    for compiled in (False, True):
        model = _build(dict(gradient_accumulation_fusion=True), compiled)
        embedded = []
        model.embedding.register_forward_hook(lambda m, a, out, kept=embedded: kept.append(out))
        loss = model(tokens, labels=labels).mean()
        (grad,) = torch.autograd.grad(loss, embedded)
        assert all(p.grad is None for p in model.parameters())
        results.append(grad)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_asking_autograd_grad_for_a_fused_weight_of_a_compiled_layer_names_the_fix():
    """Such a weight's gradient is accumulated, never returned: `torch.autograd.grad` asking
    for it gets an error that names the flag to turn off, not a silent None."""
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    model = _build(dict(gradient_accumulation_fusion=True), compiled=True)
    loss = model(tokens, labels=labels).mean()
    with pytest.raises(RuntimeError, match="--no-gradient-accumulation-fusion"):
        torch.autograd.grad(loss, [_layer_weight(model)])
    model = _build(dict(gradient_accumulation_fusion=False), compiled=True)
    (grad,) = torch.autograd.grad(model(tokens, labels=labels).mean(), [_layer_weight(model)])
    assert grad.abs().sum() > 0


def _fusing(input_: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad_accumulation.linear(input_, weight, fusion=True)


# A weight applied twice to one input (two calls of the backward operator with the same
# arguments, which a compiler must not merge), and an input reached through an operator whose
# derivative is zero (the operator's input gradient is unused, and must not be dropped with it).
TRACED_FUNCTIONS = {
    "twice": lambda x, w: _fusing(x, w) + _fusing(x, w),
    "zero-derivative": lambda x, w: _fusing(torch.round(x), w) + x.sum(),
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("function", list(TRACED_FUNCTIONS))
def test_compiled_fusing_linears_give_every_weight_gradient(function, backend):
    if backend == "inductor" and not inductor_finds_cpp_compiler():
        pytest.skip("inductor on CPU needs a C++ compiler")
    torch._dynamo.reset()
    fn = TRACED_FUNCTIONS[function]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    grads = []
    for run in (fn, torch.compile(fn, backend=backend)):
        weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 48).reshape(6, 8))
        run(x, weight).square().sum().backward()
        grads.append(weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


def test_a_compiled_model_and_its_weights_are_freed():
    """The operator's per-graph cache holds nothing past the graph's life."""
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    model = _build(dict(gradient_accumulation_fusion=True), compiled=True)
    model(tokens, labels=labels).mean().backward()
    weight = weakref.ref(_layer_weight(model))
    del model
    torch._dynamo.reset()
    gc.collect()
    assert weight() is None


def _compiled_graphs(fields: dict) -> tuple[int, int]:
    """How many graphs a forward and backward of the 2-layer model compiles, and at how many
    graph breaks."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    tokens, labels = make_token_batches(1, GLOBAL_BATCH)[0]
    _build(fields, compiled=True)(tokens, labels=labels).mean().backward()
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def test_a_layer_compiles_into_one_graph_with_and_without_fusion():
    """The linears trace into the layer's graph, the fusing ones as an operator whose backward
    sends the weight gradient where the engine says: one graph, shared by the layers, no graph
    break either way."""
    assert _compiled_graphs(dict(gradient_accumulation_fusion=False)) == (1, 0)
    assert _compiled_graphs(dict(gradient_accumulation_fusion=True)) == (1, 0)


def _train_engine(engine: str) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Compiled layers under `engine` ("ddp", or a Megatron-FSDP sharding strategy with the
    whole gradient sums its fusion writes into) in Megatron's loop, SGD on the engine's
    gradients.

    Returns every global weight, and per microbatch how many linears fused their weight
    gradient into the engine's sums in its backward."""
    model = _build(dict(gradient_accumulation_fusion=True), compiled=True)
    if engine == "ddp":
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
        wrapped = DistributedDataParallel(model.config, ddp_config, model)
    else:
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy=engine,
            grad_reduce_in_fp32=True,
            megatron_fsdp_accumulate_unsharded_grads=True,
        )
        wrapped = FullyShardedDataParallel(model.config, ddp_config, model)

    def step(optimizer: torch.optim.Optimizer) -> None:
        if engine == "ddp":  # its reduced gradients are in `main_grad`
            for param in model.parameters():
                param.grad = param.main_grad
        optimizer.step()
        optimizer.zero_grad()

    # Fusions so far at each forward: a microbatch's backward runs before the next forward.
    fusions_at_forward = []
    with mock.patch.object(grad_accumulation, "_fuse", wraps=grad_accumulation._fuse) as counter:
        model.register_forward_hook(lambda *_: fusions_at_forward.append(counter.call_count))
        megatron_loop(wrapped, torch.optim.SGD(model.parameters(), lr=0.5), step)
    counts = [*fusions_at_forward, counter.call_count]
    fused = [after - before for before, after in zip(counts, counts[1:])]
    state = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return state, fused


def _train_reference() -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process, eager: SGD on the whole batch of each step."""
    model = _build({}, compiled=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for tokens, labels in make_token_batches(STEPS, GLOBAL_BATCH):
        model(tokens, labels=labels).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# Linears fusing per backward: every one of the 2 layers' 4 linears and the output layer's
# under DDP; under Megatron-FSDP none in a step's first microbatch (its whole sums do not exist
# yet), all from the second on.
N = MEGATRON_LOOP_MICROBATCHES
FUSED = {"ddp": [9] * N, "optim_grads_params": [0] + [9] * (N - 1)}


@pytest.mark.parametrize("engine", list(FUSED))
def test_compiled_layers_under_an_engine_equal_one_eager_process(engine):
    expected = _train_reference()
    for state, fused in run_distributed(_train_engine, 2, engine):
        assert fused == FUSED[engine] * STEPS
        assert state.keys() == expected.keys()
        for name, weight in expected.items():
            torch.testing.assert_close(state[name], weight, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine", ["fsdp_zero3", "ddp"])
def test_compiled_layers_in_a_graphed_iteration_train_as_they_do_eagerly(engine):
    """`pretrain_gpt.py --compile-layers` (inductor) on one GPU, 2 microbatches: the whole
    iteration in a CUDA graph trains bitwise as the eager iteration (deterministic kernels; the
    layers compile in the eager warm-up steps, before the capture), and the compiled training
    follows the uncompiled one to bf16 precision."""
    flags = [*BASE, *NO_DROPOUT, *ENGINES[engine], "--global-batch-size", "4"]
    compiled = [*flags, "--compile-layers"]
    eager = run_distributed(_pretrain, 1, compiled)
    ((graphed, replays),) = run_distributed(_pretrain_graphed, 1, [*compiled, *GRAPHED])
    assert replays > 0
    _assert_same_training(eager, [graphed])
    (uncompiled,) = run_distributed(_pretrain, 1, flags)
    assert len(set(uncompiled.loss_curve())) == 8  # it trained
    assert eager[0].loss_curve() == pytest.approx(uncompiled.loss_curve(), rel=2e-3)
