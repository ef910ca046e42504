"""EchoEngine: the engine interface without torch or a model, for tests and queue benchmarks.

Token ids are the UTF-8 bytes of the prompt; the output echoes them. Served as the model
``echo``, or ``echo:tokens_per_step=1,step_delay_s=0.004`` to pace it like a real engine.
``echo:crash_on=TEXT`` is a test hook: the process exits at once (``os._exit(1)``, a crash no
engine can contain) in a step that runs a prompt containing TEXT; a model name without it never crashes.
Imports engine's torch-free modules only (config, outputs, sampling_params); never engine.engine.
"""

from __future__ import annotations

import codecs
import os
import time
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.outputs import RequestMetrics, RequestOutput, SampleOutput
from engine.prompts import ChatPrompt, Prompt, TextPrompt
from protocol.outcomes import ErrorCode, FinishReason, TokenLogprob, TopLogprob
from protocol.sampling import SamplingParams
from engine.stats import EngineStats

ECHO_MODEL = "echo"
DEFAULT_MAX_MODEL_LEN = 2048


def is_echo_model(name: str) -> bool:
    """Whether a model name selects the echo engine (``echo`` or ``echo:options``)."""
    return name == ECHO_MODEL or name.startswith(ECHO_MODEL + ":")


@dataclass(frozen=True)
class EchoOptions:
    """The pace of the echo engine, from ``echo:tokens_per_step=N,step_delay_s=S`` (and the test hook
    ``crash_on=TEXT``)."""

    tokens_per_step: int = 0  # tokens each request gets per step; 0 = the whole output in one step
    step_delay_s: float = 0.0  # sleep per step, standing in for a forward pass
    crash_on: str = ""  # test hook: a step running a prompt with this text exits the process; "" = never

    @classmethod
    def parse(cls, name: str) -> EchoOptions:
        """Options of an echo model name.

        Raises:
            ValueError: not an echo name, or an unknown or malformed option.
        """
        if not is_echo_model(name):
            raise ValueError(f"{name!r} is not an echo model")
        values: dict[str, float] = {}
        crash_on = ""
        for item in filter(None, name.removeprefix(ECHO_MODEL).removeprefix(":").split(",")):
            key, _, text = item.partition("=")
            if key == "crash_on" and text:
                crash_on = text
            elif key in ("tokens_per_step", "step_delay_s"):
                values[key] = float(text)
            else:
                raise ValueError(f"unknown echo option {key!r} (use tokens_per_step, step_delay_s, crash_on)")
        options = cls(int(values.get("tokens_per_step", 0)), values.get("step_delay_s", 0.0), crash_on)
        if options.tokens_per_step < 0 or options.step_delay_s < 0:
            raise ValueError("echo options must be >= 0")
        return options


@dataclass
class _EchoRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    seq: int  # arrival order, breaks priority ties
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))
    text: str = ""
    is_aborted: bool = False


