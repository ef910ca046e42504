"""The overlapped loop (``[engine.execution] overlap``: the forward on a device thread while the previous step's
outputs are made and the next step is planned ahead, engine/core/scheduler.py ``schedule_ahead``) against the
synchronous loop, its reference, on the echo model: the same final outputs for every request whatever feature ends
or shapes it (stop strings and ids, min/max tokens, n > 1, logprobs, penalties, structured output, aborts, swap and
recompute preemption, prefix caching, speculation), nothing emitted past a stop, and every block given back."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_helpers import engine_config
from tokenmill.engine import Engine
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.sampling import SamplingParams

PROMPTS = ["hello world, stop here please", "the quick brown fox jumps over the lazy dog", "abcabcabcabcabc",
           "short", "a much longer prompt that runs on and on " * 4, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "plain": ({}, {"max_tokens": 40}),
    "stop-string": ({}, {"max_tokens": 200, "stop": ["o w", "fox", "bcab"], "ignore_eos": True}),
    "stop-id": ({}, {"max_tokens": 200, "stop_token_ids": [ord("e")], "ignore_eos": True}),
    "min-tokens": ({}, {"max_tokens": 60, "min_tokens": 50}),
    "n-samples": ({}, {"max_tokens": 30, "n": 3, "temperature": 1.0, "seed": 7}),
    "logprobs": ({}, {"max_tokens": 20, "logprobs": 2}),
    "swap": ({"kv_cache_memory": 320, "block_size": 4, "preemption_mode": "swap", "budget_kv": False},
             {"max_tokens": 120, "ignore_eos": True}),
    "recompute": ({"kv_cache_memory": 320, "block_size": 4, "preemption_mode": "recompute", "budget_kv": False},
                  {"max_tokens": 120, "ignore_eos": True}),
    "speculation": ({"method": "auto"}, {"max_tokens": 150, "ignore_eos": True, "stop": ["jumps over"]}),
    "no-speculation-prefix-cache": ({"method": "off", "block_size": 4}, {"max_tokens": 80, "ignore_eos": True}),
    # without drafts every step can be planned ahead: the stops below are found one step late there
    "ahead-stop-string": ({"method": "off"}, {"max_tokens": 200, "stop": ["o w", "fox", "bcab"], "ignore_eos": True}),
    "ahead-stop-id": ({"method": "off"}, {"max_tokens": 200, "stop_token_ids": [ord("e")], "ignore_eos": True}),
    "ahead-eos": ({"method": "off"}, {"max_tokens": 200}),
    "ahead-min-tokens": ({"method": "off"}, {"max_tokens": 60, "min_tokens": 50}),
    "ahead-logprobs-seeded": ({"method": "off"}, {"max_tokens": 20, "logprobs": 2, "temperature": 0.8, "seed": 3}),
    "ahead-swap": ({"method": "off", "kv_cache_memory": 320, "block_size": 4, "preemption_mode": "swap",
                    "budget_kv": False}, {"max_tokens": 120, "ignore_eos": True}),
    "penalties": ({"method": "off"}, {"max_tokens": 40, "repetition_penalty": 1.3, "presence_penalty": 0.5}),
    "structured": ({"method": "off"}, {"max_tokens": 40, "response_format": {"type": "json_object"}}),
}
# cases whose steps must have been planned ahead (the others may not be: drafts, penalties, a grammar)
AHEAD_CASES = {case for case in CASES if case.startswith("ahead-")} | {"no-speculation-prefix-cache"}


def _run(overlap: str, engine_settings: dict[str, Any], params: dict[str, Any],
         abort_after_steps: int | None = None) -> tuple[dict[str, RequestOutput], EngineStats]:
    engine = Engine.from_config(engine_config("echo:step_delay_s=0.0005", overlap=overlap, max_num_seqs=4,
                                              **engine_settings))
    assert engine.overlaps == (overlap == "on")
    for i, prompt in enumerate(PROMPTS * 2):
        engine.add_request(f"r{i}", list(prompt.encode()), SamplingParams(**params))
    finals: dict[str, RequestOutput] = {}
    streamed: dict[str, list[int]] = {}
    num_steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            streamed.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                assert output.request_id not in finals, "a request finished twice"
                finals[output.request_id] = output
        num_steps += 1
        if abort_after_steps is not None and num_steps == abort_after_steps:
            engine.abort("r1")
            engine.abort("r7")
    for request_id, output in finals.items():  # NOTE: nothing streamed past what the final output holds
        if output.samples is None:
            assert streamed[request_id] == output.token_ids, request_id
    engine.scheduler.check_invariants()  # NOTE: a request found finished a step late gave its blocks back
    stats = engine.stats()
    engine.close()
    return finals, stats


def _summary(output: RequestOutput) -> Any:
    if output.samples is not None:
        return [(s.token_ids, s.text, s.finish_reason) for s in output.samples]
    return output.token_ids, output.text, output.finish_reason, output.logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_the_overlapped_loop_gives_what_the_synchronous_one_gives(case: str) -> None:
    engine_settings, params = CASES[case]
    sync, _ = _run("off", engine_settings, params)
    overlapped, stats = _run("on", engine_settings, params)
    if case in ("swap", "recompute"):
        assert stats.counters.num_preemptions > 0, stats.counters
    if case == "swap":
        assert stats.counters.num_swap_outs > 0, stats.counters
    if case == "speculation":
        assert stats.speculation.num_accepted_tokens > 0, stats.speculation
    if case == "no-speculation-prefix-cache":
        assert stats.prefix.num_hit_tokens > 0, stats.prefix
    if case in AHEAD_CASES:  # NOTE: under memory pressure (swap) requests wait: then many steps are scheduled in full
        share = 0 if case == "ahead-swap" else stats.counters.num_steps // 2
        assert stats.counters.num_steps_ahead > share, stats.counters
    if case in ("penalties", "structured"):
        assert stats.counters.num_steps_ahead == 0, stats.counters
    assert sync.keys() == overlapped.keys() == {f"r{i}" for i in range(len(PROMPTS) * 2)}
    for request_id in sync:
        assert _summary(overlapped[request_id]) == _summary(sync[request_id]), (case, request_id)


def test_aborts_under_overlap_end_the_request_and_emit_nothing_after() -> None:
    finals, _ = _run("on", {}, {"max_tokens": 300, "ignore_eos": True}, abort_after_steps=5)
    assert finals["r1"].finish_reason == "abort" and finals["r7"].finish_reason == "abort"
    assert len(finals["r1"].token_ids) < 300
    assert all(out.finish_reason == "length" for rid, out in finals.items() if rid not in ("r1", "r7"))


def test_a_failed_step_drops_the_step_planned_ahead_of_it_and_the_others_go_on() -> None:
    """A forward failing on one request while the next step, planned ahead on its tokens, waits behind it: that step
    is dropped, the failed one is re-run in parts, the request it names ends with an error, and every other request
    gets the sync loop's tokens (the positions the dropped step computed are computed again)."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def run(overlap: str) -> tuple[dict[str, RequestOutput], EngineStats]:
        engine = Engine.from_config(engine_config("echo", overlap=overlap, max_num_seqs=8, method="off"))
        execute = engine.runner.execute
        calls = {"bad": 0}

        def failing(plan: Any) -> Any:
            for chunk in plan.chunks:
                if chunk.request_id == "r2" and chunk.num_output_tokens >= 5:
                    calls["bad"] += 1
                    raise RuntimeError("a bad row")
            return execute(plan)

        engine.runner.execute = failing  # type: ignore[method-assign]
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", list(prompt.encode()), params)
        finals = {}
        while engine.has_unfinished():
            finals.update({o.request_id: o for o in engine.step() if o.finished})
        engine.scheduler.check_invariants()
        stats = engine.stats()
        engine.close()
        assert calls["bad"] > 0
        return finals, stats

    sync, _ = run("off")
    overlapped, stats = run("on")
    assert stats.counters.num_steps_ahead > 0, stats.counters
    assert overlapped["r2"].finish_reason == sync["r2"].finish_reason == "error"
    assert overlapped["r2"].error_code == "internal"
    for request_id in sync:
        if request_id != "r2":
            assert overlapped[request_id].token_ids == sync[request_id].token_ids, request_id
            assert overlapped[request_id].finish_reason == "length"


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_request_nobody_streams_gets_the_same_final_text_from_two_outputs(overlap: str) -> None:
    """``add_request(streams=False)``: its first output (it started) and its final one only, the final one the same
    as a streamed request's, with stop strings, stop ids, an abort and multi-byte text."""
    prompts = PROMPTS + ["héllo wörld ✓ 日本語 ünïcode", "stop at the fox please"]
    params = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=80, stop=["fox", "ll"]),
              SamplingParams(max_tokens=80, stop_token_ids=[ord("w")], ignore_eos=True), SamplingParams(max_tokens=30)]

    def run(streams: bool) -> tuple[dict[str, RequestOutput], dict[str, int]]:
        engine = Engine.from_config(engine_config("echo", overlap=overlap, max_num_seqs=6, method="off"))
        for i, prompt in enumerate(prompts):
            for j, p in enumerate(params):
                engine.add_request(f"r{i}-{j}", list(prompt.encode()), p, streams=streams)
        finals: dict[str, RequestOutput] = {}
        counts: dict[str, int] = {}
        num_steps = 0
        while engine.has_unfinished():
            for output in engine.step():
                counts[output.request_id] = counts.get(output.request_id, 0) + 1
                if output.finished:
                    finals[output.request_id] = output
            num_steps += 1
            if num_steps == 4:
                engine.abort("r1-0")
        engine.close()
        return finals, counts

    streamed, streamed_counts = run(True)
    quiet, quiet_counts = run(False)
    assert streamed.keys() == quiet.keys()
    for request_id, output in streamed.items():
        assert _summary(quiet[request_id]) == _summary(output), request_id
        assert quiet_counts[request_id] <= 2, (request_id, quiet_counts[request_id])
    assert streamed["r1-0"].finish_reason == "abort" and quiet["r1-0"].text == streamed["r1-0"].text
    assert max(streamed_counts.values()) > 10
