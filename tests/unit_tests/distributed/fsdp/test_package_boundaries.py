"""The boundaries of the Megatron-FSDP package: no import cycles among its modules (counting
imports under `TYPE_CHECKING` and inside functions), and a narrow public `__init__`."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest

import megatron.core.distributed.fsdp as fsdp

PACKAGE = "megatron.core.distributed.fsdp"
ROOT = pathlib.Path(fsdp.__file__).parent


def _module_graph(directory: pathlib.Path, package: str) -> dict[str, set[str]]:
    """Each module of the tree at `directory` (importable as `package`) -> the modules of the
    tree it imports, anywhere in its text. A package's `__init__` is the package's name, so a
    module importing a name from a package depends on everything that `__init__` imports."""
    modules = {}
    for path in directory.rglob("*.py"):
        parts = path.relative_to(directory).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        found.add(full)
                    elif node.module in modules:
                        found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = found - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles_inside_the_package():
    graph = _module_graph(ROOT, PACKAGE)
    importing_init = sorted(name for name, deps in graph.items() if PACKAGE in deps)
    assert importing_init == [], f"modules importing the package's __init__: {importing_init}"
    assert _cycles(graph) == []


def test_no_import_cycles_between_the_engines():
    # Both engines, the interface the optimizer sees them through, and what they share.
    assert _cycles(_module_graph(ROOT.parent, "megatron.core.distributed")) == []


def test_cycle_finder_sees_a_cycle():
    # The check above could not fail if the finder missed cycles.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_public_names_are_narrow():
    assert sorted(fsdp.__all__) == [
        "FSDPDistributedIndex",
        "FsdpModule",
        "FullyShardedDataParallel",
        "MixedPrecisionPolicy",
        "OverlapPolicy",
        "ShardingStrategy",
        "accumulation_memory",
        "fully_shard",
        "fully_shard_optimizer",
        "local_main_weights",
        "microbatch",
        "set_profiler_labels",
        "unit_memory",
    ]
    for name in fsdp.__all__:
        assert getattr(fsdp, name) is not None


def test_former_exports_still_resolve_with_a_warning():
    from megatron.core.distributed.fsdp.dbuffer import DBuffer
    from megatron.core.distributed.fsdp.roots import fsdp_roots

    with pytest.warns(DeprecationWarning, match="fsdp.roots"):
        assert fsdp.fsdp_roots is fsdp_roots
    with pytest.warns(DeprecationWarning, match="fsdp.dbuffer"):
        from megatron.core.distributed.fsdp import DBuffer as old
    assert old is DBuffer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_name"):
            fsdp.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "path",
    [
        "megatron/core/optimizer/optimizer.py",
        "megatron/training/schedules.py",
        "megatron/core/pipeline_parallel/microbatch_loss.py",
    ],
)
def test_callers_do_not_ask_which_engine_they_hold(path):
    # They reach either engine through `engine.DataParallelEngine` (or `no_sync()`), so they
    # import neither wrapper class nor Megatron-FSDP's internals.
    tree = ast.parse((ROOT.parents[3] / path).read_text())
    imported = {
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    engine_names = {
        name
        for name in imported
        if name.startswith(PACKAGE)
        or name.endswith((".DistributedDataParallel", ".FullyShardedDataParallel"))
        or name.endswith("._BaseDataParallel")
    }
    assert engine_names == set()
