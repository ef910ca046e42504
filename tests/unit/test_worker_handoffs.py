"""Hand-offs between the worker's threads come in batches: a read's admits reach the engine thread in one put,
are prepared in one job (split where their prompts add up past HEAVY_PROMPT_CHARS) and come back in one put, and an
iteration of the engine loop sends the writer all it produced in one put. The engine loop keeps the live ids it
publishes and the deadlines it checks beside its table of live requests: they must say what the table says."""

from __future__ import annotations

import queue
import time
from typing import Any

from tokenmill.engine import Engine, EngineConfig
from tokenmill.protocol.keys import Keys
from tokenmill.protocol.schema import GenerationRequest
from tokenmill.worker.loop import EngineLoop
from tokenmill.worker.messages import Abort, Admit, AdmitBatch, Entry, Finish, Incoming, Outbound, PreparedBatch
from tokenmill.worker.preparation import HEAVY_PROMPT_CHARS, Preparation
from tokenmill.worker.state import Load

KEYS = Keys("handoffs")


def _admit(i: int, **fields: Any) -> Admit:
    request = GenerationRequest(id=f"r{i}", **{"prompt": f"prompt {i}", "params": {"max_tokens": 4}, **fields})
    return Admit(request, Entry(KEYS.lane(0), f"{i}-0", 0), time.time())


def _engine(max_model_len: int = 1024, model: str = "echo", max_num_seqs: int = 64,
            speculative: str = "auto") -> Engine:
    return Engine.from_config(EngineConfig.model_validate({"model": {"name": model, "max_model_len": max_model_len},
                                                           "scheduler": {"max_num_seqs": max_num_seqs},
                                                           "speculative": {"method": speculative}}))


def _taken(inbox: queue.Queue[Incoming], num: int) -> list[Incoming]:
    return [inbox.get(timeout=10) for _ in range(num)]


def test_light_admits_are_prepared_in_one_job_split_at_heavy_prompt_chars() -> None:
    inbox: queue.Queue[Incoming] = queue.Queue()
    preparation = Preparation(_engine(4 * HEAVY_PROMPT_CHARS), inbox)
    try:
        preparation.submit([_admit(i) for i in range(5)])
        [batch] = _taken(inbox, 1)
        assert isinstance(batch, PreparedBatch)
        assert [p.admit.request.id for p in batch.prepared] == [f"r{i}" for i in range(5)]
        assert all(p.prompt_token_ids for p in batch.prepared)
        half = "x" * (HEAVY_PROMPT_CHARS // 2 + 1)  # two of them pass the bound: a job each
        preparation.submit([_admit(10, prompt=half), _admit(11, prompt=half), _admit(12)])
        jobs = _taken(inbox, 2)
        assert [[p.admit.request.id for p in job.prepared] for job in jobs if isinstance(job, PreparedBatch)] == [
            ["r10"], ["r11", "r12"]]
        assert inbox.empty()
    finally:
        preparation.close()


def _loop(**engine: Any) -> tuple[EngineLoop, queue.Queue[Incoming], queue.Queue[Outbound], Load]:
    inbox: queue.Queue[Incoming] = queue.Queue()
    outbox: queue.Queue[Outbound] = queue.Queue()
    load = Load()
    return EngineLoop(_engine(**engine), inbox, outbox, load, "w"), inbox, outbox, load


def _run_until(loop: EngineLoop, done: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the loop did not get there"
        loop.run_once(0.01)


def test_an_iteration_sends_the_writer_one_batch_and_live_ids_follow_the_table() -> None:
    loop, inbox, outbox, load = _loop()
    try:
        inbox.put(AdmitBatch([_admit(i) for i in range(6)]))
        _run_until(loop, lambda: len(load.live_ids) == 6)
        assert load.live_ids == {f"r{i}" for i in range(6)}
        inbox.put(Abort("r0", "cancelled"))
        sent: list[Finish] = []
        while len(sent) < 6:
            loop.run_once(0.01)
            while not outbox.empty():
                batch = outbox.get_nowait()
                assert isinstance(batch, list)  # NOTE: one put per iteration, whatever it produced
                sent += [item for item in batch if isinstance(item, Finish)]
            assert "r0" not in load.live_ids
        by_id = {finish.result.id: finish.result for finish in sent}
        assert by_id["r0"].status == "cancelled" and all(by_id[f"r{i}"].ok for i in range(1, 6))
        _run_until(loop, lambda: not load.live_ids)
        assert loop.num_live == 0
    finally:
        loop.close()


def test_a_deadline_expires_a_waiting_request_and_not_a_started_one() -> None:
    """One request runs at a time, a token per 10 ms step: the first starts before its deadline and runs past it;
    the second waits behind it until its deadline passes."""
    loop, inbox, outbox, load = _loop(model="echo:step_delay_s=0.01", max_num_seqs=1, speculative="off")
    try:
        deadline = time.time() + 0.3
        params = {"max_tokens": 60, "ignore_eos": True}
        inbox.put(AdmitBatch([_admit(1, deadline=deadline, params=params), _admit(2, deadline=deadline)]))
        results: dict[str, Any] = {}

        def answered() -> bool:
            while not outbox.empty():
                batch = outbox.get_nowait()
                assert isinstance(batch, list)
                results.update({item.result.id: item.result for item in batch if isinstance(item, Finish)})
            return len(results) == 2

        _run_until(loop, answered)
        assert results["r1"].ok and len(results["r1"].token_ids) == 60
        assert results["r2"].status == "expired"
        assert not load.live_ids
    finally:
        loop.close()


def test_deadlines_expire_only_requests_that_never_started_and_their_heap_stays_bounded() -> None:
    """Many requests with deadlines, one running at a time: those still waiting at their deadline expire with no
    tokens, the rest finish whole; the deadlines kept never outnumber twice the live requests by much, however many
    came and went: their number stays within twice the most requests live at once (an entry is dropped when due, or
    when an admission finds them outnumbering the live twice over)."""
    loop, inbox, outbox, load = _loop(model="echo:step_delay_s=0.002", max_num_seqs=1, speculative="off")
    try:
        soon, far = time.time() + 0.25, time.time() + 3600.0
        inbox.put(AdmitBatch([_admit(i, deadline=soon if i % 2 else far, params={"max_tokens": 4})
                              for i in range(300)]))
        results: dict[str, Any] = {}
        most_live = 0

        def answered() -> bool:
            nonlocal most_live
            most_live = max(most_live, loop.num_live)
            assert len(loop._deadlines) <= 2 * most_live + 65
            while not outbox.empty():
                batch = outbox.get_nowait()
                assert isinstance(batch, list)
                results.update({item.result.id: item.result for item in batch if isinstance(item, Finish)})
            return len(results) == 300

        _run_until(loop, answered, timeout_s=60.0)
        expired = {request_id for request_id, result in results.items() if result.status == "expired"}
        assert expired and all(int(request_id[1:]) % 2 for request_id in expired)  # only the soon ones
        assert all(not results[request_id].token_ids for request_id in expired)
        assert all(result.ok and len(result.token_ids) == 4 for request_id, result in results.items()
                   if request_id not in expired)
        assert not load.live_ids
        inbox.put(AdmitBatch([_admit(1000, deadline=far)]))  # NOTE: the next admission drops the finished ones' entries
        _run_until(loop, lambda: loop.num_live == 1)
        assert [request_id for _, request_id in loop._deadlines] == ["r1000"]
    finally:
        loop.close()
