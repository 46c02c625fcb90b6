"""What the GPT benchmarks print: the aligned table of their rows, notes per row, and one JSON
object (the configuration and the rows), also written to `--json-out`. Imported by the benchmark
scripts in `tools/`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.distributed as dist


def print_table(rows: list[dict]) -> None:
    """The aligned table, then one precision footnote per engine."""
    header = f"{'engine':<21}{'step ms':>10}{'tok/s/GPU':>12}{'TFLOP/s/GPU':>13}{'peak GiB':>10}"
    print(header + f"{'cpu ms':>9}{'loop ms':>9}{'x single':>10}{'loss':>10}")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        ratio = "-" if r["vs_single"] is None else f"{r['vs_single']:.3f}"
        print(
            f"{r['engine']:<21}{r['step_ms']:>10.2f}{r['tokens_per_s_per_gpu']:>12,.0f}"
            f"{r['tflops_per_s_per_gpu']:>13.2f}{peak:>10}{r['cpu_ms']:>9.1f}{r['loop_ms']:>9.2f}"
            f"{ratio:>10}"
            f"{r['final_loss']:>10.4f}"
        )
    for r in rows:
        where = f" [{r['layout']}]" if r.get("layout") else ""
        print(f"  {r['engine']}{where}: {r['precision']}")


def report(
    rows: list[dict],
    args: argparse.Namespace,
    device: torch.device,
    num_params: int,
    notes: Sequence[str] = (),
) -> None:
    """On rank 0: the table, `notes` (one line each), and the JSON of the run (written to
    `args.json_out` too when set)."""
    if dist.get_rank() != 0:
        return
    result = {
        "config": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": dist.get_world_size(),
            "backend": dist.get_backend(),
            "torch": torch.__version__,
            "params": num_params,
            **{k: v for k, v in vars(args).items() if k not in ("json_out", "profile")},
        },
        "rows": rows,
    }
    print_table(rows)
    for note in notes:
        print(f"  {note}")
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
