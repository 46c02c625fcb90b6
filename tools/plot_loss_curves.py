"""Compares the loss curves of `pretrain_gpt.py` runs from their logs, and plots them.

    python tools/plot_loss_curves.py bf16=runs/fp8_convergence/bf16.log \
        fp8=runs/fp8_convergence/fp8.log --out docs/images/fp8_convergence.png

Reads each log's periodic lines (`iteration N/ M | ... | lm loss: X | ...`, at
`--log-interval 1` one per iteration) and its validation boxes (`validation loss at iteration N
| lm loss value: X | ...`), prints per run the mean training loss over the last `--tail`
iterations and each validation loss, with the relative difference of every run to the first,
and, with `--out`, draws the training curves (a moving average over `--smooth` iterations) and
the validation losses into one PNG (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass, field

_TRAIN = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+.\dEe]+|nan|inf) \|")
_VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+.\dEe]+)")


@dataclass
class Curves:
    """One run's losses by iteration."""

    train: dict[int, float] = field(default_factory=dict)
    validation: dict[int, float] = field(default_factory=dict)


def read_log(path: str) -> Curves:
    """The training and validation losses a `pretrain_gpt.py` log reports.

    Raises:
        ValueError: the log has no periodic line.
    """
    curves = Curves()
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            if match := _TRAIN.search(line):
                curves.train[int(match[1])] = float(match[2])
            elif match := _VALIDATION.search(line):
                curves.validation[int(match[1])] = float(match[2])
    if not curves.train:
        raise ValueError(
            f"{path} has no `iteration N/ M | ... | lm loss: X |` line: pass the log of a "
            "pretrain_gpt.py run (rank 0's output)."
        )
    return curves


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of each value with up to `window - 1` values before it."""
    averages, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        averages.append(total / min(i + 1, window))
    return averages


def summary(runs: dict[str, Curves], tail: int) -> str:
    """The table `main` prints: the final training loss and each validation loss per run,
    with the relative difference to the first run."""
    names = list(runs)
    reference = runs[names[0]]
    iterations = sorted(set.intersection(*(set(c.validation) for c in runs.values())))

    def tail_mean(curves: Curves) -> float:
        return statistics.fmean([curves.train[i] for i in sorted(curves.train)[-tail:]])

    rows = [("run", f"train loss (last {tail})", *(f"val @ {i}" for i in iterations))]
    for name, curves in runs.items():
        cells = [name, _with_difference(tail_mean(curves), tail_mean(reference))]
        for i in iterations:
            cells.append(_with_difference(curves.validation[i], reference.validation[i]))
        rows.append(tuple(cells))
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def _with_difference(value: float, reference: float) -> str:
    if value == reference:
        return f"{value:.4f}"
    return f"{value:.4f} ({100 * (value - reference) / reference:+.2f}%)"


def plot(runs: dict[str, Curves], smooth: int, title: str, out: str) -> None:
    """Draws the training curves (moving averages) and validation losses into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5), dpi=120)
    for name, curves in runs.items():
        steps = sorted(curves.train)
        smoothed = moving_average([curves.train[i] for i in steps], smooth)
        (line,) = axes.plot(steps, smoothed, label=f"{name} train ({smooth}-iteration mean)")
        if curves.validation:
            points = sorted(curves.validation)
            axes.plot(
                points,
                [curves.validation[i] for i in points],
                "o--",
                color=line.get_color(),
                label=f"{name} validation",
            )
    axes.set_xlabel("iteration")
    axes.set_ylabel("lm loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="NAME=LOG", help="a run's name and its log")
    parser.add_argument("--out", default=None, help="write the plot to this PNG")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window")
    parser.add_argument("--tail", type=int, default=50, help="iterations of the final mean")
    parser.add_argument("--title", default="pretrain_gpt.py loss curves")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"{spec!r}: give each run as NAME=LOG, e.g. bf16=runs/bf16.log")
        runs[name] = read_log(path)
    print(summary(runs, args.tail))
    if args.out:
        plot(runs, args.smooth, args.title, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
