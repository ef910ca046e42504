"""Builds the engine's C++ CPU extensions on first use and loads them once per process.

Each extension is one source file, compiled by ``torch.utils.cpp_extension`` into a cache folder
keyed by everything its binary depends on (source, the engine's headers it includes, torch build,
compiler, CPU flags, compiler flags), so a binary is only ever loaded where it was built, and a
rebuild happens exactly when one of those changes. The cache lives under ``TOKENMILL_HOME``, never
next to the sources, so an install in a read-only site-packages builds too. Building needs a C++
compiler and ninja on the machine that runs the engine; the sources ship as package data
(pyproject.toml). Failure is not fatal: :meth:`CppExtension.is_available` logs why once, at
WARNING, and callers use their plain-torch path. Imports torch only to build (the toolchain helpers here
serve engine/kernels/python_module.py's torch-free builds too).
NOTE: measurements behind these choices: ops/bench/README.md, "Figures behind the kernels' comments".
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

# The AMX tile unit's permission and configuration, shared by the kernels that use it.
AMX_TILES_HEADER = Path(__file__).resolve().parent / "csrc" / "amx_tiles.h"


@functools.cache
def _cpuinfo(keys: tuple[str, ...]) -> str | None:
    """The value of the first of ``keys`` in /proc/cpuinfo (None: none, or no such file); read once
    per process per question (the kernel choice asks several times while a model loads)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """The CPU's feature flags (x86 ``flags`` / Arm ``Features``), else the processor name."""
    flags = _cpuinfo(("flags", "Features"))
    return " ".join(sorted(flags.split())) if flags is not None else platform.processor()


def cpu_vendor() -> str:
    """The CPU's vendor (x86 ``vendor_id``: ``AuthenticAMD``, ``GenuineIntel``), else ``""``."""
    return _cpuinfo(("vendor_id",)) or ""


def compiler() -> str:
    """The C++ compiler builds invoke: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")  # what torch.utils.cpp_extension invokes on Linux


def compiler_version() -> str:
    """What the compiler says of itself (``--version``): part of every build's cache key."""
    return subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True, timeout=30).stdout


def cache_home() -> Path:
    """``$TOKENMILL_HOME`` (default ``~/.cache/tokenmill``), where built extensions are cached."""
    return Path(os.environ.get("TOKENMILL_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"))


# What a failed build or load raises (the callers' fallback takes over).
BUILD_ERRORS = (RuntimeError, OSError, subprocess.SubprocessError, ImportError)


