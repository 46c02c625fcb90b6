"""Compares this project's flags with upstream Megatron-LM's, from upstream's source, by AST.

    UPSTREAM=/path/to/Megatron-LM/.git  # a bare mirror works as well
    git --git-dir=$UPSTREAM show HEAD:megatron/training/arguments.py > /tmp/arguments.py
    python tools/compare_flag_defaults.py /tmp/arguments.py --git-dir $UPSTREAM

Upstream's flags come from two places in its `arguments.py`: literal
`group.add_argument('--flag', ...)` calls, and `ArgumentGroupFactory(SomeConfig, exclude=...)`
groups that turn each field of a dataclass into a flag (`--field-name`, the field's default,
its annotation as type/choices/nargs, `bool` as `store_true` or `--no-*` `store_false`, and the
field's `argparse_meta` metadata on top). The dataclasses are found in the files given with
`--config-source` or, with `--git-dir`, in upstream's repository at `--rev`. Nothing is
imported or installed: upstream is only parsed.

For every flag both parsers define, the tool prints where dest, default, type, choices, action
or nargs differ; `--missing` also lists upstream's flags this parser lacks. A value the AST
cannot evaluate (a call, an expression) is compared as its source text and shown as such.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_COMPARED = ("dest", "default", "type", "choices", "action", "nargs")


@dataclasses.dataclass
class Flag:
    """One command-line flag as a parser defines it (values normalised for comparison)."""

    names: tuple[str, ...]
    dest: str
    default: Any = None
    type: str | None = None
    choices: tuple[Any, ...] | None = None
    action: str = "store"
    nargs: Any = None


class _Unevaluated(str):
    """Source text of an expression the AST could not evaluate to a constant."""

    def __repr__(self) -> str:
        return f"<{str(self)}>"


def _value(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        if isinstance(node, ast.Lambda) and not node.args.args:
            return _value(node.body)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and not any(
            isinstance(n, (ast.Name, ast.Call, ast.Attribute, ast.Lambda)) for n in ast.walk(node)
        ):
            # Constant arithmetic such as 2 ** 32, which literal_eval refuses.
            expression = ast.fix_missing_locations(ast.Expression(node))
            return eval(compile(expression, "<upstream>", "eval"), {"__builtins__": {}})
        if isinstance(node, ast.Name):
            return _Unevaluated(node.id)
        return _Unevaluated(ast.unparse(node))


def _normalise(flag: Flag) -> Flag:
    if isinstance(flag.choices, (list, tuple)):
        flag.choices = tuple(flag.choices)
    if flag.action == "BooleanOptionalAction":
        flag.nargs = None
    if flag.action in ("store_true", "store_false") and flag.default is None:
        flag.default = flag.action == "store_false"
    return flag


def _flag_from_call(call: ast.Call) -> Flag | None:
    names = tuple(
        arg.value
        for arg in call.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] == "-"
    )
    if not names:
        return None
    kwargs = {kw.arg: kw.value for kw in call.keywords if kw.arg}
    longest = max(names, key=len)
    dest = _value(kwargs.get("dest")) or longest.lstrip("-").replace("-", "_")
    type_node = kwargs.get("type")
    return _normalise(
        Flag(
            names=names,
            dest=dest,
            default=_value(kwargs.get("default")),
            type=None if type_node is None else ast.unparse(type_node),
            choices=_value(kwargs.get("choices")),
            action=str(_value(kwargs.get("action")) or "store"),
            nargs=_value(kwargs.get("nargs")),
        )
    )


def _strip_optional(annotation: ast.AST) -> ast.AST:
    """`X | None` and `Optional[X]` -> `X`."""
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        parts = [annotation.left, annotation.right]
        kept = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
        if len(kept) == 1:
            return _strip_optional(kept[0])
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in (
        "Optional",
        "typing.Optional",
    ):
        return _strip_optional(annotation.slice)
    return annotation


def _type_fields(annotation: ast.AST) -> dict[str, Any]:
    """type / choices / nargs of a dataclass annotation, as upstream's factory infers them."""
    annotation = _strip_optional(annotation)
    if isinstance(annotation, ast.Subscript):
        outer = ast.unparse(annotation.value).split(".")[-1]
        if outer == "Literal":
            choices = _value(annotation.slice)
            choices = choices if isinstance(choices, tuple) else (choices,)
            return {"type": type(choices[0]).__name__, "choices": choices}
        if outer in ("list", "List"):
            return {**_type_fields(annotation.slice), "nargs": "+"}
    return {"type": ast.unparse(annotation)}


