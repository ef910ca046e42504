"""Turns requests' new tokens into RequestOutputs: detokenizes, finds stop strings, and builds
each step's outputs. Keeps no table of requests: per-request state lives on the Request (its own in
``Request.output_state``, engine/output/output_state.py). No torch, no scheduler internals."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.engine.core.clock import Clock
from tokenmill.engine.core.request import FINISH_REASON, ParallelGroup, Request, RequestStatus
from tokenmill.engine.output.detokenizer import make_detokenizer
from tokenmill.engine.output.logprobs import TokenBytes, build_token_logprobs
from tokenmill.engine.output.output_state import OutputState, TextDecoder
from tokenmill.engine.output.request_output import RequestMetrics, RequestOutput, SampleOutput, SoFar
from tokenmill.protocol.outcomes import ErrorCode, FinishReason, TokenLogprob


class OutputProcessor:
    """Owns detokenization and stop strings, and the one way a request becomes an output.

    Args:
        tokenizer: the model's tokenizer (only ``decode`` and ``all_special_ids`` are used).
        clock: engine clock, for the finish time of rejected requests.
    """

    def __init__(self, tokenizer: Any, clock: Clock) -> None:
        self.tokenizer = tokenizer
        self.clock = clock
        self._rejected: list[RequestOutput] = []  # refused at admission, handed out by the next step
        self._token_bytes: TokenBytes | None = None  # made with the first request that asks for logprobs
        self._special_ids: frozenset[int] | None = None  # the tokenizer's, made with the first decoder

    def reject(self, request_id: str, code: ErrorCode, message: str, arrival_s: float,
               num_prompt_tokens: int = 0) -> None:
        """Queue an error output for a request that never entered the scheduler."""
        metrics = RequestMetrics(arrival_time_s=arrival_s, finished_time_s=self.clock.now())
        self._rejected.append(RequestOutput(
            request_id=request_id, new_token_ids=[], text_delta="", token_ids=[], text="", finished=True,
            finish_reason=FinishReason.ERROR, prompt_token_count=num_prompt_tokens, metrics=metrics,
            error=message, error_code=code,
        ))

    def has_rejected(self, request_id: str | None = None) -> bool:
        """Whether a rejection (of ``request_id``, or any) waits to be handed out."""
        return any(request_id in (None, o.request_id) for o in self._rejected)

    def detokenize(self, requests: list[Request]) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """Append each request's new tokens to its text.

        A token that stopped the request (EOS, stop id) stays in the ids but not in the text.

        Returns:
            The requests whose stop string matched with these tokens, and those whose tokens could
            not be decoded (with why): the caller finishes both.
        """
        matched: list[Request] = []
        failed: list[tuple[Request, Exception]] = []
        for request in requests:
            if not request.streams and not request.is_finished and not request.sampling_params.stop:
                continue  # NOTE: nobody reads its text before it finishes: decoded then, in one call
            state = self._state(request)
            detokenizer = state.detokenizer
            # NOTE: its own cursor, not num_reported_tokens: samples of an n > 1 request report
            # nothing until the group ends, yet their text must still be decoded token by token once.
            new_token_ids = request.output_token_ids[state.num_detokenized_tokens:]
            state.num_detokenized_tokens = request.num_output_tokens
            if request.stop_token_id is not None:
                new_token_ids = new_token_ids[:-1]
            if detokenizer.stop_matched is None:
                try:
                    num_past_stop = self._append(detokenizer, new_token_ids, bool(request.sampling_params.stop))
                except Exception as exc:  # noqa: BLE001 - one request's tokens; the others go on
                    failed.append((request, exc))
                    continue
                if detokenizer.stop_matched is not None:
                    _drop_tokens_past_stop(request, state, num_past_stop)
                    matched.append(request)
        return matched, failed

    @staticmethod
    def _append(detokenizer: TextDecoder, token_ids: list[int], has_stop_strings: bool) -> int:
        """Append a step's tokens; with several (a verified draft, or a request decoded only when it finished),
        one at a time where stop strings are looked for, so that one ends the text at the token that completed
        it. Returns the tokens left past it."""
        if len(token_ids) <= 1 or not has_stop_strings:
            detokenizer.append(token_ids)
            return 0
        for index, token_id in enumerate(token_ids):
            detokenizer.append([token_id])
            if detokenizer.stop_matched is not None:
                return len(token_ids) - index - 1
        return 0

    def make_outputs(self, progressed: list[Request], finished: list[Request]) -> list[RequestOutput]:
        """This step's outputs: rejections, progress of unfinished requests, then final outputs.

        Samples of an n > 1 request stream nothing: one output carries them all once the last
        of them finished.
        """
        outputs, self._rejected = self._rejected, []
        for request in progressed:
            if request.is_finished or request.group is not None:
                continue
            if not request.streams:  # NOTE: only its first output (that it started) before its final one
                state = request.output_state
                if isinstance(state, OutputState) and state.num_reported_tokens:
                    continue
            outputs.append(self._output(request))
        for request in finished:
            self._finish_text(request)
            if request.group is None:
                outputs.append(self._output(request))
            elif request.group.is_finished and request is request.group.finished[-1]:
                outputs.append(self._group_output(request.group))
        return outputs

    def _finish_text(self, request: Request) -> None:
        """Release the text a finished request still holds back; a failure fails the request alone."""
        if request.status is RequestStatus.FINISHED_ERROR:  # NOTE: its text stays as far as it got
            return
        try:
            state = self._state(request)
            detokenizer = state.detokenizer
            if state.num_detokenized_tokens < request.num_output_tokens and detokenizer.stop_matched is None:
                # NOTE: a request nobody streams, finished without a step of its own (aborted): its text now
                new_token_ids = request.output_token_ids[state.num_detokenized_tokens:]
                state.num_detokenized_tokens = request.num_output_tokens
                detokenizer.append(new_token_ids[:-1] if request.stop_token_id is not None else new_token_ids)
            detokenizer.finish()
        except Exception as exc:  # noqa: BLE001 - this request's tokens; the others go on
            request.fail_finished(ErrorCode.INTERNAL, f"its text could not be decoded: {type(exc).__name__}: {exc}")

    def _group_output(self, group: ParallelGroup) -> RequestOutput:
        """The final output of an n > 1 request: sample 0's fields, every sample, combined timings."""
        by_index = sorted(group.finished, key=lambda r: r.sample_index)
        outputs = [self._output(r) for r in by_index]
        first = outputs[0]
        first_tokens = [o.metrics.first_token_time_s for o in outputs if o.metrics.first_token_time_s is not None]
        metrics = dataclasses.replace(
            first.metrics, first_token_time_s=min(first_tokens, default=None),
            finished_time_s=max(o.metrics.finished_time_s or 0.0 for o in outputs),
            num_output_tokens=sum(o.metrics.num_output_tokens for o in outputs),
            num_preemptions=sum(o.metrics.num_preemptions for o in outputs),
        )
        samples = [SampleOutput(r.sample_index, list(o.token_ids), o.text, o.finish_reason,
                                None if o.logprobs is None else list(o.logprobs), o.token_logprobs)
                   for r, o in zip(by_index, outputs)]
        return dataclasses.replace(first, request_id=group.request_id, new_token_ids=list(first.token_ids),
                                   text_delta=first.text, metrics=metrics, samples=samples)

    def _state(self, request: Request) -> OutputState:
        """The request's output state with its text decoder, made on first use (forked samples start without one)."""
        state = request.output_state
        if not isinstance(state, OutputState):
            if self._special_ids is None:  # NOTE: a tokenizer makes its list anew on each ask: asked once
                self._special_ids = frozenset(self.tokenizer.all_special_ids)
            state = request.output_state = OutputState(make_detokenizer(
                self.tokenizer, request.prompt_token_ids, request.sampling_params.stop, special_ids=self._special_ids))
        return state

    def _output(self, request: Request) -> RequestOutput:
        """The one way a request becomes an output: what is new since the last one, and all so far."""
        state = self._state(request)
        text = state.detokenizer.text
        text_delta = text[state.num_reported_chars:]
        new_token_ids = request.output_token_ids[state.num_reported_tokens:]
        state.num_reported_tokens = request.num_output_tokens
        state.num_reported_chars = len(text)
        # NOTE: a final output's lists are copies; a progress output's are read in place (SoFar): a copy per step
        # cost O(output) per streamed request
        is_final = request.is_finished
        token_ids = request.output_token_ids
        logprobs = request.logprobs
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            text_delta=text_delta,
            token_ids=list(token_ids) if is_final else SoFar(token_ids, len(token_ids)),
            text=text,
            finished=is_final,
            finish_reason=FINISH_REASON[request.status] if is_final else None,
            prompt_token_count=request.num_prompt_tokens,
            metrics=RequestMetrics(
                arrival_time_s=request.arrival_time_s,
                first_scheduled_time_s=request.first_scheduled_time_s,
                first_token_time_s=request.first_token_time_s,
                finished_time_s=request.finished_time_s,
                num_preemptions=request.num_preemptions,
                num_output_tokens=request.num_output_tokens,
            ),
            logprobs=None if not logprobs else list(logprobs) if is_final else SoFar(logprobs, len(logprobs)),
            token_logprobs=self._token_logprobs(request) if is_final else None,
            error=request.error_message,
            error_code=request.error_code,
        )

    def _token_logprobs(self, request: Request) -> list[TokenLogprob] | None:
        """OpenAI-shaped logprobs of a finished request that asked for them (built once, at the end)."""
        num_top = request.sampling_params.logprobs
        if num_top is None or not request.is_finished:
            return None
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return build_token_logprobs(request.output_token_ids, request.logprobs, num_top, self._token_bytes)


def _drop_tokens_past_stop(request: Request, state: OutputState, num_tokens: int) -> None:
    """Nothing past a stop string is emitted: its last tokens (and their logprobs) go, as does a stop
    token id that followed them."""
    if request.stop_token_id is not None:  # NOTE: the stop string came first: the stop id is past it
        num_tokens += 1
        request.stop_token_id = None
    if num_tokens == 0:
        return
    del request.output_token_ids[-num_tokens:]
    if request.logprobs:
        del request.logprobs[len(request.output_token_ids):]
    state.num_detokenized_tokens = request.num_output_tokens