def failure_reason(exc: BaseException) -> str:
    """A failed build's message for the log: its head and tail (it ends with the compiler's errors)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return "\n".join(lines if len(lines) <= 21 else [*lines[:1], "...", *lines[-20:]])


# What to install when the toolchain is missing: said once, in the warning that reports it.
TOOLCHAIN_HINT = ("install a C++ compiler and ninja (Debian/Ubuntu: apt-get install g++ ninja-build; "
                  "Fedora/RHEL: dnf install gcc-c++ ninja-build; ninja also comes with pip install ninja) "
                  "or point CXX at a compiler")
_toolchain_lock = threading.Lock()


@functools.cache
def _missing_toolchain(program: str) -> str | None:
    from torch.utils import cpp_extension  # noqa: PLC0415 - imports setuptools (~0.1 s): only builds need it

    missing = [f"no C++ compiler ({program!r} is not on PATH)"] if shutil.which(program) is None else []
    if not cpp_extension.is_ninja_available():
        missing.append("no ninja (torch builds extensions with it)")
    if not missing:
        return None
    problem = " and ".join(missing)
    logger.warning("the C++ CPU kernels cannot be built here: %s; %s. Until then the engine runs its slower "
                   "plain-torch paths", problem, TOOLCHAIN_HINT)
    return problem


def missing_toolchain() -> str | None:
    """What stops every extension from building on this machine (None: nothing).

    NOTE: every extension needs the same compiler and ninja, so what is missing (and what to
    install) is logged once per process, not once per extension; the extensions' builds start
    side by side on their own threads, hence the lock.
    """
    with _toolchain_lock:
        return _missing_toolchain(compiler())


class CppExtension:
    """One C++ source built into a torch extension library (ops and classes register on load).

    Args:
        name: the library's name (also the cache folder's prefix).
        source: the ``.cpp`` file.
        cflags: compiler flags; part of the cache key.
        headers: the engine's own headers the source includes (their contents join the cache key).
        what: how the log names it ("CPU paged-attention kernel").
        fallback: what callers do without it, for the log ("reference path used").
        after_load: run once after loading (e.g. registering fake implementations).
    """

    def __init__(self, name: str, source: Path, cflags: tuple[str, ...], what: str, fallback: str,
                 after_load: Callable[[], None] | None = None, headers: tuple[Path, ...] = ()) -> None:
        self.name, self.source, self.cflags, self.headers = name, source, cflags, headers
        self.what, self.fallback = what, fallback
        self._after_load = after_load
        self._lock = threading.Lock()
        self._loaded: bool | None = None  # None: not tried yet

    def build_directory(self) -> Path:
        """Where this source, torch build, compiler and CPU's binary lives (created on demand).

        ``$TOKENMILL_HOME/torch_extensions/<name>-<hash>``; ``TOKENMILL_HOME`` defaults to
        ``~/.cache/tokenmill``.
        """
        import torch  # noqa: PLC0415 - the key names the torch build; importing this module needs no torch

        key = hashlib.sha256()
        sources = (self.source, *self.headers)
        for part in (*(path.read_bytes() for path in sources), torch.__version__.encode(),
                     str(torch.version.git_version).encode(), platform.machine().encode(), cpu_flags().encode(),
                     compiler_version().encode(), " ".join(self.cflags).encode()):
            key.update(part)
            key.update(b"\0")
        return cache_home() / "torch_extensions" / f"{self.name}-{key.hexdigest()[:16]}"

    def _build_and_load(self) -> None:
        """Compile (or reuse) the extension and load it into this process.

        NOTE: cpp_extension serialises builds in one folder with a lock *file* that stays behind if
        its builder is killed, blocking every later load forever. An flock (released by the kernel
        when its holder dies) is held around the whole build; whoever holds it may remove that file.
        """
        from torch.utils import cpp_extension  # noqa: PLC0415 - imports setuptools (~0.1 s): only builds need it

        absent = [str(path) for path in (self.source, *self.headers) if not path.is_file()]
        if absent:
            raise RuntimeError(f"its C++ sources are not installed ({', '.join(absent)}): this tokenmill was "
                               "installed without its package data; reinstall it from a current checkout or wheel")
        problem = missing_toolchain()
        if problem is not None:
            raise RuntimeError(f"{problem}; see the warning above for what to install")
        folder = self.build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "tokenmill.flock", "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            (folder / "lock").unlink(missing_ok=True)
            start = time.perf_counter()
            cpp_extension.load(
                name=self.name,
                sources=[str(self.source)],
                extra_cflags=list(self.cflags),  # a copy: load() appends to its lists
                build_directory=str(folder),
                is_python_module=False,
            )
        logger.debug("%s ready in %.1f s (%s)", self.what, time.perf_counter() - start, folder)
        if self._after_load is not None:
            self._after_load()

    def build_in_background(self) -> None:
        """Start building and loading now, on a daemon thread; :meth:`is_available` waits for it.

        On a machine's first start each build keeps one core busy for a while; started early,
        builds run side by side and overlap the model's loading.
        """
        if self._loaded is None:
            threading.Thread(target=self.is_available, name=f"build-{self.name}", daemon=True).start()

    def is_available(self) -> bool:
        """Whether the extension is loaded: builds and loads it on the first call (thread-safe).

        Returns:
            False, after logging the reason once, when there is no C++ compiler or the build or
            load fails.
        """
        if self._loaded is not None:
            return self._loaded
        with self._lock:
            if self._loaded is None:
                try:
                    self._build_and_load()
                    self._loaded = True
                except BUILD_ERRORS as exc:
                    logger.warning("%s unavailable (%s): %s", self.what, self.fallback, failure_reason(exc))
                    self._loaded = False
            return self._loaded
