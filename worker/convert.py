"""Translation between the wire schema and the engine: request -> engine call, output -> result.

Imports protocol.schema and engine's torch-free modules; never torch. Both speak the vocabulary
of protocol/ (sampling parameters, finish reasons, error codes, logprobs), so what is left to
translate is the envelope: prompts in, results out.
"""

from __future__ import annotations

from tokenmill.engine.output.prompts import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.outcomes import AbortReason, ErrorCode, FinishReason
from tokenmill.protocol.schema import (
    ErrorInfo,
    GenerationRequest,
    GenerationResult,
    Sample,
    Timings,
    Usage,
    WireFinishReason,
)
from tokenmill.worker.messages import Admit


def engine_prompt(request: GenerationRequest) -> Prompt:
    """The request's prompt as the engine's typed prompt (chat messages and their tools are templated by
    the engine)."""
    if request.prompt_token_ids is not None:
        return TokensPrompt(list(request.prompt_token_ids))
    if request.messages is not None:
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        return ChatPrompt([m.model_dump() for m in request.messages], tools=tools)
    return TextPrompt(request.prompt or "")


def build_result(output: RequestOutput, admit: Admit, worker: str,
                 abort_reason: AbortReason | str | None) -> GenerationResult:
    """The result of a finished engine output.

    Args:
        output: the engine's final output for the request.
        admit: what the worker admitted (request, intake time).
        worker: this worker's name, recorded in the result.
        abort_reason: why the worker aborted the request (an :class:`AbortReason` or its value: cancelled /
            expired), else None.

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
        finish_reason=_wire_finish_reason(reason), usage=usage,
        timings=_timings(output, admit), worker=worker, metadata=request.metadata,
        logprobs=output.logprobs if request.params.logprobs is not None else None,
        token_logprobs=output.token_logprobs if request.params.logprobs is not None else None,
        samples=_samples(output, with_logprobs=request.params.logprobs is not None),
    )
    if reason is FinishReason.ERROR:
        code = output.error_code or ErrorCode.INTERNAL
        info = ErrorInfo(code=code.value, message=output.error or code.value)
        return result.model_copy(update={"status": "error", "error": info})
    if reason is FinishReason.ABORT:
        status = AbortReason(abort_reason or AbortReason.CANCELLED).value
        info = ErrorInfo(code=status, message=f"request {status} while {'running' if completion_tokens else 'waiting'}")
        return result.model_copy(update={"status": status, "error": info})
    return result


def _samples(output: RequestOutput, with_logprobs: bool) -> list[Sample] | None:
    """Every sample of an n > 1 request on the wire (None for one sample)."""
    if output.samples is None:
        return None
    return [Sample(index=s.index, text=s.text, token_ids=list(s.token_ids),
                   finish_reason=_wire_finish_reason(s.finish_reason),
                   logprobs=s.logprobs if with_logprobs else None,
                   token_logprobs=s.token_logprobs if with_logprobs else None)
            for s in output.samples]


def _wire_finish_reason(reason: FinishReason | None) -> WireFinishReason | None:
    """The engine's finish reason as the wire carries it: an error has none (its status says it)."""
    if reason is None or reason is FinishReason.ERROR:
        return None
    return reason


def _timings(output: RequestOutput, admit: Admit) -> Timings:
    """Engine timings shifted to start at submission: the time spent in Redis counts as queueing."""
    before_engine_s = max(0.0, admit.intake_time_s - admit.request.submitted_at)
    metrics = output.metrics

    def shifted(value: float | None) -> float | None:
        return None if value is None else before_engine_s + value

    return Timings(queued=shifted(metrics.queue_s), ttft=shifted(metrics.ttft_s), tpot=metrics.tpot_s,
                   total=shifted(metrics.total_s))
