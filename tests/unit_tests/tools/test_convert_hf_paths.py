"""`tools/convert_hf.py` on awkward paths and damaged inputs: a `--flags-file` that cannot be
written is refused before the checkpoint is (which used to be committed, or replaced with
`--force`, before the write failed), `--hf-dir DIR/` exports like `--hf-dir DIR`, and damaged
safetensors files or index are errors naming the file, with nothing written."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron.training.hf_conversion import HFConversionError
from tests.unit_tests.tools.hf_models import save_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "tools") not in sys.path:  # the tool is a script: import it by path
    sys.path.insert(0, str(REPO / "tools"))
convert_hf = importlib.import_module("convert_hf")


def convert(*argv: Any) -> dict[str, Any]:
    return convert_hf.main([str(arg) for arg in argv])


def files(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` -> its bytes."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """A Llama 2 in one safetensors file and a Mistral in several (with an index)."""
    root = tmp_path_factory.mktemp("hf_models")
    save_hf_model("llama2", root / "llama2")
    save_hf_model("mistral", root / "mistral")
    return {"one_file": root / "llama2", "sharded": root / "mistral"}


def test_an_unwritable_flags_file_is_refused_before_the_checkpoint(hf_dirs, tmp_path):
    source = hf_dirs["one_file"]
    save = tmp_path / "ckpt"
    with pytest.raises(HFConversionError, match="its directory .*no/such does not exist"):
        convert("import", "--hf-dir", source, "--save", save, "--flags-file",
                tmp_path / "no" / "such" / "model.flags")  # fmt: skip
    assert not save.exists()

    convert("import", "--hf-dir", source, "--save", save, "--flags-file", tmp_path / "m.flags")
    before = files(tmp_path)
    (tmp_path / "flags_dir").mkdir()
    with pytest.raises(HFConversionError, match="flags_dir is a directory"):
        convert("import", "--hf-dir", hf_dirs["sharded"], "--save", save, "--flags-file",
                tmp_path / "flags_dir", "--force")  # fmt: skip
    assert files(tmp_path) == before  # the first model's checkpoint and flags, as they were


@pytest.mark.parametrize("existing", ["empty", "full"])
def test_hf_dir_with_a_trailing_slash(hf_dirs, tmp_path, existing):
    save = tmp_path / "ckpt"
    convert("import", "--hf-dir", hf_dirs["one_file"], "--save", save)
    out = tmp_path / "out"
    out.mkdir()
    force = []
    if existing == "full":
        (out / "old.txt").write_text("replaced with --force")
        force = ["--force"]
    convert("export", "--load", save, "--hf-dir", f"{out}/", *force)
    assert (out / "config.json").is_file() and not (out / "old.txt").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ckpt", "out"]  # no leftovers


@pytest.mark.parametrize("damage", ["truncated_shard", "index_not_json", "index_a_list"])
def test_damaged_weights_name_the_file(hf_dirs, tmp_path, damage):
    source = tmp_path / "hf"
    source.mkdir()
    for name, data in files(hf_dirs["sharded"]).items():
        (source / name).write_bytes(data)
    index = source / "model.safetensors.index.json"
    shard = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    if damage == "truncated_shard":
        data = (source / shard).read_bytes()
        (source / shard).write_bytes(data[:-64])
        expected = f"{shard} is not a readable safetensors file"
    elif damage == "index_not_json":
        index.write_text(index.read_text()[:-20])
        expected = "model.safetensors.index.json is not JSON"
    else:
        index.write_text("[]")
        expected = "model.safetensors.index.json has no weight_map"
    with pytest.raises(HFConversionError, match=expected):
        convert("import", "--hf-dir", source, "--save", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
