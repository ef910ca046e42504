"""The cyclic garbage collector set for a worker process's life: what start-up loaded frozen, young passes rarer.

CPython runs a pass of its cyclic collector every 700 container allocations (net of frees), and every tenth
pass of a generation runs the next one. A worker on short requests allocates a few hundred containers per
request (the message, the request, its outputs, the result), so passes are frequent, and the rare full passes
walk everything alive: the model's modules, torch's and transformers' tables, the tokenizer. Measured on
16-token echo requests (ops/bench/README.md, 2026-12-07, third session): tuned as below, a worker spends a sixth
less CPU per result (248 -> 207 us), most of it saved on the full passes.

So, once the engine is built: one collection, then ``gc.freeze()`` moves every object alive into a permanent
generation that no pass walks (they are still freed by reference counting as before), and the youngest
generation's threshold is raised so a pass runs every ``young_threshold`` allocations: a step's objects die by
reference counting long before either, so the passes find the same garbage, run less often and walk less.
vLLM's and SGLang's engine processes freeze after start-up for the same reason.

Only a process the worker owns does this (``run_worker``: the CLI's ``worker``; ``cli/local_worker.py``: the worker
of ``serve --model`` and ``bulk --model``): a :class:`Worker` embedded in another program (the tests, an application
that builds one itself) leaves that program's collector alone.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)


def tune_gc(young_threshold: int) -> None:
    """Collect, freeze what survives, and pass over the youngest generation every ``young_threshold``
    allocations (the older generations' ratios kept); 0 leaves the collector as it is."""
    if young_threshold == 0:
        return
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    # NOTE: back to the collector at exit: the interpreter's last collections skip frozen objects, and extensions that
    # count theirs at exit (nanobind's, in triton and xgrammar) would print a "leaked" report of dozens of lines
    atexit.register(gc.unfreeze)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold, older, oldest)
    log.info("garbage collector tuned", extra={
        "event": "gc_tuned", "frozen_objects": gc.get_freeze_count(), "young_threshold": young_threshold,
        "took_ms": round(1e3 * (time.perf_counter() - start), 1)})
