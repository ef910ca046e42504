"""Turns sampled tokens into RequestOutputs: detokenizes, applies stop conditions (EOS, stop
ids, stop strings, max_tokens, context length) and collects each step's outputs.
No torch, no scheduler internals: it only reads Request fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.clock import Clock
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestMetrics, RequestOutput
from engine.request import FINISH_REASON, Request, RequestStatus


# The scheduler finishes a request on its own only when it can never be placed (admission
# checks make that a near-impossible internal failure); say so instead of a bare "error".
_SCHEDULER_ERROR = {
    "error_code": "internal",
    "error": "the scheduler could not place this request in the KV cache",
}


@dataclass
class _Tracked:
    """Per-request output state."""

    request: Request
    detokenizer: IncrementalDetokenizer
    num_reported_tokens: int = 0  # output tokens already handed out in a RequestOutput
    num_reported_chars: int = 0  # characters of final text already handed out as deltas
    logprobs: list[dict[int, float]] = field(default_factory=list)


class OutputProcessor:
    """Owns detokenization and stop checks; collects the outputs of one step.

    Args:
        tokenizer: the model's tokenizer.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        max_model_len: a sequence stops (``length``) when it reaches this many tokens.
        clock: engine clock, for finish times.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int, clock: Clock) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.clock = clock
        self._tracked: dict[str, _Tracked] = {}
        self._outputs: list[RequestOutput] = []
        self._pending_ids: set[str] = set()  # rejected/finished ids whose output is not drained yet

    def track(self, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params.stop)
        self._tracked[request.request_id] = _Tracked(request, detokenizer)

    def has_pending(self, request_id: str) -> bool:
        return request_id in self._pending_ids

    def has_any_pending(self) -> bool:
        return bool(self._outputs)

    def reject(self, request_id: str, code: str, message: str, arrival_s: float, num_prompt_tokens: int = 0) -> None:
        """Queue an error output for a request that never entered the scheduler."""
        metrics = RequestMetrics(arrival_time_s=arrival_s, finished_time_s=self.clock.now())
        self._outputs.append(
            RequestOutput(
                request_id=request_id, new_token_ids=[], text_delta="", token_ids=[], text="", finished=True,
                finish_reason="error", prompt_token_count=num_prompt_tokens, metrics=metrics,
                error=message, error_code=code,
            )
        )
        self._pending_ids.add(request_id)

    def process_new_tokens(self, request: Request, logprobs: list[dict[int, float]] | None) -> RequestStatus | None:
        """Detokenize the request's new tokens and check stop conditions.

        Returns:
            The finished status if the request must stop now (the caller then finishes it in
            the scheduler and calls :meth:`finish`), else None; unfinished requests get their
            step output queued here.
        """
        tracked = self._tracked[request.request_id]
        if logprobs:
            tracked.logprobs.extend(logprobs)
        status = None
        for index in range(tracked.num_reported_tokens, request.num_output_tokens):
            status = self._check_token(tracked, request.output_token_ids[index], index + 1)
            if status is not None:
                # Tokens sampled past a stop (never more than one per step today) are dropped.
                del request.output_token_ids[index + 1 :]
                break
        if status is None:
            self._emit(tracked, finished=False, status=None)
        return status

    def _check_token(self, tracked: _Tracked, token_id: int, num_output_tokens: int) -> RequestStatus | None:
        request = tracked.request
        params = request.sampling_params
        may_stop = num_output_tokens > params.min_tokens or params.min_tokens == 0
        is_eos = token_id in self.eos_token_ids and not params.ignore_eos
        if may_stop and (is_eos or token_id in params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        tracked.detokenizer.append([token_id])
        if tracked.detokenizer.stop_matched is not None:
            return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= params.max_tokens or request.num_prompt_tokens + num_output_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Queue the final output of a tracked request (the scheduler has already finished it)."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return
        if request.finished_time_s is None:
            request.finished_time_s = self.clock.now()
        tracked.detokenizer.finish()
        self._emit(tracked, finished=True, status=status)
        self._pending_ids.add(request.request_id)

    def _emit(self, tracked: _Tracked, finished: bool, status: RequestStatus | None) -> None:
        request = tracked.request
        text = tracked.detokenizer.text
        text_delta = text[tracked.num_reported_chars :]
        new_token_ids = request.output_token_ids[tracked.num_reported_tokens :]
        tracked.num_reported_tokens = request.num_output_tokens
        tracked.num_reported_chars = len(text)
        self._outputs.append(
            RequestOutput(
                request_id=request.request_id,
                new_token_ids=new_token_ids,
                text_delta=text_delta,
                token_ids=list(request.output_token_ids),
                text=text,
                finished=finished,
                finish_reason=FINISH_REASON[status] if status is not None else None,
                prompt_token_count=request.num_prompt_tokens,
                metrics=RequestMetrics(
                    arrival_time_s=request.arrival_time_s,
                    first_scheduled_time_s=request.first_scheduled_time_s,
                    first_token_time_s=request.first_token_time_s,
                    finished_time_s=request.finished_time_s,
                    num_preemptions=request.num_preemptions,
                    num_output_tokens=request.num_output_tokens,
                ),
                logprobs=list(tracked.logprobs) if tracked.logprobs else None,
                **(_SCHEDULER_ERROR if status == RequestStatus.FINISHED_ERROR else {}),
            )
        )

    def drain(self) -> list[RequestOutput]:
        """This step's outputs; clears them."""
        outputs, self._outputs = self._outputs, []
        self._pending_ids.clear()
        return outputs