def _dataclass_flags(
    cls: ast.ClassDef, exclude: set[str], enum_members: Callable[[str], tuple[str, ...] | None]
) -> list[Flag]:
    """The flags upstream's `ArgumentGroupFactory` makes of `cls`'s own fields (no bases).

    Args:
        cls: the dataclass.
        exclude: field names the factory was told to skip.
        enum_members: the member names of an enum annotation, None if it is not one.
    """
    flags = []
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        if name in exclude:
            continue
        default: Any = _value(node.value)
        meta: dict[str, ast.AST] = {}
        if isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith("field"):
            kwargs = {kw.arg: kw.value for kw in node.value.keywords if kw.arg}
            if _value(kwargs.get("init")) is False:
                continue
            if "default_factory" in kwargs:
                factory_node = kwargs["default_factory"]
                factory = ast.unparse(factory_node)
                if isinstance(factory_node, ast.Lambda):
                    default = _value(factory_node)
                else:
                    default = {"list": [], "dict": {}}.get(factory, _Unevaluated(factory + "()"))
            else:
                default = _value(kwargs.get("default"))
            meta = _argparse_meta(kwargs.get("metadata"))
        fields: dict[str, Any] = {"dest": name, "default": default, "action": "store"}
        fields.update(_type_fields(node.annotation))
        members = enum_members(fields.get("type", ""))
        if members is not None:
            # Upstream's factory parses an enum by member name and offers every member.
            fields.update(type=None, choices=members)
        names = ["--" + name.replace("_", "-")]
        if fields["type"] == "bool":
            fields.pop("type")
            fields["action"] = "store_true" if default is False else "store_false"
            if fields["action"] == "store_false":
                names = ["--no-" + name.replace("_", "-"), "--disable-" + name.replace("_", "-")]
        for key, value_node in meta.items():
            value = _value(value_node)
            if key == "arg_names":
                names = list(value)
            elif key == "type":
                fields["type"] = ast.unparse(value_node)
            elif key in _COMPARED:
                fields[key] = value
        flags.append(_normalise(Flag(names=tuple(names), **fields)))
    return flags


def _argparse_meta(metadata: ast.AST | None) -> dict[str, ast.AST]:
    if not isinstance(metadata, ast.Dict):
        return {}
    for key, value in zip(metadata.keys, metadata.values):
        if _value(key) == "argparse_meta" and isinstance(value, ast.Dict):
            return {_value(k): v for k, v in zip(value.keys, value.values)}
    return {}


