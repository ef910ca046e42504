"""The overlapped loop (``[engine.execution] overlap``: the forward on a device thread while the previous step's
outputs are made) against the synchronous loop, its reference, on the echo model: the same final outputs for every
request whatever feature ends or shapes it (stop strings and ids, min/max tokens, n > 1, logprobs, aborts, swap and
recompute preemption, prefix caching, speculation), and nothing emitted past a stop."""

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
}


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
    assert sync.keys() == overlapped.keys() == {f"r{i}" for i in range(len(PROMPTS) * 2)}
    for request_id in sync:
        assert _summary(overlapped[request_id]) == _summary(sync[request_id]), (case, request_id)


def test_aborts_under_overlap_end_the_request_and_emit_nothing_after() -> None:
    finals, _ = _run("on", {}, {"max_tokens": 300, "ignore_eos": True}, abort_after_steps=5)
    assert finals["r1"].finish_reason == "abort" and finals["r7"].finish_reason == "abort"
    assert len(finals["r1"].token_ids) < 300
    assert all(out.finish_reason == "length" for rid, out in finals.items() if rid not in ("r1", "r7"))
