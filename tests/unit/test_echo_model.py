"""The echo model is the real engine over an echo runner: stop strings, stop ids,
min_tokens, max_tokens, n, logprobs, priorities and preemption behave as they do on a model, tools
and response formats are taken without changing the echo, ``crash_on`` exits the process, and
building it loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.engine import Engine, EngineConfig
from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.core.step_io import ScheduledChunk
from tokenmill.engine.echo import EOS_TOKEN_ID, EchoOptions, echo_token, echo_tokens
from tokenmill.engine.output.prompts import ChatPrompt
from tokenmill.protocol.outcomes import FinishReason
from tokenmill.protocol.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _echo(**sections: object) -> Engine:
    return Engine.from_config(EngineConfig.model_validate({"model": {"name": "echo"}, **sections}))


def _one(engine: Engine, prompt: str, **params: object) -> tuple[FinishReason | None, str, list[int]]:
    [out] = engine.generate([prompt], SamplingParams(**params), progress=False)  # type: ignore[arg-type]
    return out.finish_reason, out.text, out.token_ids


def test_a_prompt_is_echoed_once_then_stops_on_eos() -> None:
    assert _one(_echo(), "abc") == (FinishReason.STOP, "abc", [97, 98, 99, EOS_TOKEN_ID])
    assert _one(_echo(), "abc", max_tokens=2) == (FinishReason.LENGTH, "ab", [97, 98])
    assert _one(_echo(), "ab", ignore_eos=True, max_tokens=5) == (FinishReason.LENGTH, "ababa", [97, 98] * 2 + [97])


def test_stop_strings_stop_ids_and_min_tokens_are_the_engines_rules() -> None:
    engine = _echo()
    assert _one(engine, "say stop here", stop=["stop"])[:2] == (FinishReason.STOP, "say ")
    reason, text, ids = _one(engine, "abcd", stop_token_ids=[ord("c")])
    assert (reason, text, ids) == (FinishReason.STOP, "ab", [97, 98, 99])
    reason, text, ids = _one(engine, "xy", min_tokens=5, max_tokens=10)
    assert (reason, text) == (FinishReason.STOP, "xyxyx") and ids[-1] == EOS_TOKEN_ID and len(ids) == 6


def test_parallel_samples_and_logprobs() -> None:
    [out] = _echo().generate(["hé"], SamplingParams(n=3, max_tokens=3, ignore_eos=True, logprobs=1), progress=False)
    assert out.samples is not None and [s.text for s in out.samples] == ["hé"] * 3
    assert out.token_logprobs is not None and out.token_logprobs[0].bytes == [104]
    assert all(t.logprob == 0.0 for t in out.token_logprobs)


def test_a_small_kv_budget_preempts_and_every_request_still_finishes_whole() -> None:
    engine = _echo(cache={"kv_cache_memory": 256, "block_size": 4, "swap_space": 0},
                   scheduler={"max_num_seqs": 8}, length={"budget_kv": False})
    prompts = [f"request number {i} " * 2 for i in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=40), progress=False)
    assert [o.text for o in outs] == [p[:40] for p in prompts]
    assert engine.stats().counters.num_preemptions > 0


def test_tools_and_a_response_format_leave_the_echo_as_the_messages_say() -> None:
    engine = _echo()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompt = ChatPrompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], tools)
    assert engine.tokenize(prompt) == list(b"be brief\nhi"), "no tools preamble"
    call = '{"name": "f", "arguments": {}}'
    assert _one(engine, call, response_format={"type": "json_object"})[:2] == (FinishReason.STOP, call)


def test_options_and_no_torch() -> None:
    assert EchoOptions.parse("echo:step_delay_s=0.5") == EchoOptions(step_delay_s=0.5)
    assert EchoOptions.parse("echo:crash_on=BOOM,step_delay_s=0.01") == EchoOptions(0.01, "BOOM")
    for bad in ("echo:speed=3", "echo:tokens_per_step=1", "echo:crash_on="):
        with pytest.raises(ValueError, match="unknown echo option"):
            EchoOptions.parse(bad)
    code = ("import sys; from tokenmill.engine import Engine, EngineConfig; "
            "e = Engine.from_config(EngineConfig(model='echo')); "
            "e.generate(['hi'], progress=False); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_crash_on_exits_the_process_in_a_step_that_runs_the_prompt() -> None:
    code = ("from tokenmill.engine import Engine, EngineConfig; import sys; "
            "e = Engine.from_config(EngineConfig(model='echo:crash_on=BOOM')); "
            "print(e.generate(['calm'], progress=False)[0].text, flush=True); "
            "e.generate([sys.argv[1]], progress=False)")
    calm = subprocess.run([sys.executable, "-c", code, "all calm"], cwd=ROOT, capture_output=True, text=True)
    boom = subprocess.run([sys.executable, "-c", code, "a BOOM here"], cwd=ROOT, capture_output=True, text=True)
    assert (calm.returncode, calm.stdout) == (0, "calm\n")
    assert (boom.returncode, boom.stdout) == (1, "calm\n")


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_sliced_rows_are_the_per_position_tokens(ignore_eos: bool) -> None:
    """echo_tokens (slices of the prompt, the fast path) gives what echo_token (one position at a time, the rule)
    does, before, across and past the prompt's end, and round it again with ignore_eos."""
    prompt = list(range(97, 110))
    params = SamplingParams(ignore_eos=ignore_eos, min_tokens=3)
    for start in range(3 * len(prompt)):
        for num_rows in range(1, len(prompt) + 3):
            chunk = ScheduledChunk(request_id="r", token_ids=[0], start_position=0, block_ids=[], needs_sample=True,
                                   sampling_params=params, num_output_tokens=start,
                                   sampling_state=SamplingState(prompt, []))
            expected = [echo_token(chunk, position) for position in range(start, start + num_rows)]
            assert echo_tokens(chunk, num_rows) == expected, (start, num_rows)
