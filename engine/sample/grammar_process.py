"""Grammar compilation in a child process, under a time and a memory limit.

A structured-output spec can be small and still take xgrammar minutes and gigabytes to compile (a
3 KB regex of nested counted repetitions took 27 s here; a 3.5 MB alternation 244 s and 2.85 GB).
In a thread nothing can stop it; in a child process it is killed at its limits and the request is
answered with a ``validation`` error. The compiled grammar comes back serialized
(``CompiledGrammar.serialize_json``, milliseconds) and is rebuilt over the parent's tokenizer info.

One child serves one engine, one compile at a time; it is started on first use (or by a warm-up at
worker start: :meth:`GrammarProcess.start`), and a killed child is replaced by the next compile. The
xgrammar calls themselves (``compile_spec``, ``describe_native_error``) live here, for the child and
for in-thread compiles (engine/sample/grammar.py) alike. Imports xgrammar only inside the child and
on first use.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import resource
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from tokenmill.engine.errors import GrammarError
from tokenmill.engine.sample.grammar_bounds import GrammarBounds, analyze

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[time] /path/file.cc:line: " (and sometimes a failed check): drop that.
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+: (Check failed: \(.*?\) is false: )?")
_START_TIMEOUT_S = 120.0  # the child imports xgrammar (and torch) and rebuilds the tokenizer info
_START_POLL_S = 0.1  # how soon a start in progress sees close()


@dataclass(frozen=True)
class CompileLimits:
    """What one compilation may take."""

    timeout_s: float  # wall-clock seconds for one spec
    memory_bytes: int  # address space the child may grow by beyond what it holds when ready


class GrammarProcess:
    """A child process that compiles specs for one tokenizer.

    Args:
        tokenizer_info_json: ``xgrammar.TokenizerInfo.serialize_json()`` of the model's tokenizer.
        limits: the time and memory each compilation may take.
    """

    def __init__(self, tokenizer_info_json: str, limits: CompileLimits) -> None:
        self._tokenizer_info_json = tokenizer_info_json
        self.limits = limits
        self._lock = threading.Lock()  # one compile at a time: the child is single-threaded
        self._process: Any = None  # multiprocessing.Process (spawn context)
        self._conn: Connection | None = None
        self._closing = threading.Event()  # close() was called: a start in progress gives up

    def compile(self, kind: str, spec: str) -> tuple[str, GrammarBounds]:
        """The serialized compiled grammar of ``spec`` (``kind``: regex, grammar or json_schema), with its
        bounds (engine/sample/grammar_bounds.py, found in the child under the same limits).

        Raises:
            GrammarError: the spec is invalid, can never end, or its compilation ran past a limit (the
                child is killed and replaced).
        """
        with self._lock:
            conn = self._ready_connection()
            conn.send((kind, spec))
            if not conn.poll(self.limits.timeout_s):
                self._kill()
                raise GrammarError(f"the {kind} took longer than {self.limits.timeout_s:g} s to compile "
                                   "(simplify it, e.g. fewer or smaller counted repetitions)")
            try:
                is_ok, payload = conn.recv()
            except (EOFError, OSError):
                self._kill()
                raise GrammarError(f"compiling the {kind} needed more than {self.limits.memory_bytes >> 20} MiB "
                                   "of memory") from None
        if not is_ok:
            raise GrammarError(payload)
        serialized, bounds = payload
        return serialized, GrammarBounds(*bounds)

    def start(self) -> None:
        """Start the child now unless it runs (a warm-up: a compile then finds it ready).

        Raises:
            GrammarError: the child did not start.
        """
        with self._lock:
            try:
                self._ready_connection()
            except GrammarError:
                if not self._closing.is_set():
                    raise  # NOTE: stopped by close(): a warm-up that is no longer wanted, not a failure

    def close(self) -> None:
        """Stop the child (a later compile starts a new one). A start in progress (a warm-up's: tens of seconds
        under load) gives up at once rather than making a shutting-down worker wait for it."""
        self._closing.set()
        try:
            with self._lock:
                self._kill()
        finally:
            self._closing.clear()

    def _ready_connection(self) -> Connection:
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self._kill()
        context = multiprocessing.get_context("spawn")  # NOTE: never fork a process that holds torch threads
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, self._tokenizer_info_json, self.limits.memory_bytes),
                                  name="tm-grammar", daemon=True)
        started = time.monotonic()
        process.start()
        child.close()
        if not self._started(parent, process, started + _START_TIMEOUT_S):
            process.kill()
            process.join(timeout=5.0)
            parent.close()
            raise GrammarError("the grammar compiler process was stopped while it started" if self._closing.is_set()
                               else "the grammar compiler process did not start")
        logger.info("grammar compiler process started", extra={"event": "grammar_process_started",
                                                                "seconds": round(time.monotonic() - started, 2)})
        self._process, self._conn = process, parent
        return parent

    def _started(self, conn: Connection, process: Any, deadline: float) -> bool:
        """Whether the child said it is ready before ``deadline``, it died, or :meth:`close` was called."""
        while not conn.poll(_START_POLL_S):
            if self._closing.is_set() or not process.is_alive() or time.monotonic() > deadline:
                return False
        try:
            return bool(conn.recv() == "ready")
        except (EOFError, OSError):
            return False

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5.0)
        if self._conn is not None:
            self._conn.close()
        self._process, self._conn = None, None


def _serve(conn: Connection, tokenizer_info_json: str, memory_bytes: int) -> None:
    """The child's loop: compile what arrives, send back ``(True, serialized)`` or ``(False, why)``."""
    # NOTE: a long compile (or the start, importing torch: a warm-up runs it beside the engine) must not take a
    # core from the engine's threads (preparation.py)
    os.nice(19)
    import xgrammar  # noqa: PLC0415 - only the child needs it

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    # NOTE: the limit counts from here: the child's own imports are not the spec's fault.
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + memory_bytes, hard))
    conn.send("ready")
    while True:
        try:
            kind, spec = conn.recv()
        except EOFError:
            return
        try:
            compiled = compile_spec(compiler, kind, spec)
            bounds = analyze(compiled.grammar.serialize_json())
            conn.send((True, (compiled.serialize_json(), (bounds.allows_jump_forward, bounds.longest_rule_bytes))))
        except GrammarError as exc:
            conn.send((False, f"invalid response_format {kind}: {exc}"))
        except (MemoryError, RuntimeError) as exc:
            # NOTE: xgrammar's C++ reports an allocation past the limit as RuntimeError("std::bad_alloc").
            is_memory = isinstance(exc, MemoryError) or "bad_alloc" in str(exc)
            conn.send((False, f"compiling the {kind} needed more than {memory_bytes >> 20} MiB of memory"
                       if is_memory else describe_native_error(kind, exc)))


def compile_spec(compiler: Any, kind: str, spec: str) -> Any:
    """``compiler`` (an ``xgrammar.GrammarCompiler``) applied to one (kind, text) of
    :func:`engine.sample.grammar._spec_of`.

    Raises:
        RuntimeError: xgrammar refused the spec.
    """
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)


def describe_native_error(kind: str, exc: Exception) -> str:
    """xgrammar's error, without its C++ source location: what a user can act on."""
    message = _NATIVE_PREFIX.sub("", str(exc).strip()).splitlines()[0]
    return f"invalid response_format {kind}: {message}"


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * resource.getpagesize()
