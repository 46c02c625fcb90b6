"""The `--shapes`-style flags of the kernel benchmarks: comma-separated sizes joined by `x`
(`4096x2048,4096x4096`)."""

from __future__ import annotations

import argparse


def parse_shapes(
    parser: argparse.ArgumentParser, flag: str, text: str, names: str, example: str
) -> list[tuple[int, ...]]:
    """The shapes of `text`, each of as many positive sizes as `names` has parts; a bad one
    exits through `parser.error`, naming `flag`.

    Args:
        parser: the tool's parser.
        flag: the flag `text` came from ("--shapes").
        text: the flag's value.
        names: what the sizes are, joined by `x` ("ROWSxCOLS").
        example: a valid shape, for the message ("4096x4096").
    """
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: give {names}, e.g. {example}.")
    dims = len(names.split("x"))
    if any(len(shape) != dims or min(shape) < 1 for shape in shapes):
        parser.error(f"{flag}: each shape is {dims} positive sizes, {names}.")
    return shapes
