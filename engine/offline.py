"""Offline generation: submit many prompts, step the engine to completion with a progress bar,
return final outputs in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tqdm.auto import tqdm

from tokenmill.engine.core.clock import Clock
from tokenmill.engine.output.prompts import Prompt, PromptError, PromptLike, as_prompt
from tokenmill.engine.output.request_output import RequestMetrics, RequestOutput, SampleOutput
from tokenmill.protocol.outcomes import FinishReason, TokenLogprob
from tokenmill.protocol.sampling import SamplingParams

_batch_numbers = itertools.count()  # keeps request ids of successive generate() calls distinct


class OfflineEngine(Protocol):
    """What offline generation needs of an engine: :class:`engine.engine.Engine`, which hands itself in."""

    clock: Clock

    @property
    def num_generated_tokens(self) -> int: ...

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, *, streams: bool = True) -> None: ...

    def step(self) -> list[RequestOutput]: ...


@dataclass
class GenerationOutput:
    """The final state of one offline request."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_token_count: int
    metrics: RequestMetrics
    error: str | None = None
    token_logprobs: list[TokenLogprob] | None = None  # when params.logprobs was set
    samples: list[SampleOutput] | None = None  # n > 1: every sample (the fields above are sample 0's)


def run_offline(
    engine: OfflineEngine,
    prompts: Sequence[PromptLike],
    params: SamplingParams | Sequence[SamplingParams] | None,
    progress: bool = True,
    priorities: Sequence[int] | None = None,
) -> list[GenerationOutput]:
    """Run ``prompts`` to completion on ``engine``.

    Args:
        engine: an idle or busy engine (other requests keep running alongside).
        prompts: texts, token-id lists, chat-message lists or typed prompts.
        params: one SamplingParams for all, one per prompt, or None for defaults.
        progress: show a tqdm bar with requests done and the engine's output tokens/s.
        priorities: optional per-prompt priority (lower = more urgent).

    Returns:
        One GenerationOutput per prompt, in input order.

    Raises:
        ValueError: ``params`` or ``priorities`` has the wrong length.
    """
    per_prompt = _per_prompt_params(params, len(prompts))
    if priorities is not None and len(priorities) != len(prompts):
        raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
    batch_number = next(_batch_numbers)
    request_ids = [f"offline-{batch_number}-{i}" for i in range(len(prompts))]
    results: dict[str, GenerationOutput] = {}
    for i, (request_id, prompt) in enumerate(zip(request_ids, prompts)):
        try:
            prompt_token_ids = engine.tokenize(as_prompt(prompt))
        except PromptError as exc:
            metrics = RequestMetrics(arrival_time_s=engine.clock.now(), finished_time_s=engine.clock.now())
            results[request_id] = GenerationOutput(request_id, [], "", FinishReason.ERROR, 0, metrics, str(exc))
            continue
        # NOTE: only final outputs are read (streams=False): a request's text is decoded once, when it finishes, and
        # no output is made for it per step (the host time a step spends per streamed request, ops/bench/overhead.py)
        engine.add_request(request_id, prompt_token_ids, per_prompt[i], priority=priorities[i] if priorities else 0,
                           streams=False)
    wanted = set(request_ids)
    bar = tqdm(total=len(prompts), initial=len(results), desc="generating", unit="req", disable=not progress)
    generated_before = engine.num_generated_tokens  # the bar's tokens/s: the engine's, whoever else runs on it
    while len(results) < len(prompts):
        for output in engine.step():
            if output.request_id not in wanted:
                continue
            if output.finished:
                results[output.request_id] = GenerationOutput(
                    request_id=output.request_id, token_ids=list(output.token_ids), text=output.text,
                    finish_reason=output.finish_reason, prompt_token_count=output.prompt_token_count,
                    metrics=output.metrics, error=output.error, token_logprobs=output.token_logprobs,
                    samples=output.samples,
                )
                bar.update(1)
        elapsed = bar.format_dict.get("elapsed") or 0.0
        num_tokens = engine.num_generated_tokens - generated_before
        bar.set_postfix(tok_s=f"{num_tokens / elapsed:.1f}" if elapsed else "-", refresh=False)
    bar.close()
    return [results[request_id] for request_id in request_ids]


def _per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
    return list(params)
