"""`NativeExtension`: one of this project's C++ extensions, built where it is first used.

The extensions move host work that Python makes slow (autograd functions, argument handling,
several small dispatches) into one C++ call. Each is built with PyTorch's extension builder
(`torch.utils.cpp_extension.load`: a C++ compiler and ninja, nvcc for CUDA sources) the first
time a process needs it on a GPU, which takes about a minute, and cached where PyTorch caches its
extensions (`TORCH_EXTENSIONS_DIR`, by default under `~/.cache`; the ranks that share it wait
for one build), under a name that carries the GPU's architecture and a digest of the sources:
processes of two checkouts whose sources differ (two commits compared on one machine) each load
their own build, neither rebuilding over the other's nor waiting for its lock (each version of the
sources leaves its build folder there). A build killed midway leaves its `lock` file behind; a
process that finds one says that it waits for it, and removes it once it is older than
`STALE_LOCK_S` (deleting it by hand skips the wait). Where it cannot be built the callers run
their Python path, said once in a warning; an environment switch set to 0 keeps the Python path
without one.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch

_logger = logging.getLogger(__name__)

_SHARED_HEADERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
"""The headers every extension may include (`once_differentiable.h`, `cublaslt_gemm.h`,
`linear_gemms.h`, `weight_grad_target.h`)."""

STALE_LOCK_S = 600.0
"""Age past which an extension's build lock is taken for one a killed build left: a build takes
about a minute, and PyTorch's loader would wait for the file forever."""

_POLL_S = 0.5


class NativeExtension:
    """A C++ extension loaded once per process, at the first `module()` call.

    Args:
        name: the extension's name; the GPU's architecture (a build cached for another GPU
            has no kernels for this one, and PyTorch would reuse it) and the sources' digest
            (`source_digest`) are appended.
        sources: its source files.
        switch: the environment variable that, set to 0, keeps the callers' Python path.
        users: what runs the extension, for the log and the warning ("FP8 linear layers").
        extra_ldflags: the linker flags, made at the build (they may read the process's state).
        setup: called with the loaded module once, before any caller gets it.
    """

    def __init__(
        self,
        name: str,
        sources: Sequence[str],
        switch: str,
        users: str,
        extra_ldflags: Callable[[], list[str]] = list,
        setup: Callable[[ModuleType], None] | None = None,
    ) -> None:
        self._name = name
        self._sources = list(sources)
        self._switch = switch
        self._users = users
        self._extra_ldflags = extra_ldflags
        self._setup = setup
        self._module: ModuleType | None = None
        self._tried = False
        self._suspended = False

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside it `module()` says None, so that the callers run their Python path: the two
        side by side in one process (tests, benchmarks). A flag of the process, not of the
        thread."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    def module(self) -> ModuleType | None:
        """The built extension, or None where it is switched off, suspended or does not build.
        Called at every pass of the callers' layers: after the first call, attribute reads."""
        if self._suspended:
            return None
        if self._tried:
            return self._module
        self._tried = True
        if os.environ.get(self._switch, "1") == "0":
            return None
        try:
            from torch.utils.cpp_extension import load

            _logger.info(f"Loading the {self._users}' C++ extension (built at its first use).")
            major, minor = torch.cuda.get_device_capability()
            name = f"{self._name}_sm{major}{minor}_{source_digest(self._sources)}"
            self._wait_for_other_builds(name)
            module = load(
                name=name,
                sources=self._sources,
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3"],
                extra_ldflags=self._extra_ldflags(),
                extra_include_paths=[_SHARED_HEADERS],
                with_cuda=True,  # every extension here runs on CUDA; not all have .cu sources
                verbose=False,
            )
            if self._setup is not None:
                self._setup(module)
            self._module = module
        except Exception as error:  # no compiler, nvcc or ninja, a failed build: Python runs
            source_dir = os.path.dirname(self._sources[0])
            warnings.warn(
                f"The {self._users} run their Python path: the C++ extension in {source_dir} was "
                f"not built ({type(error).__name__}: {str(error).strip()[:300]}). Install a C++ "
                f"compiler, ninja and the CUDA toolkit's nvcc to build it, or set "
                f"{self._switch}=0 to silence this.",
                stacklevel=3,
            )
        return self._module

    def _wait_for_other_builds(self, name: str) -> None:
        """Returns once no build of extension `name` holds its lock: another process's build
        finished, or the lock is older than `STALE_LOCK_S` (a killed build's), which is then
        removed. PyTorch's loader then builds or loads as usual."""
        try:
            from torch.utils.cpp_extension import _get_build_directory

            lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        except Exception:  # a PyTorch whose private helper differs: its loader waits as it does
            return
        announced = False
        while True:
            try:
                seen = os.stat(lock)
            except FileNotFoundError:
                return
            age = time.time() - seen.st_mtime
            if age > STALE_LOCK_S:
                if _remove_if_unchanged(lock, seen):
                    warnings.warn(
                        f"Removed {lock}, left {age / 60:.0f} minutes ago by a build of the "
                        f"{self._users}' C++ extension that did not finish (a killed process).",
                        stacklevel=4,
                    )
                continue
            if not announced:
                _logger.warning(
                    f"Waiting for another process's build of the {self._users}' C++ extension "
                    f"(its lock file {lock}); if no process is building it, a killed build left "
                    f"the file: delete it, or it is removed {STALE_LOCK_S / 60:.0f} minutes "
                    "after it was made."
                )
                announced = True
            time.sleep(_POLL_S)


