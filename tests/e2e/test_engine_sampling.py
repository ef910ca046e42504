"""Engine-level sampling behaviour on a tiny model: seeded sampling independent of the batch,
stop strings, stop ids, min_tokens, EOS, abort and errors as outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_helpers import build_engine
from tokenmill.engine import Engine, PromptError, TextPrompt
from tokenmill.protocol.sampling import SamplingParams

pytestmark = pytest.mark.e2e

PROMPTS = ["The quick brown fox", "Paged attention stores", "héllo wörld", "Redis streams deliver each entry"]


@pytest.fixture(scope="module")
def engine(tiny_model_dirs: dict[str, Path]) -> Engine:
    return build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float64", kv_cache_memory="4MiB",
                        block_size=4, max_prefill_chunk=5, max_num_batched_tokens=64)


def test_seeded_sampling_is_independent_of_the_batch(engine: Engine, tiny_model_dirs: dict[str, Path]) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], seeded, progress=False)[0].token_ids
    others = [SamplingParams(max_tokens=12, temperature=0.8, seed=s) for s in (1, 2)] + [SamplingParams()]
    batch = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                            [others[0], seeded, others[1], others[2]], progress=False)
    assert batch[1].token_ids == alone
    # Under recompute preemption (tiny KV) the seeded request still draws the same tokens.
    tight = build_engine(str(tiny_model_dirs["llama"]), device="cpu", dtype="float64",
                         kv_cache_memory=48 * 1024, block_size=4, preemption_mode="recompute",
                         budget_kv=False)  # 48 tokens
    crowded = tight.generate([PROMPTS[1], PROMPTS[0], PROMPTS[3]], [others[0], seeded, others[1]], progress=False)
    assert crowded[1].token_ids == alone
    assert tight.stats().counters.num_preemptions > 0
    different_seed = engine.generate([PROMPTS[0]], seeded.model_copy(update={"seed": 99}), progress=False)[0]
    assert different_seed.token_ids != alone


def test_stop_string_is_cut_and_stop_ids_stop(engine: Engine) -> None:
    free = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True), progress=False)[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    stopped = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]),
                              progress=False)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    stop_id = free.token_ids[5]
    by_id = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
                            progress=False)[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]


def test_min_tokens_and_max_tokens(engine: Engine) -> None:
    eos = next(iter(engine.scheduler.eos_token_ids))
    out = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=9, min_tokens=9, stop_token_ids=[eos]),
                          progress=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 9 and eos not in out.token_ids


def test_bad_requests_finish_with_errors_and_abort(engine: Engine) -> None:
    prompt_ids = engine.tokenize(TextPrompt(PROMPTS[0]))
    with pytest.raises(PromptError, match="empty"):
        engine.tokenize(TextPrompt(""))
    engine.add_request("too-long", list(range(5, 300)) * 20, SamplingParams(max_tokens=4))
    engine.add_request("empty", [], SamplingParams(max_tokens=4))
    engine.add_request("bad-ids", [10**9], SamplingParams(max_tokens=4))
    engine.add_request("aborted", prompt_ids, SamplingParams(max_tokens=50, ignore_eos=True))
    with pytest.raises(ValueError):
        engine.add_request("aborted", prompt_ids)
    finished = {}
    for _ in range(3):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    engine.abort("aborted")
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["too-long"].error_code == "prompt_too_long"
    assert finished["empty"].error_code == "validation"
    assert finished["bad-ids"].error_code == "validation"
    assert finished["aborted"].finish_reason == "abort" and 0 < len(finished["aborted"].token_ids) < 50
    assert engine.stats().num_used_gpu_blocks == 0


def test_parallel_samples_match_separate_seeded_requests(engine: Engine) -> None:
    """n = 4 shares the prompt's blocks, yet sample i draws what a request with seed + i draws."""
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=40, ignore_eos=True)
    [together] = engine.generate([PROMPTS[3]], params.model_copy(update={"n": 4}), progress=False)
    separate = engine.generate([PROMPTS[3]] * 4, [params.model_copy(update={"seed": 40 + i}) for i in range(4)],
                               progress=False)
    assert together.samples is not None
    assert [s.token_ids for s in together.samples] == [o.token_ids for o in separate]
    assert [s.index for s in together.samples] == [0, 1, 2, 3]
    assert together.token_ids == together.samples[0].token_ids and together.text == together.samples[0].text
    assert len({tuple(s.token_ids) for s in together.samples}) > 1
    # What a user reads: each sample's text is its own tokens' text, never its siblings' glued on.
    assert [s.text for s in together.samples] == [o.text for o in separate]
    for sample in together.samples:
        assert sample.text == engine.tokenizer.decode(sample.token_ids, skip_special_tokens=True,
                                                      clean_up_tokenization_spaces=False)
    assert engine.stats().num_used_gpu_blocks == 0