class ConfigSources:
    """Finds upstream dataclasses by name, in given files or in upstream's git repository."""

    def __init__(self, files: list[Path], git_dir: str | None, rev: str):
        self._trees = [ast.parse(path.read_text()) for path in files]
        self._git_dir, self._rev = git_dir, rev
        self._cache: dict[str, ast.ClassDef | None] = {}

    def find(self, name: str) -> ast.ClassDef | None:
        """The `class name` definition, or None where no source has it."""
        if name not in self._cache:
            self._cache[name] = self._search(name)
        return self._cache[name]

    def _search(self, name: str) -> ast.ClassDef | None:
        for tree in self._trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return node
        if self._git_dir is None:
            return None
        listed = subprocess.run(
            [
                "git",
                f"--git-dir={self._git_dir}",
                "grep",
                "-l",
                f"^class {name}\\b",
                self._rev,
                "--",
                "megatron",
            ],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        for blob in listed:
            source = subprocess.run(
                ["git", f"--git-dir={self._git_dir}", "show", blob],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            tree = ast.parse(source)
            self._trees.append(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return node
        return None

    def enum_members(self, name: str) -> tuple[str, ...] | None:
        """The member names of enum class `name`, None if it is not an enum found here."""
        module, _, attribute = name.rpartition(".")
        if module in sys.stdlib_module_names:
            # A standard-library enum (signal.Signals): importing the standard library is safe.
            value = getattr(importlib.import_module(module), attribute, None)
            if isinstance(value, type) and issubclass(value, enum.Enum):
                return tuple(member.name for member in value)  # no aliases
            return None
        if not name.isidentifier() or name in ("int", "float", "str", "bool"):
            return None
        cls = self.find(name)
        if cls is None or not any("Enum" in ast.unparse(base) for base in cls.bases):
            return None
        return tuple(
            target.id
            for node in cls.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        )

    def fields_of(self, name: str, exclude: set[str]) -> list[Flag] | None:
        """The flags of dataclass `name` and its bases (bases first), or None if not found."""
        cls = self.find(name)
        if cls is None:
            return None
        flags: list[Flag] = []
        for base in cls.bases:
            base_flags = self.fields_of(ast.unparse(base).split(".")[-1], exclude)
            flags.extend(base_flags or [])
        own = _dataclass_flags(cls, exclude, self.enum_members)
        own_dests = {flag.dest for flag in own}
        return [flag for flag in flags if flag.dest not in own_dests] + own


def _resolve_list(node: ast.AST | None, function: ast.AST | None) -> set[str]:
    """The strings of a literal list, or of the list a name was assigned in `function`."""
    if node is None:
        return set()
    if isinstance(node, ast.Name) and function is not None:
        name = node.id
        for stmt in ast.walk(function):
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in stmt.targets
            ):
                node = stmt.value
    value = _value(node)
    return set(value) if isinstance(value, (list, tuple, set)) else set()


def upstream_flags(arguments_py: Path, sources: ConfigSources) -> tuple[list[Flag], list[str]]:
    """Upstream's flags from its `arguments.py`, and the dataclasses it could not find."""
    tree = ast.parse(arguments_py.read_text())
    flags: list[Flag] = []
    unresolved: list[str] = []
    for function in [n for n in tree.body if isinstance(n, ast.FunctionDef)] + [tree]:
        nodes = ast.walk(function) if function is not tree else iter(())
        for node in nodes:
            if not isinstance(node, ast.Call):
                continue
            called = ast.unparse(node.func)
            if called.endswith(".add_argument"):
                flag = _flag_from_call(node)
                if flag is not None:
                    flags.append(flag)
            elif called == "ArgumentGroupFactory" and node.args:
                name = ast.unparse(node.args[0])
                kwargs = {kw.arg: kw.value for kw in node.keywords if kw.arg}
                found = sources.fields_of(name, _resolve_list(kwargs.get("exclude"), function))
                if found is None:
                    unresolved.append(name)
                else:
                    flags.extend(found)
    return flags, unresolved


def our_flags() -> list[Flag]:
    """This project's flags, from its parser, less those refused by name as not built (their
    defaults and types are irrelevant: setting one is an error) and those accepted with no
    effect (their values are ignored)."""
    from megatron.training.arguments import add_megatron_arguments
    from megatron.training.flag_groups.unbuilt import (
        PERFORMANCE_HINTS,
        TOKENIZER_UNBUILT,
        UNBUILT,
        VALUED_HINTS,
    )

    refused = {
        name
        for unbuilt in UNBUILT + TOKENIZER_UNBUILT
        for name in (*unbuilt.switches, *unbuilt.valued)
    }
    refused |= {flag for flag, *_ in PERFORMANCE_HINTS + VALUED_HINTS}

    parser = add_megatron_arguments(argparse.ArgumentParser(add_help=False))
    actions = {
        argparse._StoreTrueAction: "store_true",
        argparse._StoreFalseAction: "store_false",
        argparse._StoreAction: "store",
        argparse._StoreConstAction: "store_const",
        argparse._AppendAction: "append",
        argparse.BooleanOptionalAction: "BooleanOptionalAction",
    }
    flags = []
    for action in parser._actions:
        if not action.option_strings or refused.intersection(action.option_strings):
            continue
        type_name = None
        if action.type is not None:
            type_name = getattr(action.type, "__name__", repr(action.type))
        kind = actions.get(type(action), type(action).__name__)
        flags.append(
            _normalise(
                Flag(
                    names=tuple(action.option_strings),
                    dest=action.dest,
                    default=action.default,
                    type=type_name,
                    choices=None if action.choices is None else tuple(action.choices),
                    action=kind,
                    nargs=None if kind in ("store_true", "store_false") else action.nargs,
                )
            )
        )
    return flags


def _same(field: str, upstream: Any, ours: Any) -> bool:
    if field == "action" and ours == "BooleanOptionalAction":
        # `--x/--no-x` covers upstream's store_true `--x` and store_false `--no-x` alike.
        return upstream in ("store_true", "store_false", "BooleanOptionalAction")
    if field == "nargs" and upstream is None and ours is None:
        return True
    if isinstance(upstream, _Unevaluated):
        last = str(upstream).split(".")[-1]
        return str(upstream) == str(ours) or last in (str(ours), getattr(ours, "name", None))
    if field == "choices" and upstream is not None and ours is not None:

        def names(values: tuple[Any, ...]) -> set[str]:
            return {getattr(value, "name", str(value)) for value in values}

        return names(upstream) == names(ours)
    return upstream == ours


def compare(upstream: list[Flag], ours: list[Flag]) -> tuple[list[str], list[str]]:
    """(differences, upstream flags missing here), one printable line each."""
    by_name = {name: flag for flag in ours for name in flag.names}
    differences, missing = [], []
    seen: set[str] = set()
    for flag in upstream:
        mine = next((by_name[n] for n in flag.names if n in by_name), None)
        if mine is None:
            missing.append(" / ".join(flag.names))
            continue
        if mine.dest in seen:
            continue
        seen.add(mine.dest)
        for field in _COMPARED:
            theirs, here = getattr(flag, field), getattr(mine, field)
            if field == "type" and (theirs is None or here is None):
                continue  # a missing type is str on both sides
            if not _same(field, theirs, here):
                differences.append(f"{flag.names[0]}: {field} upstream={theirs!r} here={here!r}")
    return differences, missing


def main(argv: list[str] | None = None) -> int:
    """Prints the differences; returns 1 if there are any (0 otherwise), for scripts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arguments_py", type=Path, help="upstream's megatron/training/arguments.py")
    parser.add_argument(
        "--config-source", type=Path, nargs="*", default=[], help="files with its dataclasses"
    )
    parser.add_argument("--git-dir", help="upstream's git directory, to find the dataclasses")
    parser.add_argument("--rev", default="HEAD", help="upstream revision (with --git-dir)")
    parser.add_argument("--missing", action="store_true", help="list upstream flags not here")
    options = parser.parse_args(argv)

    sources = ConfigSources(options.config_source, options.git_dir, options.rev)
    upstream, unresolved = upstream_flags(options.arguments_py, sources)
    differences, missing = compare(upstream, our_flags())
    if unresolved:
        print(f"# dataclasses not found (their flags are not compared): {', '.join(unresolved)}")
    print(f"# {len(upstream)} upstream flags; {len(differences)} differences in shared flags")
    for line in differences:
        print(line)
    if options.missing:
        print(f"# {len(missing)} upstream flags not defined here")
        for name in missing:
            print(f"missing: {name}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