def source_digest(sources: Sequence[str]) -> str:
    """12 hex digits of a hash of `sources` and of the headers they may include: those beside
    them and the shared ones (`_SHARED_HEADERS`), by file name and contents, wherever they are.

    Raises:
        OSError: a source cannot be read.
    """
    headers: set[str] = set()
    for directory in {os.path.dirname(source) for source in sources} | {_SHARED_HEADERS}:
        headers.update(glob.glob(os.path.join(directory, "*.h")))
    files = [_named_contents(path) for path in sources]
    files += sorted(map(_named_contents, headers))
    digest = hashlib.sha256()
    for name, contents in files:
        digest.update(b"%d:%s%d:" % (len(name), name, len(contents)) + contents)
    return digest.hexdigest()[:12]


def _named_contents(path: str) -> tuple[bytes, bytes]:
    with open(path, "rb") as file:
        return os.path.basename(path).encode(), file.read()


def cublaslt_library() -> list[str]:
    """The linker argument for cuBLASLt (the extensions that include `csrc/cublaslt_gemm.h`): the
    library file this process loaded with torch (the same library the extension then calls),
    else the toolkit's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                # address, permissions, offset, device, inode, then the path (spaces and all)
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if os.path.basename(path).startswith("libcublasLt.so") and os.path.exists(path):
                    return [path]
    except OSError:  # not Linux
        pass
    return ["-lcublasLt"]


def _remove_if_unchanged(lock: str, seen: os.stat_result) -> bool:
    """Removes `lock` if it is still the file `seen` describes; returns whether it removed it.

    Several processes may find the same stale lock: the first removes it and its loader makes a
    new one. The file is first renamed away (atomic), and deleted only if it is the one seen
    (same inode and modification time: a new lock may reuse the inode); another is put back
    where no process has made one since.
    """
    moved = f"{lock}.stale.{os.getpid()}.{threading.get_ident()}"
    try:
        os.rename(lock, moved)
    except FileNotFoundError:  # removed by another process
        return False
    now = os.stat(moved)
    if (now.st_ino, now.st_mtime_ns) == (seen.st_ino, seen.st_mtime_ns):
        os.remove(moved)
        return True
    with contextlib.suppress(FileExistsError):  # a build's live lock: given back
        os.link(moved, lock)
    os.remove(moved)
    return False