class EchoEngine:
    """Echoes each prompt's bytes back, ``max_tokens`` at most, at a chosen pace.

    A prompt shorter than ``max_tokens`` stops after one echo (``"stop"``) unless
    ``ignore_eos``, which repeats it up to ``max_tokens`` (``"length"``).

    Args:
        config: engine settings; uses the model's name (with the echo options), ``max_model_len``
            and ``max_num_seqs``.
    """

    def __init__(self, config: EngineConfig) -> None:
        options = EchoOptions.parse(config.model.name)
        self.model_name = ECHO_MODEL
        self._max_num_seqs = config.scheduler.max_num_seqs
        self._max_model_len = config.model.max_model_len or DEFAULT_MAX_MODEL_LEN
        self._tokens_per_step = options.tokens_per_step
        self._step_delay_s = options.step_delay_s
        self._crash_on = options.crash_on.encode()
        self._waiting: dict[str, _EchoRequest] = {}
        self._running: dict[str, _EchoRequest] = {}
        self._rejected: list[RequestOutput] = []
        self._num_seen = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request; a prompt beyond ``max_model_len`` finishes with ``prompt_too_long``.

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if request_id in self._waiting or request_id in self._running:
            raise ValueError(f"request {request_id!r} is already live")
        self._num_seen += 1
        metrics = RequestMetrics(arrival_time_s=arrival_time if arrival_time is not None else time.monotonic())
        request = _EchoRequest(request_id, list(prompt_token_ids), params, priority, self._num_seen, metrics)
        if len(request.prompt_token_ids) + 1 > self._max_model_len:
            message = f"prompt has {len(request.prompt_token_ids)} tokens; max_model_len is {self._max_model_len}"
            self._rejected.append(_output(request, [], "", finished=True, reason=FinishReason.ERROR, error=message))
            return
        self._waiting[request_id] = request

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's UTF-8 bytes (chat messages: their contents, one per line)."""
        return _token_ids(prompt)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Nothing to compile: the echo engine ignores response formats (it echoes)."""

    def step(self) -> list[RequestOutput]:
        """Admit by (priority, arrival), then emit tokens for every running request."""
        if self._step_delay_s:
            time.sleep(self._step_delay_s)
        outputs, self._rejected = self._rejected, []
        outputs += [self._finish(r, FinishReason.ABORT) for r in self._take_aborted()]
        now = time.monotonic()
        for request in sorted(self._waiting.values(), key=lambda r: (r.priority, r.seq)):
            if len(self._running) >= self._max_num_seqs:
                break
            request.metrics.first_scheduled_time_s = now
            self._running[request.request_id] = self._waiting.pop(request.request_id)
        if self._crash_on and any(self._crash_on in bytes(t % 256 for t in r.prompt_token_ids)
                                  for r in self._running.values()):
            os._exit(1)  # NOTE: the test hook (crash_on): a crash that takes every request of the step along
        for request in list(self._running.values()):
            outputs.append(self._advance(request, now))
        return outputs

    def abort(self, request_id: str) -> None:
        """The next step returns the request finished with ``"abort"``; unknown ids are ignored."""
        request = self._waiting.get(request_id) or self._running.get(request_id)
        if request is not None:
            request.is_aborted = True

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._rejected)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self._running), num_waiting=len(self._waiting))

    def _take_aborted(self) -> list[_EchoRequest]:
        aborted = [r for r in [*self._waiting.values(), *self._running.values()] if r.is_aborted]
        for request in aborted:
            self._waiting.pop(request.request_id, None)
            self._running.pop(request.request_id, None)
        return aborted

    def _advance(self, request: _EchoRequest, now: float) -> RequestOutput:
        target = self._target_length(request)
        count = self._tokens_per_step or target
        source = request.prompt_token_ids or [0]
        start = len(request.token_ids)
        new = [source[i % len(source)] for i in range(start, min(target, start + count))]
        if new and request.metrics.first_token_time_s is None:
            request.metrics.first_token_time_s = now
        request.token_ids += new
        delta = request.decoder.decode(bytes(t % 256 for t in new))
        request.text += delta
        if len(request.token_ids) < target:
            return _output(request, new, delta, finished=False, reason=None)
        del self._running[request.request_id]
        reason = FinishReason.LENGTH if target == request.params.max_tokens else FinishReason.STOP
        return self._finish(request, reason, new, delta)

    def _target_length(self, request: _EchoRequest) -> int:
        room = self._max_model_len - len(request.prompt_token_ids)
        max_tokens = request.params.max_tokens or room  # None: the rest of the context
        echo_length = len(request.prompt_token_ids) if not request.params.ignore_eos else max_tokens
        return min(max_tokens, echo_length, room)

    @staticmethod
    def _finish(request: _EchoRequest, reason: FinishReason, new: list[int] | None = None,
                delta: str = "") -> RequestOutput:
        request.metrics.finished_time_s = time.monotonic()
        request.metrics.num_output_tokens = len(request.token_ids)
        return _output(request, new or [], delta, finished=True, reason=reason)


def _token_ids(prompt: Prompt) -> list[int]:
    if isinstance(prompt, TextPrompt):
        return list(prompt.text.encode())
    if isinstance(prompt, ChatPrompt):
        return list("\n".join(str(m.get("content", "")) for m in prompt.messages).encode())
    return list(prompt.token_ids)


def _output(request: _EchoRequest, new: list[int], delta: str, *, finished: bool, reason: FinishReason | None,
            error: str | None = None) -> RequestOutput:
    logprobs = [{t: 0.0} for t in request.token_ids] if request.params.logprobs is not None else None
    token_logprobs = _token_logprobs(request) if finished else None
    # NOTE: n > 1 echoes the same text n times (its samples are identical, as greedy ones would be)
    samples = None
    if finished and request.params.n > 1:
        samples = [SampleOutput(i, list(request.token_ids), request.text, reason, logprobs, token_logprobs)
                   for i in range(request.params.n)]
    return RequestOutput(
        request_id=request.request_id, new_token_ids=new, text_delta=delta, token_ids=list(request.token_ids),
        text=request.text, finished=finished, finish_reason=reason, prompt_token_count=len(request.prompt_token_ids),
        metrics=request.metrics, error=error, error_code=ErrorCode.PROMPT_TOO_LONG if error else None,
        logprobs=logprobs, token_logprobs=token_logprobs, samples=samples,
    )


def _token_logprobs(request: _EchoRequest) -> list[TokenLogprob] | None:
    """OpenAI-shaped logprobs when asked for: each echoed byte is a certain token (logprob 0), its
    own only alternative."""
    if request.params.logprobs is None:
        return None
    items = []
    for token_id in request.token_ids:
        data = bytes([token_id % 256])
        top = TopLogprob(token_id=token_id, token=data.decode("utf-8", errors="replace"), bytes=list(data), logprob=0.0)
        items.append(TokenLogprob(**top.model_dump(), top_logprobs=[top] if request.params.logprobs > 0 else []))
    return items
