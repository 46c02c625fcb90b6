"""`NativeExtension` (`megatron.core.native_extension`), the loader of this project's C++
extensions, with PyTorch's builder replaced by a stand-in: loaded once, switched off by its
environment variable, suspended, a failed build said once; named by the GPU's architecture and
its sources' digest; a build lock that another process holds is waited for, and one a killed
build left long ago is removed."""

from __future__ import annotations

import os
import re
import threading
import time
import types

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from megatron.core import native_extension
from megatron.core.native_extension import NativeExtension

SWITCH = "MEGATRON_TEST_EXTENSION_CPP"


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """The names `load` was called with; builds land in `tmp_path / "builds"` (a GPU of
    capability 9.0); the extension's source is `tmp_path / "src" / "test.cpp"`."""
    calls = []

    def load(name, **kwargs):
        calls.append(name)
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    monkeypatch.delenv(SWITCH, raising=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "test.cpp").write_text("int answer() { return 42; }\n")
    monkeypatch.chdir(tmp_path)
    return calls


SOURCE = os.path.join("src", "test.cpp")


def _extension(**kwargs) -> NativeExtension:
    return NativeExtension("megatron_test", [SOURCE], SWITCH, "test layers", **kwargs)


def _name() -> str:
    return f"megatron_test_sm90_{native_extension.source_digest([SOURCE])}"


def _lock(name: str) -> str:
    return os.path.join(cpp_extension._get_build_directory(name, verbose=False), "lock")


def test_loaded_once_per_architecture_and_set_up_first(builds):
    seen = []
    extension = _extension(setup=lambda module: seen.append(module.name))
    assert re.fullmatch(r"megatron_test_sm90_[0-9a-f]{12}", extension.module().name)
    assert extension.module() is extension.module()
    assert builds == [_name()] and seen == [_name()]
    with extension.suspended():
        assert extension.module() is None
    assert extension.module() is not None


def test_the_switch_keeps_the_python_path_without_a_build(builds, monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    assert _extension().module() is None
    assert builds == []


def test_a_failed_build_is_said_once_and_not_retried(builds, monkeypatch):
    def fail(name, **kwargs):
        builds.append(name)
        raise RuntimeError("no nvcc here")

    monkeypatch.setattr(cpp_extension, "load", fail)
    extension = _extension()
    with pytest.warns(UserWarning, match="test layers run their Python path.*no nvcc here"):
        assert extension.module() is None
    assert extension.module() is None
    assert builds == [_name()]


def test_a_lock_left_long_ago_is_removed(builds):
    lock = _lock(_name())
    open(lock, "w").close()
    made = time.time() - native_extension.STALE_LOCK_S - 60
    os.utime(lock, (made, made))
    with pytest.warns(
        UserWarning, match="Removed .*left 11 minutes ago by a build .* that did not finish"
    ):
        assert _extension().module() is not None
    assert not os.path.exists(lock)


def test_a_lock_another_build_holds_is_waited_for(builds, monkeypatch, caplog):
    monkeypatch.setattr(native_extension, "_POLL_S", 0.01)
    lock = _lock(_name())
    open(lock, "w").close()
    finished = threading.Timer(0.3, os.remove, [lock])
    finished.start()
    start = time.monotonic()
    try:
        assert _extension().module() is not None
    finally:
        finished.join()
    assert time.monotonic() - start >= 0.3
    assert "Waiting for another process's build of the test layers' C++ extension" in caplog.text
    assert builds == [_name()]


def test_a_stale_lock_replaced_by_a_live_one_is_kept(tmp_path):
    """Two processes saw the same stale lock; the first removed it and its build made a new
    one (which may reuse the inode): the second leaves the new one in place."""
    lock = tmp_path / "lock"
    lock.touch()
    made = time.time() - 3600
    os.utime(lock, (made, made))
    seen = os.stat(lock)
    lock.unlink()
    lock.touch()
    assert not native_extension._remove_if_unchanged(str(lock), seen)
    assert list(tmp_path.iterdir()) == [lock]
    assert os.stat(lock).st_mtime > made + 60
    assert native_extension._remove_if_unchanged(str(lock), os.stat(lock))
    assert list(tmp_path.iterdir()) == []


def test_the_name_follows_the_sources_and_headers(builds, tmp_path):
    """Another checkout's sources (or a header they include) build under another name, so its
    processes neither rebuild over this one's build nor wait for its lock; the same sources
    elsewhere share the build."""
    first = _name()
    (tmp_path / "src" / "test.cpp").write_text("int answer() { return 43; }\n")
    changed = _name()
    (tmp_path / "src" / "kernels.h").write_text("#pragma once\n")
    with_header = _name()
    assert len({first, changed, with_header}) == 3
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for path in (tmp_path / "src").iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    assert native_extension.source_digest([str(copy / "test.cpp")]) == with_header.rsplit("_")[-1]
    assert _extension().module().name == with_header
    assert builds == [with_header]
