"""Says where a host-bound run's CPU time goes, from the stacks py-spy samples.

A torch profile (`trace_summary.py --host`) times each operator, but not what runs inside one:
the C++ of an extension's autograd node, cuBLASLt's set-up of a GEMM, a library building a plan
at its first call. A sampling profiler sees all of it: py-spy with `--native` records the C and
C++ frames beside the Python ones, on every thread (on CUDA the forward runs on the main thread,
the backward on autograd's thread of its own). py-spy follows one process, so run the single
rank without `torchrun` (the benchmarks then make a world of one; py-spy is not a dependency of
this project: `pip install py-spy`, and it needs the permission to trace a process):

    py-spy record --native --threads --rate 40 --format raw -o stacks.txt -- \\
        python tools/benchmark_fsdp.py $MODEL --engines megatron_fsdp_zero3 --steps 100

(Unwinding native stacks is slow: at much more than 40 samples a second of a 1.34B GPT's step
py-spy falls behind, and each sample pauses the process, so the sampled steps run slower than
unsampled ones: compare shares, not times, with other runs.) Then:

    python tools/host_stacks.py stacks.txt         # samples per thread
    python tools/host_stacks.py stacks.txt --thread MainThread --with time_loop --root "step ("
    python tools/host_stacks.py stacks.txt --skip-thread MainThread --root evaluate_function \\
        --without build_plans --depth 6
    python tools/host_stacks.py stacks.txt --skip-thread MainThread --leaves

Prints the samples of each thread, then the selected samples (those of the threads `--thread`
names and not `--skip-thread`, with every `--with` frame and no `--without` frame; each cut to
start at its first `--root` frame, where given, and less the frames `--hide` names) as a tree:
each frame's share of the selection, its samples and everything called under it, to `--depth`
levels, siblings by share. `--leaves` prints instead the frames the samples were in (self
time), by share. With `--rate` and `--steps`, also milliseconds per step (from the rate asked
for: where py-spy fell behind, it says so, and the times come out low). The frames are
py-spy's, shortened (`shorten`): C++ template arguments, parameter lists and unnamed addresses
merged, the library or `file:line` kept. A frame matches a text where the text occurs in it
(as py-spy wrote it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re

_LOCATION = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")
# A Python file (`file.py:LINE`, or no line under py-spy's --nolineno) or a frozen or string
# module (`<frozen importlib._bootstrap>:1176`); a native frame with debug information names
# its source as `file.cpp:LINE`.
_PYTHON_LOCATION = re.compile(r"(\.pyx?|^<[^<>]*>)(:\d+)?$")
_QUALIFIERS = re.compile(r"(?<=\))(\s*(const|volatile|noexcept|&&|&))+$")
_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")
# Operators whose angle brackets open or close no template argument list, longest first;
# stood in for by their index while the template arguments are dropped.
_ANGLE_OPERATORS = (
    "operator<=>",
    "operator<<=",
    "operator>>=",
    "operator<<",
    "operator>>",
    "operator<=",
    "operator>=",
    "operator->",
    "operator<",
    "operator>",
)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One distinct stack and how many times it was sampled.

    Attributes:
        thread: py-spy's label of the thread ("thread (820): MainThread"; with
            `--subprocesses`, its process's frame before it), or "" for a file recorded
            without `--threads`.
        frames: the stack, outermost first, as py-spy wrote each frame.
        count: the samples.
    """

    thread: str
    frames: tuple[str, ...]
    count: int


def read_samples(path: str) -> list[Sample]:
    """The samples of a py-spy `--format raw` file (one `frame;frame;... count` per line). A
    line of a count alone (` 398`: samples of a process with no stack to show, recorded without
    `--threads`) says nothing of where the time went and is left out."""
    samples = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            line = line.rstrip()
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            if not count.isdigit() or not (stack or line.startswith(" ")):
                raise SystemExit(
                    f"{path}:{number}: not a py-spy raw stack (`frame;frame;... count`); record "
                    "with `py-spy record --format raw`."
                )
            if not stack:
                continue
            frames = stack.split(";")
            label = []
            while frames and frames[0].startswith(("process ", "thread (")):
                label.append(frames.pop(0))
            samples.append(Sample(";".join(label), tuple(frames), int(count)))
    return samples


