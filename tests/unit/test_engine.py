"""A real Engine stepped with the scripted runner and a fake tokenizer (no torch, no model): the
one way a request goes from admission through stopping to its outputs."""

from __future__ import annotations

from typing import Any

from tests.unit.scheduler_helpers import ScriptedModelRunner, assert_no_leaks, make_scheduler, scripted_continuation
from tokenmill.engine.core.clock import ManualClock
from tokenmill.engine.core.limits import ModelLimits
from tokenmill.engine.engine import Engine
from tokenmill.engine.output.output_processor import OutputProcessor
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.outcomes import ErrorCode, FinishReason
from tokenmill.protocol.sampling import SamplingParams

VOCAB_SIZE = 26
EOS = 25


class FakeTokenizer:
    """Token id i is the letter chr(97 + i); EOS (25, "z") is special."""

    all_special_ids = [EOS]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True, **kwargs: Any) -> str:
        return "".join(chr(97 + t) for t in token_ids if not (skip_special_tokens and t == EOS))

    def __call__(self, texts: list[str], **kwargs: Any) -> dict[str, list[list[int]]]:
        return {"input_ids": [[(ord(c) - 97) % VOCAB_SIZE for c in text] for text in texts]}


def make_engine(**scheduler_config: Any) -> Engine:
    clock = ManualClock()
    scheduler = make_scheduler(num_gpu_blocks=32, block_size=4, clock=clock, eos_token_id=EOS, **scheduler_config)
    tokenizer = FakeTokenizer()
    limits = ModelLimits(model_name="fake", source="fake", vocab_size=VOCAB_SIZE, max_request_tokens=128,
                         is_cache_bound=True, kv_block_bytes=64)
    runner = ScriptedModelRunner(scheduler.block_manager, VOCAB_SIZE)
    return Engine(scheduler, runner, OutputProcessor(tokenizer, clock), tokenizer, limits, clock)


def run_all(engine: Engine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError("the engine did not finish")


def expected_tokens(prompt: list[int], num_tokens: int, seed: int | None = None) -> list[int]:
    """What the scripted runner samples after a prompt with ample room."""
    return scripted_continuation(prompt, num_tokens, seed, VOCAB_SIZE)


def test_outputs_stream_then_finish_once_with_the_whole_text() -> None:
    engine = make_engine()
    prompt = [1, 2, 3]
    engine.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    outputs = run_all(engine)["a"]
    tokens = expected_tokens(prompt, 6)
    assert [o.finished for o in outputs] == [False] * 5 + [True]
    assert [t for o in outputs for t in o.new_token_ids] == tokens == outputs[-1].token_ids
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text == FakeTokenizer().decode(tokens)
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats().num_generated_tokens == 6
    assert_no_leaks(engine.scheduler)


def test_a_stop_string_finishes_the_request_in_the_scheduler_and_is_cut() -> None:
    engine = make_engine()
    seed = next(i for i in range(100) if EOS not in expected_tokens([4, 5], 12, seed=i))
    text = FakeTokenizer().decode(expected_tokens([4, 5], 12, seed))
    stop = text[3:5]
    request_id = "b"
    engine.add_request(request_id, [4, 5], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop], seed=seed))
    final = run_all(engine)[request_id][-1]
    assert final.finish_reason is FinishReason.STOP and final.text == text[: text.index(stop)]
    assert len(final.token_ids) == text.index(stop) + len(stop)  # it stopped the step the string completed
    assert_no_leaks(engine.scheduler)


def test_eos_stops_and_stays_out_of_the_text() -> None:
    engine = make_engine()
    seed = next(i for i in range(200) if EOS in expected_tokens([1], 20, seed=i)[1:15])
    tokens = expected_tokens([1], 20, seed)
    request_id = "e"
    engine.add_request(request_id, [1], SamplingParams(max_tokens=20, seed=seed))
    final = run_all(engine)[request_id][-1]
    cut = tokens.index(EOS) + 1
    assert final.finish_reason is FinishReason.STOP and final.token_ids == tokens[:cut]
    assert final.text == FakeTokenizer().decode(tokens[: cut - 1])


def test_abort_and_rejections_come_out_as_outputs() -> None:
    engine = make_engine()
    engine.add_request("long", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("bad", [99], SamplingParams(max_tokens=2))
    engine.add_request("negative", [1, -1, 2], SamplingParams(max_tokens=2))
    engine.add_request("huge", [1] * 100, SamplingParams(max_tokens=100))
    first = {o.request_id: o for o in engine.step()}
    assert first["bad"].error_code is ErrorCode.VALIDATION and first["negative"].error_code is ErrorCode.VALIDATION
    assert first["huge"].error_code is ErrorCode.PROMPT_TOO_LONG and first["huge"].prompt_token_count == 100
    engine.abort("long")
    final = run_all(engine)["long"][-1]
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert_no_leaks(engine.scheduler)


def test_the_runner_gets_sampling_parameters_from_the_plan() -> None:
    """SchedulerOutput carries what the runner needs: it reads no request table."""
    engine = make_engine()
    params = SamplingParams(max_tokens=3, temperature=0.7, seed=5)
    engine.add_request("p", [3, 4, 5], params)
    chunk = engine.scheduler.schedule().chunks[0]
    assert chunk.sampling_params is params and chunk.num_output_tokens == 0


def test_max_tokens_none_generates_the_rest_of_the_context() -> None:
    """OpenAI's and vLLM's chat default: no max_tokens = as many as the model's context leaves."""
    engine = make_engine()
    engine.add_request("rest", [1, 2, 3], SamplingParams(max_tokens=None, ignore_eos=True))
    engine.add_request("full", [1] * 128, SamplingParams(max_tokens=None))
    finals = {request_id: outputs[-1] for request_id, outputs in run_all(engine).items()}
    assert finals["rest"].finish_reason is FinishReason.LENGTH and len(finals["rest"].token_ids) == 128 - 3
    assert finals["full"].error_code is ErrorCode.PROMPT_TOO_LONG and "leaves no room" in (finals["full"].error or "")
    assert_no_leaks(engine.scheduler)
