"""Builds one C++ source into a CPython extension module on first use and imports it once per process: host code
that needs no torch (the speculator's n-gram index, engine/spec/csrc/ngram_index.cpp), so an engine without a model
(the echo model) loads it without torch.

The cache rules are the torch extensions' (engine/kernels/cpp_build.py): a folder under ``TOKENMILL_HOME`` keyed by
everything the binary depends on (the source, the Python build, the compiler, the CPU's flags, the compiler flags),
built under an flock, so a binary is only loaded where it was built and two processes never build it at once.
Building needs a C++ compiler only (no ninja, no torch). Failure is not fatal: :meth:`PythonModule.load` logs why
once, at WARNING, and returns None; callers keep their Python path. Standard library only.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

from tokenmill.engine.kernels.cpp_build import (
    BUILD_ERRORS,
    TOOLCHAIN_HINT,
    cache_home,
    compiler,
    compiler_version,
    cpu_flags,
    failure_reason,
)

logger = logging.getLogger(__name__)


class PythonModule:
    """One C++ source built into the CPython extension module ``name`` (its ``PyInit_<name>``).

    Args:
        name: the module's name (also the cache folder's prefix).
        source: the ``.cpp`` file.
        what: how the log names it ("C++ n-gram index").
        fallback: what callers do without it, for the log ("the Python index is used").
        cflags: compiler flags; part of the cache key.
    """

    def __init__(self, name: str, source: Path, what: str, fallback: str,
                 cflags: tuple[str, ...] = ("-O2", "-std=c++17")) -> None:
        self.name, self.source, self.what, self.fallback, self.cflags = name, source, what, fallback, cflags
        self._lock = threading.Lock()
        self._module: ModuleType | None = None
        self._tried = False

    def build_directory(self) -> Path:
        """``$TOKENMILL_HOME/python_extensions/<name>-<hash>`` (not created)."""
        key = hashlib.sha256()
        suffix = str(sysconfig.get_config_var("EXT_SUFFIX"))
        for part in (self.source.read_bytes(), sys.version.encode(), suffix.encode(), platform.machine().encode(),
                     cpu_flags().encode(), compiler_version().encode(), " ".join(self.cflags).encode()):
            key.update(part)
            key.update(b"\0")
        return cache_home() / "python_extensions" / f"{self.name}-{key.hexdigest()[:16]}"

    def load(self) -> ModuleType | None:
        """The module: built (or found built) and imported on the first call (thread-safe); None, after a
        warning the first time, when it cannot be built or imported here."""
        if self._tried:
            return self._module
        with self._lock:
            if not self._tried:
                try:
                    self._module = self._build_and_import()
                except BUILD_ERRORS as exc:
                    logger.warning("%s unavailable (%s): %s", self.what, self.fallback, failure_reason(exc))
                self._tried = True
        return self._module

    def _build_and_import(self) -> ModuleType:
        if not self.source.is_file():
            raise RuntimeError(f"its C++ source is not installed ({self.source}): this tokenmill was installed "
                               "without its package data; reinstall it from a current checkout or wheel")
        program = compiler()
        if shutil.which(program) is None:
            raise RuntimeError(f"no C++ compiler ({program!r} is not on PATH); {TOOLCHAIN_HINT}")
        folder = self.build_directory()
        binary = folder / f"{self.name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
        if not binary.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "tokenmill.flock", "w") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX)
                if not binary.is_file():  # NOTE: built by whoever held the lock before
                    self._compile(program, binary)
        spec = importlib.util.spec_from_file_location(self.name, binary)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {binary}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _compile(self, program: str, binary: Path) -> None:
        """Compile into a temporary file and rename it into place (a killed build leaves no half binary)."""
        partial = binary.with_name(f"{binary.name}.{os.getpid()}.partial")
        command = [program, *self.cflags, "-shared", "-fPIC", "-fvisibility=hidden",
                   f"-I{sysconfig.get_paths()['include']}", str(self.source), "-o", str(partial)]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"the build failed ({' '.join(command)}):\n{done.stderr.strip()}")
        os.replace(partial, binary)
        logger.debug("%s built in %.1f s (%s)", self.what, time.perf_counter() - start, binary)