def shorten(frame: str) -> str:
    """A frame's name as the tree merges it: C++ template arguments, parameter lists and
    trailing qualifiers dropped, the location kept, so that
    "torch::autograd::CppNode<Fp8Linear>::apply(std::vector<at::Tensor>&&) (ext.so)" reads
    "torch::autograd::CppNode<..>::apply (ext.so)", and the addresses py-spy could not name
    ("0x7f6759529ecc (libc.so.6)") one "0x.. (libc.so.6)" per library. A Python frame is
    kept whole ("_flatten.<locals>.<genexpr> (unit_boundaries.py:107)")."""
    match = _LOCATION.match(frame)
    name, where = (match["name"], match["where"]) if match else (frame, "")
    if _PYTHON_LOCATION.search(where):
        return frame
    if _ADDRESS.match(name):
        name = "0x.."
    else:
        name = _without_parameters(_without_templates(name))
    return f"{name} ({where})" if where else name


def _without_templates(name: str) -> str:
    """`name` with each outermost template argument list `<...>` written `<..>`."""
    name = name.replace("(anonymous namespace)", "{anon}")
    for index, operator in enumerate(_ANGLE_OPERATORS):
        name = name.replace(operator, f"\0{index}\0")
    kept, depth = [], 0
    for char in name:
        if char == "<":
            if depth == 0:
                kept.append("<..>")
            depth += 1
        elif char == ">" and depth:
            depth -= 1
        elif depth == 0:
            kept.append(char)
    name = "".join(kept)
    for index, operator in enumerate(_ANGLE_OPERATORS):
        name = name.replace(f"\0{index}\0", operator)
    return name


def _without_parameters(name: str) -> str:
    """`name` less its trailing qualifiers (`const`, `&&`, ...) and parenthesised parameter
    list; `operator()` keeps its own parentheses."""
    name = _QUALIFIERS.sub("", name)
    if not name.endswith(")") or name.endswith("operator()"):
        return name
    depth = 0
    for index in range(len(name) - 1, -1, -1):
        if name[index] == ")":
            depth += 1
        elif name[index] == "(":
            depth -= 1
            if depth == 0:
                return name[:index] if index else name
    return name


def select(samples: list[Sample], args: argparse.Namespace) -> list[Sample]:
    """The samples the filters keep (module docstring), cut to start at `--root`."""
    kept = []
    for sample in samples:
        if args.thread and args.thread not in sample.thread:
            continue
        if args.skip_thread and args.skip_thread in sample.thread:
            continue
        frames = sample.frames
        if not all(any(text in frame for frame in frames) for text in args.with_frames):
            continue
        if any(text in frame for frame in frames for text in args.without_frames):
            continue
        if args.root:
            start = next((i for i, frame in enumerate(frames) if args.root in frame), None)
            if start is None:
                continue
            frames = frames[start:]
        if args.hide:
            frames = tuple(
                frame for frame in frames if not any(text in frame for text in args.hide)
            )
        if frames:  # a stack of hidden frames only: nothing to place in the tree
            kept.append(Sample(sample.thread, frames, sample.count))
    return kept


@dataclasses.dataclass
class Node:
    """A frame of the tree: the samples in it or under it, and its callees by frame."""

    count: int = 0
    callees: dict[str, Node] = dataclasses.field(default_factory=dict)


def build_tree(samples: list[Sample], depth: int) -> Node:
    """The samples' stacks merged from their outermost frame, `depth` frames deep (shortened
    names: calls of one function from one place merge whatever their template arguments)."""
    root = Node()
    for sample in samples:
        root.count += sample.count
        node = root
        for frame in sample.frames[:depth]:
            node = node.callees.setdefault(shorten(frame), Node())
            node.count += sample.count
    return root


def leaves(samples: list[Sample]) -> collections.Counter[str]:
    """Samples per innermost frame (shortened); `samples` as `select` keeps them (none
    empty)."""
    counts: collections.Counter[str] = collections.Counter()
    for sample in samples:
        counts[shorten(sample.frames[-1])] += sample.count
    return counts


