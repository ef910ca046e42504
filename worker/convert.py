"""Translation between the wire schema and the engine: request -> engine call, output -> result.

Imports producer.schema and engine's torch-free modules (sampling_params, outputs); never engine.engine.
"""

from __future__ import annotations

from producer.schema import ErrorInfo, FinishReason, GenerationRequest, GenerationResult, Timings, Usage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams as EngineSamplingParams
from worker.messages import Admit, Prompt

_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_prompt(request: GenerationRequest) -> Prompt:
    """The prompt in the form ``Engine.add_request`` takes (chat messages are templated by the engine)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    if request.messages is not None:
        return [{k: str(v) for k, v in m.model_dump().items()} for m in request.messages]
    return request.prompt or ""


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
        ``ok`` for stop/length, ``error`` with the engine's code for errors, the abort status for aborts.
    """
    request = admit.request
    completion_tokens = len(output.token_ids)
    usage = Usage(prompt_tokens=output.prompt_token_count, completion_tokens=completion_tokens,
                  total_tokens=output.prompt_token_count + completion_tokens)
    result = GenerationResult(
        id=request.id, status="ok", text=output.text, token_ids=list(output.token_ids),
        finish_reason=_FINISH_REASONS.get(output.finish_reason or ""), usage=usage,
        timings=_timings(output, admit), worker=worker, metadata=request.metadata,
        logprobs=output.logprobs if request.params.logprobs is not None else None,
    )
    if output.finish_reason == "error":
        code = output.error_code or "internal"
        return result.model_copy(update={"status": "error", "error": ErrorInfo(code=code, message=output.error or code)})
    if output.finish_reason == "abort":
        status = abort_status or "cancelled"
        info = ErrorInfo(code=status, message=f"request {status} while {'running' if completion_tokens else 'waiting'}")
        return result.model_copy(update={"status": status, "error": info})
    return result


def _timings(output: RequestOutput, admit: Admit) -> Timings:
    """Engine timings shifted to start at submission: the time spent in Redis counts as queueing."""
    before_engine_s = max(0.0, admit.intake_time_s - admit.request.submitted_at)
    metrics = output.metrics

    def shifted(value: float | None) -> float | None:
        return None if value is None else before_engine_s + value

    return Timings(queued=shifted(metrics.queue_s), ttft=shifted(metrics.ttft_s), tpot=metrics.tpot_s,
                   total=shifted(metrics.total_s))
