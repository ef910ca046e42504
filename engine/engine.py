"""The continuous-batching engine: admit requests, then step = schedule, execute, update, emit.

Knows nothing of Redis, Celery or wire schemas: inputs are prompts and SamplingParams,
outputs are RequestOutputs. ``Engine.from_config`` builds the real parts (torch, a model);
``Engine(...)`` takes any parts, so tests step a real engine with a scripted runner.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Self

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.clock import Clock, MonotonicClock
from tokenmill.engine.core.length_state import LengthState
from tokenmill.engine.core.limits import ModelLimits
from tokenmill.engine.core.request import Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.stats import EngineStats
from tokenmill.engine.core.step_io import ModelOutput, ScheduledChunk, SchedulerOutput, StepRunner
from tokenmill.engine.echo import build_echo_parts, is_echo_model
from tokenmill.engine.errors import DeviceLost, GrammarError
from tokenmill.engine.offline import GenerationOutput, run_offline
from tokenmill.engine.output.output_processor import OutputProcessor
from tokenmill.engine.output.prompts import Prompt, PromptError, tokenize_prompt
from tokenmill.engine.output.request_output import RequestOutput
from tokenmill.protocol.outcomes import ErrorCode
from tokenmill.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.core.fleet_cache import FleetCache
    from tokenmill.engine.kv.fleet_io import FleetIOFactory
    from tokenmill.engine.sample.grammar import Grammars

logger = logging.getLogger(__name__)

FLEET_IDLE_WAIT_S = 0.02  # an engine with only requests waiting for fleet blocks waits this long per step for them


@dataclasses.dataclass
class _InFlight:
    """A step dispatched to the device thread and not landed yet."""

    plan: SchedulerOutput
    future: Future[tuple[ModelOutput | Exception, float]]


class Engine:
    """Continuous batching over a paged KV cache for any Hugging Face decoder model.

    Args:
        scheduler: decides each step and holds the live requests.
        runner: executes a step (swaps, forward, sampling).
        processor: turns new tokens into outputs.
        tokenizer: the model's tokenizer (prompts are tokenized with a copy of it).
        limits: the model's and cache's limits.
        clock: time source for arrival/queue/TTFT metrics and aging.
        grammars: compiles structured-output grammars (the runner's sampler shares it); None =
            requests with a structured response_format are refused.
        fleet: shares prompt blocks with other engines through a block store; None = local prefix caching only.
        overlap: run each forward on a device thread while this thread plans the next step
            (``Scheduler.schedule_ahead``) and makes the previous step's outputs (``[engine.execution] overlap``);
            False = the synchronous loop, the reference.
    """

    def __init__(self, scheduler: Scheduler, runner: StepRunner, processor: OutputProcessor, tokenizer: Any,
                 limits: ModelLimits, clock: Clock, grammars: Grammars | None = None,
                 fleet: FleetCache | None = None, overlap: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.processor = processor
        self.tokenizer = tokenizer
        self.limits = limits
        self.clock = clock
        self.grammars = grammars
        self.fleet = fleet
        # NOTE: tokenize() may run on another thread while step() detokenizes: a Hugging Face fast
        # tokenizer must not be used by two threads at once ("Already borrowed"), so prompts get
        # their own copy.
        self._prompt_tokenizer = copy.deepcopy(tokenizer)
        self._tokenize_lock = threading.Lock()
        # Overlap (``[engine.execution] overlap``): the forward runs on this thread while the engine thread makes the
        # previous step's outputs; the requests that progressed in the last forward wait here for theirs.
        self._device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-device") if overlap else None
        self._unreported: list[Request] = []
        # ... and the next step is planned while the forward runs (Scheduler.schedule_ahead): the step on the
        # device, and the token each of its requests sampled last (device thread only)
        self._inflight: _InFlight | None = None
        self._last_token_ids: dict[str, int] = {}

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Clock | None = None,
                    fleet_io_for: FleetIOFactory | None = None) -> Self:
        """Load the model and size the KV cache (imports torch), or build the echo model (engine/echo.py:
        no torch, no weights).

        Args:
            config: the engine's settings.
            clock: time source (default: monotonic).
            fleet_io_for: the fleet's store for a namespace, reached off the engine thread, for
                ``[engine.fleet_cache]`` (a worker passes its Redis, worker/store_io.py); the echo model has no KV and
                ignores it.
        """
        clock = clock or MonotonicClock()
        overlap = config.execution.overlap
        if is_echo_model(config.model.name):
            echo = build_echo_parts(config, clock)
            return cls(echo.scheduler, echo.runner, OutputProcessor(echo.tokenizer, clock), echo.tokenizer,
                       echo.limits, clock, echo.grammars, overlap=overlap == "on")
        from tokenmill.engine.model.model_setup import build_engine_parts  # noqa: PLC0415 - torch only for real engines

        parts = build_engine_parts(config, clock, fleet_io_for)
        is_on = overlap == "on" or (overlap == "auto" and parts.runner.device.type == "cuda")
        return cls(parts.scheduler, parts.runner, OutputProcessor(parts.tokenizer, clock), parts.tokenizer,
                   parts.limits, clock, parts.grammars, parts.fleet, overlap=is_on)

    @property
    def model_name(self) -> str:
        return self.limits.model_name

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt; chat messages go through the model's chat template.

        Thread-safe, and meant to run off the engine thread: a long prompt then never stalls a
        step (the tokenizer releases the GIL).

        Raises:
            PromptError: empty or malformed prompt, or no chat template.
        """
        with self._tokenize_lock:
            return tokenize_prompt(self._prompt_tokenizer, prompt)

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the grammar of a structured ``response_format`` into the engine's cache (nothing
        for other requests), so that admitting the request finds it ready.

        Thread-safe, and meant to run off the engine thread (next to :meth:`tokenize`): compiling a
        large schema takes tens of milliseconds that would stall every running request.

        Raises:
            PromptError: code ``validation``: the schema, regex or grammar is invalid, or this
                engine has no structured output.
        """
        if not params.is_structured or params.response_format is None:
            return
        if self.grammars is None:
            raise PromptError(ErrorCode.VALIDATION, "this engine does not support structured output")
        try:
            self.grammars.compile(params.response_format)
        except GrammarError as exc:
            raise PromptError(ErrorCode.VALIDATION, str(exc)) from None

    def warm_grammars(self) -> None:
        """Start the grammar compiler now (its child process: seconds, tens of them under load) rather than on
        the first structured request, which then waits only for its own compile. Meant for a background thread
        at worker start (worker/runtime.py): nothing else waits for it. Never raises: a failure is logged, and
        the first structured request tries again (and is answered with the reason)."""
        warm = getattr(self.grammars, "warm", None)  # NOTE: the echo model's grammars have nothing to start
        if warm is None:
            return
        started_s = time.monotonic()
        try:
            warm()
        except Exception:  # NOTE: a warm-up is an optimisation: the worker serves without it
            logger.warning("grammar compiler warm-up failed; the first structured request starts it",
                           exc_info=True, extra={"event": "grammar_warm_failed"})
            return
        logger.info("grammar compiler warm", extra={"event": "grammar_warm",
                                                     "seconds": round(time.monotonic() - started_s, 2)})

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, length_group: str | None = None,
                    is_handed_off: bool = False, streams: bool = True) -> None:
        """Queue a request. Per-request problems never raise: they finish the request with an
        ``error`` output on the next :meth:`step`.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: the prompt, tokenized (see :meth:`tokenize`).
            params: sampling parameters (default: greedy, 256 tokens).
            priority: lower is more urgent.
            arrival_time: engine-clock time it arrived (default: now).
            length_group: the job it belongs to (a bulk job, a batch): its output length is predicted from
                that job's finished requests first, and the stats report the job's predicted backlog
                (engine/core/length_predictor.py). None: predicted from its prompt and kind only.
            is_handed_off: a prefill worker published its prompt blocks to the fleet's store: the fleet cache
                fetches them whatever they cost, and counts the blocks it had to compute instead.
            streams: whether the caller reads its progress. False: :meth:`step` hands out only its first output
                (that it started) and its final one, and its text is decoded once, when it finishes (each step
                only where stop strings need the text): a caller that waits for whole results pays for nothing
                else.

        Raises:
            ValueError: ``request_id`` is already live.
        """
        if self.scheduler.is_live(request_id) or self.processor.has_rejected(request_id):
            raise ValueError(f"request {request_id!r} is already in the engine")
        params = params or SamplingParams()
        arrival = self.clock.now() if arrival_time is None else arrival_time
        try:
            params = self._resolve_max_tokens(prompt_token_ids, params)
            self._check_fits(prompt_token_ids, params)
            self.compile_grammar(params)
        except PromptError as exc:
            self.processor.reject(request_id, exc.code, str(exc), arrival, num_prompt_tokens=exc.num_prompt_tokens)
            return
        request = Request(request_id, list(prompt_token_ids), params, arrival_time_s=arrival, priority=priority,
                          streams=streams, length_state=LengthState(length_group))
        self.scheduler.add_request(request)
        if self.fleet is not None:
            self.fleet.look_up(request, is_handed_off)

    def _resolve_max_tokens(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens`` = the room the prompt leaves when it asked for "the rest of the
        context" (None), as OpenAI and vLLM do for chat."""
        if params.max_tokens is not None:
            return params
        room = self.limits.max_request_tokens - len(prompt_token_ids)
        if room < 1:
            raise PromptError(ErrorCode.PROMPT_TOO_LONG,
                              f"prompt ({len(prompt_token_ids)} tokens) leaves no room to generate within "
                              f"{self._request_limit}", num_prompt_tokens=len(prompt_token_ids))
        return params.model_copy(update={"max_tokens": max(room, params.min_tokens)})

    def _check_fits(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise PromptError(ErrorCode.VALIDATION, "prompt is empty")
        vocab_size = self.limits.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # NOTE: in C: O(prompt) per request
            raise PromptError(ErrorCode.VALIDATION, f"prompt token ids must be in [0, {vocab_size})")
        if params.n > self.scheduler.config.max_num_seqs:
            raise PromptError(ErrorCode.VALIDATION,
                              f"n ({params.n}) exceeds the sequences this engine runs at once (max_num_seqs "
                              f"{self.scheduler.config.max_num_seqs})")
        needed = len(prompt_token_ids) + (params.max_tokens or 0)
        if needed > self.limits.max_request_tokens:
            raise PromptError(
                ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {needed} "
                f"exceeds {self._request_limit}",
                num_prompt_tokens=len(prompt_token_ids),
            )

    @property
    def _request_limit(self) -> str:
        """What bounds a request, as a prompt-too-long message names it (with the setting to raise)."""
        num_tokens = self.limits.max_request_tokens
        if self.limits.is_cache_bound:
            return f"the KV cache ({num_tokens} tokens)"
        return f"the model context (max_model_len is {num_tokens} tokens)"

    def abort(self, request_id: str) -> None:
        """Stop a request; the next :meth:`step` reports it finished with reason ``abort``.
        Unknown or already finished ids are ignored."""
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        """Whether a step would run something or hand out an output not seen yet."""
        return (self.scheduler.has_unfinished() or self.scheduler.has_finished() or self.processor.has_rejected()
                or bool(self._unreported) or self._inflight is not None)

    @property
    def num_generated_tokens(self) -> int:
        """Output tokens generated since the engine started, every request's."""
        return self.scheduler.counters.num_generated_tokens

    @property
    def overlaps(self) -> bool:
        """Whether steps overlap the forward with the previous step's outputs (``[engine.execution] overlap``)."""
        return self._device is not None

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration and one model forward.

        Returns:
            An output for every request that progressed or finished in this step; with overlap, in the step
            before (this step's forward runs while they are made, and its outputs come with the next call).
        """
        if self.fleet is not None:
            self._poll_fleet(self.fleet)
        if self._device is None:
            scheduler_output = self.scheduler.schedule()
            started_s = time.perf_counter()
            model_output = self._execute(scheduler_output)
            return self._outputs(self._apply(scheduler_output, model_output, time.perf_counter() - started_s))
        return self._overlapped_step()

    def _overlapped_step(self) -> list[RequestOutput]:
        """:meth:`step` with the device thread: while a step's forward runs, the next step is planned ahead and
        dispatched behind it (``Scheduler.schedule_ahead``; where it cannot be, the next call lands the step and
        schedules as usual), and the outputs of the step landed last are made.

        NOTE: on this thread between the forward's dispatch and its landing: a request a stop string ends (or an
        abort) may be in the steps in flight; update() skips their chunks, so it emits nothing past the stop, and
        its blocks, freed now, are handed out only by a later schedule, whose step runs after these on the device.
        """
        device = self._device
        assert device is not None
        inflight = self._inflight
        if inflight is None:
            plan = self.scheduler.schedule()
            started = threading.Event()
            inflight = _InFlight(plan, device.submit(self._forward, plan, started))
            # NOTE: wait until the device thread holds the GIL and starts the forward: left to Python's switch
            # interval (5 ms), it would wait for this thread to block, and nothing would overlap.
            started.wait()
        ahead_plan = self.scheduler.schedule_ahead(inflight.plan)
        ahead = None
        if ahead_plan is not None:
            ahead = _InFlight(ahead_plan, device.submit(self._forward, ahead_plan, None))
        outputs = self._outputs(self._unreported)
        self._unreported = []
        result, step_s = inflight.future.result()
        if isinstance(result, DeviceLost):
            raise result
        if isinstance(result, Exception):
            if ahead is not None:
                # NOTE: the step ahead ran on this step's tokens, which failed: its results are dropped (its requests
                # compute those positions again next step) before this one is re-run in parts here.
                ahead.future.result()
                ahead = None
            model_output = self._isolate(inflight.plan.chunks, result)
        else:
            model_output = result
        self._unreported = self._apply(inflight.plan, model_output, step_s)
        self._inflight = ahead
        return outputs

    def _forward(self, plan: SchedulerOutput,
                 started: threading.Event | None) -> tuple[ModelOutput | Exception, float]:
        """Device thread: run the step's block copies and forward; a failure is returned, for the engine thread to
        trace to its requests (the scheduler is only ever touched there).

        A chunk planned ahead gets its input here: the token the step before (this thread's last forward) sampled
        for its request."""
        if started is not None:
            started.set()
        last_token_ids = self._last_token_ids
        for chunk in plan.chunks:
            if chunk.takes_last_token:
                # NOTE: none when the step before failed: the engine drops this step's results then
                chunk.token_ids[0] = last_token_ids.get(chunk.request_id, 0)
        started_s = time.perf_counter()
        try:
            output = self.runner.execute(self._copies_first(plan))
        except Exception as exc:  # noqa: BLE001 - handed to the engine thread: DeviceLost re-raised, others isolated
            self._last_token_ids = {}
            return exc, time.perf_counter() - started_s
        self._last_token_ids = {rid: tokens[-1] for rid, tokens in output.sampled_token_ids.items() if tokens}
        return output, time.perf_counter() - started_s

    def _apply(self, scheduler_output: SchedulerOutput, model_output: ModelOutput, step_s: float) -> list[Request]:
        """Apply a step's forward to the scheduler (and the speculator's and fleet cache's books); the requests that
        received tokens."""
        if self.scheduler.speculator is not None and scheduler_output.is_decode_only:
            # NOTE: wall time, not the engine clock: the step cost model sizes drafts by what a decode step
            # costs (prefill chunks cost more per token and would skew it), measured, not assumed.
            # NOTE: a decode-only step carried drafts iff it ran more tokens than chunks (each decode runs one)
            num_tokens = scheduler_output.num_batched_tokens
            self.scheduler.speculator.observe_step(num_tokens, step_s, model_output.path,
                                                   num_tokens > len(scheduler_output.chunks))
        progressed = self.scheduler.update(scheduler_output, model_output)
        if self.fleet is not None:
            self.fleet.publish(self.scheduler.take_new_prompt_blocks())
            if not scheduler_output.is_decode_only:
                self.fleet.cost.observe_prefill(scheduler_output.num_batched_tokens, step_s)
        return progressed

    def _outputs(self, progressed: list[Request]) -> list[RequestOutput]:
        """Text for the requests that received tokens, stop strings, and the outputs of everything that progressed
        or finished since the last call."""
        matched, failed = self.processor.detokenize(progressed)
        for request in matched:
            self._stop_on_string(request)
        for request, exc in failed:
            self._fail(request.request_id, exc, request)
        return self.processor.make_outputs(progressed, self.scheduler.take_finished())

    def _poll_fleet(self, fleet: FleetCache) -> None:
        """Load the prompt blocks fetched from the fleet's store; when every live request waits for its blocks,
        wait a little for them instead of spinning (the fleet I/O's fetch thread needs the core)."""
        scheduler = self.scheduler
        is_idle = (not scheduler.num_running and not scheduler.num_swapped
                   and scheduler.num_waiting <= fleet.num_fetching)
        fleet.poll(wait_s=FLEET_IDLE_WAIT_S if is_idle else 0.0)

    def _execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Run one step; a failure is traced to the requests it came from (:meth:`_isolate`).

        NOTE: the step's block copies run first, in a call of their own: they cannot run twice (a
        block swapped out may be reused by the same step), and a failure in them is no request's
        fault, so it is not contained.
        """
        plan = self._copies_first(plan)
        try:
            return self.runner.execute(plan)
        except DeviceLost:
            raise  # no request's fault: the engine cannot step again
        except Exception as exc:  # noqa: BLE001 - traced to its requests; the engine lives on
            return self._isolate(plan.chunks, exc)

    def _copies_first(self, plan: SchedulerOutput) -> SchedulerOutput:
        """Run the step's block copies (swaps, copy-on-write) in a call of their own; the rest of the plan."""
        if plan.swap_out or plan.copy_blocks or plan.swap_in:
            self.runner.execute(dataclasses.replace(plan, chunks=[]))
            return SchedulerOutput(chunks=plan.chunks)
        return plan

    def _isolate(self, chunks: list[ScheduledChunk], step_error: Exception) -> ModelOutput:
        """Re-run a failed step's chunks in halves until each failure is one chunk's; those requests
        finish with an ``internal`` error, the others keep what their parts computed.

        Re-running is safe: a chunk writes the same KV to the same slots every time, and sampling
        state follows the request's own tokens, which a failed step never changed. Greedy and seeded
        rows draw what they would have drawn in the whole batch (batch-invariant).

        Returns:
            The sampled tokens of every chunk that did not fail.
        """
        merged = ModelOutput()
        failures: dict[str, Exception] = {}
        pending = [chunks]
        while pending:
            group = pending.pop()
            try:
                output = self.runner.execute(SchedulerOutput(chunks=group))
            except DeviceLost:
                raise
            except Exception as exc:  # noqa: BLE001 - narrowed down until it names one request
                if len(group) == 1:
                    failures[group[0].request_id] = exc
                else:
                    pending += [group[len(group) // 2:], group[:len(group) // 2]]
                continue
            merged.sampled_token_ids.update(output.sampled_token_ids)
            merged.logprobs.update(output.logprobs)
        if not failures:  # NOTE: e.g. out of memory at the whole batch's size only: its parts ran
            logger.warning("a step failed as a whole and ran in parts", exc_info=step_error,
                           extra={"event": "step_split", "num_chunks": len(chunks)})
        for request_id, failure in failures.items():
            self._fail(request_id, failure)
        return merged

    def _fail(self, request_id: str, exc: Exception, request: Request | None = None) -> None:
        """Finish the request (all of an ``n > 1`` request's samples) with an ``internal`` error.

        Args:
            request: the request object when the caller holds it (it may have finished this step).
        """
        request = request or self.scheduler.get_request(request_id)
        caller_id = request.group.request_id if request is not None and request.group is not None else request_id
        logger.error("the engine failed on a request; it ends with an error and the others go on", exc_info=exc,
                     extra={"event": "request_failed", "request_id": caller_id})
        message = f"the engine failed on this request: {type(exc).__name__}: {exc}"
        if request is not None and request.is_finished:  # NOTE: finished by this very step: out of the queues
            request.fail_finished(ErrorCode.INTERNAL, message)
        else:
            self.scheduler.finish_request(caller_id, RequestStatus.FINISHED_ERROR, ErrorCode.INTERNAL, message)

    def _stop_on_string(self, request: Request) -> None:
        """A stop string matched: the request stops (``stop`` wins over a length limit its token hit)."""
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def generate(
        self,
        prompts: Sequence[Any],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = True,
        priorities: Sequence[int] | None = None,
    ) -> list[GenerationOutput]:
        """Offline convenience: run prompts (text, token ids, chat messages or typed prompts) to
        completion, with a progress bar.

        Returns:
            Final outputs in input order.
        """
        return run_offline(self, prompts, params, progress=progress, priorities=priorities)

    def close(self) -> None:
        """Let go of the engine's threads: publishes to the fleet's store in flight finish first; then of its
        processes (a tensor-parallel runner's follower ranks, the grammar compiler's child, even while it starts)."""
        if self.fleet is not None:
            self.fleet.close()
        if self._device is not None:
            self._device.shutdown(wait=True)
        close_runner = getattr(self.runner, "close", None)  # NOTE: only the model's runner has processes to stop
        if close_runner is not None:
            close_runner()
        close_grammars = getattr(self.grammars, "close", None)  # NOTE: the compile child, or its start in progress
        if close_grammars is not None:
            close_grammars()

    def stats(self) -> EngineStats:
        """Queues, KV usage, totals and the scheduler's counters."""
        stats = dataclasses.replace(self.scheduler.stats(), kv_block_bytes=self.limits.kv_block_bytes,
                                    num_generated_tokens=self.scheduler.counters.num_generated_tokens)
        return dataclasses.replace(stats, fleet=self.fleet.stats()) if self.fleet is not None else stats