class Printer:
    """Rows of `share samples [ms/step] frame`, shares of `total` samples."""

    def __init__(self, total: int, rate: float | None, steps: int | None) -> None:
        self.total = total
        self.ms_per_sample = 1e3 / rate / steps if rate and steps else None

    def row(self, count: int, label: str, indent: int = 0) -> str:
        """One row: `count`'s share and samples (and ms per step), then `label` indented."""
        ms = f" {count * self.ms_per_sample:9.2f}" if self.ms_per_sample is not None else ""
        return f"{100 * count / self.total:6.1f}% {count:7d}{ms}  {'  ' * indent}{label}"

    def tree(self, node: Node, min_share: float, indent: int = 0) -> list[str]:
        """The rows of `node`'s callees and theirs, depth first, each level by share, less
        the callees under `min_share` percent (and what they call)."""
        rows = []
        for label, callee in sorted(node.callees.items(), key=lambda item: -item[1].count):
            if 100 * callee.count / self.total < min_share:
                continue
            rows.append(self.row(callee.count, label, indent))
            rows.extend(self.tree(callee, min_share, indent + 1))
        return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The tool's flags, checked (bad ones exit through `parser.error`)."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("stacks", help="a py-spy `record --format raw` file")
    parser.add_argument("--thread", default=None, help="only threads whose label has this text")
    parser.add_argument("--skip-thread", default=None, help="leave out threads whose label has it")
    parser.add_argument(
        "--with",
        dest="with_frames",
        action="append",
        default=[],
        metavar="TEXT",
        help="only stacks with a frame that has this text (repeatable: all of them)",
    )
    parser.add_argument(
        "--without",
        dest="without_frames",
        action="append",
        default=[],
        metavar="TEXT",
        help="leave out stacks with a frame that has this text (repeatable)",
    )
    parser.add_argument(
        "--root",
        default=None,
        help="start each stack at its first frame with this text (stacks without one are left out)",
    )
    parser.add_argument(
        "--hide",
        action="append",
        default=[],
        metavar="TEXT",
        help="drop the frames that have this text from every selected stack (wrappers such as "
        "Module._call_impl; repeatable)",
    )
    parser.add_argument("--depth", type=int, default=8, help="tree levels to print")
    parser.add_argument("--min", type=float, default=1.0, help="hide frames under this share, %%")
    parser.add_argument("--leaves", action="store_true", help="self samples per frame instead")
    parser.add_argument("--rows", type=int, default=40, help="frames --leaves prints")
    parser.add_argument("--rate", type=float, default=None, help="py-spy's --rate, for ms/step")
    parser.add_argument("--steps", type=int, default=None, help="the steps the samples span")
    args = parser.parse_args(argv)
    if (args.rate is None) != (args.steps is None):
        parser.error("--rate and --steps go together (ms per step needs both).")
    if args.depth < 1 or args.rows < 1 or (args.rate is not None and args.rate <= 0):
        parser.error("--depth, --rows and --rate must be positive.")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be positive.")
    return args


def main(argv: list[str] | None = None) -> None:
    """Prints each thread's samples, then the selection's tree (or leaves)."""
    args = parse_args(argv)
    samples = read_samples(args.stacks)
    if (args.thread or args.skip_thread) and not any(sample.thread for sample in samples):
        raise SystemExit(
            f"{args.stacks} names no threads (recorded without `--threads`): drop --thread and "
            "--skip-thread, or record again with `py-spy record --threads`."
        )
    threads: collections.Counter[str] = collections.Counter()
    for sample in samples:
        threads[sample.thread or "(all threads)"] += sample.count
    for thread, count in threads.most_common():
        print(f"{count:8d}  {thread}")
    selected = select(samples, args)
    total = sum(sample.count for sample in selected)
    print(f"selected: {total} samples")
    if not total:
        return
    printer = Printer(total, args.rate, args.steps)
    header = "share samples" + (" ms/step" if printer.ms_per_sample is not None else "")
    print(header)
    if args.leaves:
        for label, count in leaves(selected).most_common(args.rows):
            print(printer.row(count, label))
    else:
        print("\n".join(printer.tree(build_tree(selected, args.depth), args.min)))


if __name__ == "__main__":
    main()
