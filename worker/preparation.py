"""Preparing admitted requests off the engine thread: tokenizing prompts and compiling grammars (short prompts
that arrive while the engine is idle are tokenized on its thread, which has nothing else to do).

Two lanes, so that a large job never delays a small one: requests with a long prompt or a
structured ``response_format`` go to the heavy lane (tokenizing a 4 MB prompt takes seconds; a
grammar compiles in a child process for up to ``[engine.structured_output] compile_timeout_s``),
everything else to the light lane, which therefore only ever waits for small prompts. The light lane
prepares a read's small requests in one job (up to ``HEAVY_PROMPT_CHARS`` of prompts), whose results
come back to the engine thread through its inbox in one ``PreparedBatch``: a hand-off per request cost
the engine thread a future, two queue operations and a thread switch each.

Imports the worker's messages and the engine's torch-free front (engine.engine); never torch or Redis.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from tokenmill.engine.engine import Engine
from tokenmill.worker.convert import engine_prompt
from tokenmill.worker.messages import Admit, Incoming, Prepared, PreparedBatch

HEAVY_PROMPT_CHARS = 64 * 1024  # prompts longer than this (text, or all messages' content) take the heavy lane
# an idle engine thread prepares a read's light requests itself when their prompts hold this many characters or fewer
# together (well under a millisecond of tokenizing): at light load the lane's two thread hand-offs were a fifth of a
# short request's round trip (ops/bench/README.md, 2026-12-07)
INLINE_PROMPT_CHARS = 1024
NUM_HEAVY_THREADS = 2  # a large prompt and a grammar compile may run side by side
HEAVY_NICE = 10  # the heavy lane's threads' nice value


class Preparation:
    """Runs each admit's tokenization and grammar compilation in its lane.

    Args:
        engine: tokenizes (thread-safe) and compiles grammars (thread-safe, in a child process).
        inbox: the engine thread's inbox, which receives every ``PreparedBatch``.
    """

    def __init__(self, engine: Engine, inbox: queue.Queue[Incoming]) -> None:
        self._engine = engine
        self._inbox = inbox
        self._light = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-prepare")
        self._heavy = ThreadPoolExecutor(max_workers=NUM_HEAVY_THREADS, thread_name_prefix="tm-prepare-heavy",
                                         initializer=_yield_to_the_engine)

    def submit(self, admits: list[Admit], inline: bool = False) -> list[Prepared]:
        """Prepare ``admits``: each heavy one in a job of its own, the light ones together in jobs of up to
        ``HEAVY_PROMPT_CHARS`` of prompts (so none waits long for the others); the results arrive in the inbox.

        Args:
            inline: the caller's thread has nothing else to do: if the light ones' prompts hold at most
                ``INLINE_PROMPT_CHARS`` together, prepare them here and now and return them (two thread hand-offs
                would only add to their wait).
        """
        light = [admit for admit in admits if not is_heavy(admit)]
        if inline and light and sum(prompt_chars(admit) for admit in light) <= INLINE_PROMPT_CHARS:
            if len(light) < len(admits):
                self.submit([admit for admit in admits if is_heavy(admit)])
            return [self._prepare_one(admit) for admit in light]
        job: list[Admit] = []
        job_chars = 0
        for admit in admits:
            if is_heavy(admit):
                self._heavy.submit(self._prepare, [admit])
                continue
            chars = prompt_chars(admit)
            if job and job_chars + chars > HEAVY_PROMPT_CHARS:
                self._light.submit(self._prepare, job)
                job, job_chars = [], 0
            job.append(admit)
            job_chars += chars
        if job:
            self._light.submit(self._prepare, job)
        return []

    def close(self) -> None:
        """Stop both lanes (requests still being prepared stay pending in Redis)."""
        for lane in (self._light, self._heavy):
            lane.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, admits: list[Admit]) -> None:
        self._inbox.put(PreparedBatch([self._prepare_one(admit) for admit in admits]))

    def _prepare_one(self, admit: Admit) -> Prepared:
        try:
            prompt_token_ids = self._engine.tokenize(engine_prompt(admit.request))
            self._engine.compile_grammar(admit.request.params)
            return Prepared(admit, prompt_token_ids)
        except Exception as exc:  # noqa: BLE001 - any failure is this request's error result
            return Prepared(admit, None, exc)


def _yield_to_the_engine() -> None:
    """Lower this thread's scheduling priority (Linux: a thread has its own nice value).

    NOTE: a heavy preparation keeps a core busy for seconds; at equal priority it takes that core
    from one of torch's threads, and every parallel region of a step then waits for the thread that
    lost it. Niced, it runs on what the engine leaves idle.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HEAVY_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at the same priority
        pass


def is_heavy(admit: Admit) -> bool:
    """Whether preparing ``admit`` may take long: a long prompt, or a grammar to compile."""
    return admit.request.params.is_structured or prompt_chars(admit) > HEAVY_PROMPT_CHARS


def prompt_chars(admit: Admit) -> int:
    """The characters of ``admit``'s prompt (text, or all messages' content; 0 for token ids)."""
    request = admit.request
    if request.prompt is not None:
        return len(request.prompt)
    if request.messages is not None:
        return sum(len(m.content) for m in request.messages)
    return 0
