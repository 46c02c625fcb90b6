"""The README's library programs run as written: each Python block, saved to a file and run
under `torchrun --nproc-per-node 2` (gloo on CPU), trains three steps and exits cleanly, and
ends by destroying its process groups."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _python_blocks() -> list[str]:
    return PYTHON_BLOCK.findall((REPO / "README.md").read_text(encoding="utf-8"))


def test_readme_has_the_library_programs():
    blocks = _python_blocks()
    assert len(blocks) == 2
    assert all("dist.destroy_process_group()" in block for block in blocks)


@pytest.mark.parametrize("index", [0, 1], ids=["ddp", "megatron-fsdp"])
def test_readme_program_runs_under_torchrun(tmp_path, index):
    script = tmp_path / "example.py"
    script.write_text(_python_blocks()[index], encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node=2", str(script)]
    proc = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step \d: loss ([\d.]+)", proc.stdout, re.M)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses), proc.stdout
