"""A step that fails on one tensor-parallel rank, in the middle of its forward, for one request (a fault injected by
tests/tp_faults.py: in decoder layer 1, after layer 0's all-reduces): every rank fails the step together, rank 0
retries it in halves that every rank runs in lockstep, the request ends with an ``internal`` error naming the fault,
and every other request gets the tokens it gets without the faulty one, with no hang; the engine steps on."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests import tp_faults
from tests.e2e.parity_helpers import random_prompts
from tests.engine_helpers import build_engine
from tests.tiny_models import VOCAB_SIZE
from tokenmill.engine import Engine
from tokenmill.protocol.outcomes import FinishReason
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
POISON, LAYER = 5, 1  # a prompt starting with token POISON fails in decoder layer 1 (of 2) on the faulty rank
MAX_TOKENS = 8
SETTINGS: dict[str, Any] = dict(device="cpu", dtype="float64", block_size=4, max_prefill_chunk=7,
                                max_num_batched_tokens=64, kv_cache_memory="8MiB", swap_space="8MiB")


def _prompts(count: int, seed: int) -> list[list[int]]:
    return [[t if t != POISON else POISON + 1 for t in p] for p in random_prompts(VOCAB_SIZE, count, seed=seed,
                                                                                 max_len=30)]


def _run(engine: Engine, prompts: list[list[int]], poison: list[int] | None, deadline_s: float = 60.0
         ) -> dict[str, Any]:
    """Every prompt's final output; the poison prompt (if any) joins after two steps, beside decodes in flight."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    finals: dict[str, Any] = {}
    deadline = time.monotonic() + deadline_s
    steps = 0
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine did not finish its requests in time"
        if steps == 2 and poison is not None:
            engine.add_request("poison", poison, params)
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        steps += 1
    return finals


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("faulty_rank", "transport"), [(0, "shared_memory"), (1, "shared_memory"), (1, "gloo")])
def test_a_step_failing_on_one_rank_is_isolated_in_lockstep(faulty_rank: int, transport: str,
                                                             tiny_model_dirs: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tiny_model_dirs["llama"])
    prompts, later = _prompts(6, seed=3), _prompts(2, seed=4)
    reference = build_engine(path, **SETTINGS)
    try:
        expected = {rid: out.token_ids for rid, out in _run(reference, prompts, None).items()}
        expected_later = {rid: out.token_ids for rid, out in _run(reference, later, None).items()}
    finally:
        reference.close()
    if faulty_rank == 0:
        tp_faults.install(POISON, LAYER, monkeypatch.setattr)
    else:  # the followers start with the fault installed (tests/tp_fault_site/sitecustomize.py)
        monkeypatch.setenv(tp_faults.FAULT_ENV, f"{POISON}:{LAYER}")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tp_faults.SITE_DIR, str(REPO_ROOT),
                                                                        os.environ.get("PYTHONPATH")])))
    engine = build_engine(path, **SETTINGS, tensor_parallel_size=2, tensor_parallel_cpu_all_reduce=transport)
    try:
        poison = [POISON] + _prompts(1, seed=5)[0]
        finals = _run(engine, prompts, poison)
        failed = finals.pop("poison")
        assert failed.finish_reason == FinishReason.ERROR, failed
        assert "InjectedFault" in (failed.error or ""), failed.error
        if faulty_rank:
            assert "rank 1" in (failed.error or ""), failed.error
        assert {rid: out.token_ids for rid, out in finals.items()} == expected
        # the engine and its follower step on, in step
        assert {rid: out.token_ids for rid, out in _run(engine, later, None).items()} == expected_later
    finally:
        engine.close()
