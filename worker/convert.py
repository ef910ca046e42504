"""Translation between the wire schema and the engine: request -> engine call, output -> result.

Imports producer.schema and engine's torch-free modules; never torch. The engine's finish
reasons and error codes meet the wire's here, in one table each.
"""

from __future__ import annotations

import dataclasses

from engine.logprobs import TokenLogprob as EngineTokenLogprob
from engine.outputs import RequestOutput
from engine.prompts import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from engine.request import FinishReason as EngineFinishReason
from engine.request import RequestErrorCode
from engine.sampling_params import SamplingParams as EngineSamplingParams
from producer.schema import (
    ErrorCode,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Sample,
    Timings,
    TokenLogprob,
    Usage,
)
from worker.messages import Admit

FINISH_REASONS: dict[EngineFinishReason, FinishReason] = {
    EngineFinishReason.STOP: "stop", EngineFinishReason.LENGTH: "length", EngineFinishReason.ABORT: "abort",
}
ERROR_CODES: dict[RequestErrorCode, ErrorCode] = {
    RequestErrorCode.VALIDATION: ErrorCode.VALIDATION,
    RequestErrorCode.PROMPT_TOO_LONG: ErrorCode.PROMPT_TOO_LONG,
    RequestErrorCode.CANNOT_PLACE: ErrorCode.INTERNAL,
}


def engine_prompt(request: GenerationRequest) -> Prompt:
    """The request's prompt as the engine's typed prompt (chat messages are templated by the engine)."""
    if request.prompt_token_ids is not None:
        return TokensPrompt(list(request.prompt_token_ids))
    if request.messages is not None:
        return ChatPrompt([m.model_dump() for m in request.messages])
    return TextPrompt(request.prompt or "")


def engine_params(request: GenerationRequest) -> EngineSamplingParams:
    """The engine's sampling parameters for ``request`` (the two models share their fields).

    Raises:
        pydantic.ValidationError: a value the engine rejects.
    """
    return EngineSamplingParams(**request.params.model_dump())


def build_result(output: RequestOutput, admit: Admit, worker: str, abort_status: str | None) -> GenerationResult:
    """The result of a finished engine output.

    Args:
        output: the engine's final output for the request.
        admit: what the worker admitted (request, intake time).
        worker: this worker's name, recorded in the result.
        abort_status: ``"cancelled"`` / ``"expired"`` when the worker aborted the request, else None.

    Returns:
        ``ok`` for stop/length, ``error`` with the wire code for errors, the abort status for aborts.
    """
    request = admit.request
    # NOTE: as OpenAI counts it: the completion tokens of every sample (n > 1), not only sample 0's
    completion_tokens = (sum(len(s.token_ids) for s in output.samples) if output.samples is not None
                         else len(output.token_ids))
    usage = Usage(prompt_tokens=output.prompt_token_count, completion_tokens=completion_tokens,
                  total_tokens=output.prompt_token_count + completion_tokens)
    reason = output.finish_reason
    result = GenerationResult(
        id=request.id, status="ok", text=output.text, token_ids=list(output.token_ids),
        finish_reason=FINISH_REASONS.get(reason) if reason is not None else None, usage=usage,
        timings=_timings(output, admit), worker=worker, metadata=request.metadata,
        logprobs=output.logprobs if request.params.logprobs is not None else None,
        token_logprobs=wire_token_logprobs(output.token_logprobs) if request.params.logprobs is not None else None,
        samples=_samples(output, with_logprobs=request.params.logprobs is not None),
    )
    if reason is EngineFinishReason.ERROR:
        code = ERROR_CODES.get(output.error_code, ErrorCode.INTERNAL) if output.error_code else ErrorCode.INTERNAL
        info = ErrorInfo(code=code.value, message=output.error or code.value)
        return result.model_copy(update={"status": "error", "error": info})
    if reason is EngineFinishReason.ABORT:
        status = abort_status or "cancelled"
        info = ErrorInfo(code=status, message=f"request {status} while {'running' if completion_tokens else 'waiting'}")
        return result.model_copy(update={"status": status, "error": info})
    return result


def _samples(output: RequestOutput, with_logprobs: bool) -> list[Sample] | None:
    """Every sample of an n > 1 request on the wire (None for one sample)."""
    if output.samples is None:
        return None
    return [Sample(index=s.index, text=s.text, token_ids=list(s.token_ids),
                   finish_reason=FINISH_REASONS.get(s.finish_reason) if s.finish_reason is not None else None,
                   logprobs=s.logprobs if with_logprobs else None,
                   token_logprobs=wire_token_logprobs(s.token_logprobs) if with_logprobs else None)
            for s in output.samples]


def wire_token_logprobs(token_logprobs: list[EngineTokenLogprob] | None) -> list[TokenLogprob] | None:
    """The engine's OpenAI-shaped logprobs of one sequence (a request, or one sample) on the wire."""
    if token_logprobs is None:
        return None
    return [TokenLogprob.model_validate(dataclasses.asdict(item)) for item in token_logprobs]


def _timings(output: RequestOutput, admit: Admit) -> Timings:
    """Engine timings shifted to start at submission: the time spent in Redis counts as queueing."""
    before_engine_s = max(0.0, admit.intake_time_s - admit.request.submitted_at)
    metrics = output.metrics

    def shifted(value: float | None) -> float | None:
        return None if value is None else before_engine_s + value

    return Timings(queued=shifted(metrics.queue_s), ttft=shifted(metrics.ttft_s), tpot=metrics.tpot_s,
                   total=shifted(metrics.total_s))
