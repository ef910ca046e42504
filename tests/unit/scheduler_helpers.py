"""Shared builders for scheduler and block manager tests: requests, schedulers, a scripted
model runner that simulates the KV cache, a step loop with per-step checks, a leak check.

No torch, no model. The ScriptedModelRunner stores, for every device and host slot, which
(request, position, token) KV it holds; it executes swap copies like the real runner and
verifies, before every forward, that each position it reads holds the KV that was written
for it. Its sampled token is a hash of the context it read, so outputs are deterministic
per (request, prompt) and any scheduling mistake changes them or fails loudly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.block_manager import BlockManager
from engine.clock import FakeClock
from engine.config import SchedulerConfig
from engine.outputs import ModelOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

Slot = tuple[str, int, int] | None  # (request_id, position, token_id) whose KV a slot holds


def make_request(
    request_id: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time_s: float = 0.0,
    prompt_token_ids: list[int] | None = None,
) -> Request:
    """A request with a deterministic prompt derived from its id."""
    if prompt_token_ids is None:
        seed = zlib.crc32(request_id.encode())
        prompt_token_ids = [(seed + 7 * i) % 97 + 1 for i in range(num_prompt_tokens)]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens),
        arrival_time_s=arrival_time_s,
        priority=priority,
    )


def make_scheduler(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    clock: FakeClock | None = None,
    eos_token_id: int | None = None,
    **scheduler_config: Any,
) -> Scheduler:
    """A scheduler over a fresh BlockManager and a FakeClock (pass ``clock`` to share one).

    Aging and the long-output cap are off unless asked for: each scenario names the policy it tests.
    """
    config = SchedulerConfig(**{"aging_interval_s": 0.0, "max_consecutive_decode_steps": 0, **scheduler_config})
    block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size)
    eos_token_ids = frozenset() if eos_token_id is None else frozenset({eos_token_id})
    return Scheduler(config, block_manager, clock if clock is not None else FakeClock(), eos_token_ids)


def next_token(request_id: str, context_token_ids: Sequence[int], vocab_size: int) -> int:
    """The scripted 'model': a stable hash of the request and the whole context it read."""
    return zlib.crc32(f"{request_id}:{list(context_token_ids)}".encode()) % vocab_size


class KVMismatch(AssertionError):
    """The scheduler made the runner read KV that was never written for that position."""


class ScriptedModelRunner:
    """A fake runner with a simulated paged KV cache (no tensors)."""

    def __init__(self, block_manager: BlockManager, vocab_size: int = 50) -> None:
        self.block_size = block_manager.block_size
        self.vocab_size = vocab_size
        self.device: list[list[Slot]] = [[None] * self.block_size for _ in range(block_manager.num_gpu_blocks)]
        self.host: list[list[Slot]] = [[None] * self.block_size for _ in range(block_manager.num_cpu_blocks)]
        self.request_to_token_ids: dict[str, list[int]] = {}  # tokens the runner has seen per request
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Swap out, swap in, then 'forward' every chunk; sample where asked."""
        _copy_blocks(scheduler_output.swap_out, self.device, self.host)
        _copy_blocks(scheduler_output.swap_in, self.host, self.device)
        self.num_swapped_out_blocks += len(scheduler_output.swap_out)
        self.num_swapped_in_blocks += len(scheduler_output.swap_in)
        written_block_ids: set[int] = set()
        output = ModelOutput()
        for chunk in scheduler_output.chunks:
            end = chunk.start_position + chunk.num_tokens
            if len(chunk.block_ids) * self.block_size < end:
                raise KVMismatch(f"{chunk.request_id}: table {chunk.block_ids} too short for {end} tokens")
            if written_block_ids & set(chunk.block_ids):
                raise KVMismatch(f"{chunk.request_id}: shares blocks with another chunk of this step")
            written_block_ids |= set(chunk.block_ids)
            token_ids = self._record_tokens(chunk.request_id, chunk.start_position, chunk.token_ids)
            self._verify_prefix(chunk.request_id, chunk.start_position, chunk.block_ids, token_ids)
            for position in range(chunk.start_position, end):
                block_id = chunk.block_ids[position // self.block_size]
                self.device[block_id][position % self.block_size] = (chunk.request_id, position, token_ids[position])
            if chunk.needs_sample:
                if end != len(token_ids):
                    raise KVMismatch(f"{chunk.request_id}: sampling at {end} but {len(token_ids)} tokens known")
                token_id = next_token(chunk.request_id, token_ids[:end], self.vocab_size)
                token_ids.append(token_id)
                output.sampled_token_ids[chunk.request_id] = [token_id]
        return output

    def _record_tokens(self, request_id: str, start: int, chunk_token_ids: list[int]) -> list[int]:
        token_ids = self.request_to_token_ids.setdefault(request_id, [])
        for offset, token_id in enumerate(chunk_token_ids):
            position = start + offset
            if position < len(token_ids):
                if token_ids[position] != token_id:
                    raise KVMismatch(f"{request_id}: token at {position} changed")
            elif position == len(token_ids):
                token_ids.append(token_id)
            else:
                raise KVMismatch(f"{request_id}: gap before position {position}")
        return token_ids

    def _verify_prefix(self, request_id: str, start: int, block_ids: list[int], token_ids: list[int]) -> None:
        for position in range(start):
            slot = self.device[block_ids[position // self.block_size]][position % self.block_size]
            if slot != (request_id, position, token_ids[position]):
                raise KVMismatch(f"{request_id}: position {position} reads {slot}")


def _copy_blocks(pairs: list[tuple[int, int]], source: list[list[Slot]], target: list[list[Slot]]) -> None:
    targets = [target_id for _, target_id in pairs]
    if len(set(targets)) != len(targets):
        raise KVMismatch(f"two copies into the same block: {pairs}")
    for source_id, target_id in pairs:
        target[target_id] = list(source[source_id])


@dataclass
class Run:
    """What happened in a run of :func:`step_until_done`."""

    outputs: dict[str, list[int]] = field(default_factory=dict)  # request_id -> generated tokens
    statuses: dict[str, RequestStatus] = field(default_factory=dict)  # request_id -> final status
    steps: list[SchedulerOutput] = field(default_factory=list)
    admitted_step: dict[str, int] = field(default_factory=dict)  # request_id -> first step it ran
    admitted_time_s: dict[str, float] = field(default_factory=dict)
    finished_step: dict[str, int] = field(default_factory=dict)


def assert_step_within_budgets(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Every per-step budget of the scheduler's config holds for ``output``."""
    config = scheduler.config
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert len(output.chunks) <= config.max_num_seqs
    assert scheduler.num_running <= config.max_num_seqs
    request_ids = [chunk.request_id for chunk in output.chunks]
    assert len(set(request_ids)) == len(request_ids)
    num_prefill_tokens = 0
    is_decode_flags = []
    for chunk in output.chunks:
        request = scheduler.get_request(chunk.request_id)
        assert request is not None and request.status is RequestStatus.RUNNING
        is_decode = chunk.num_tokens == 1 and chunk.needs_sample and chunk.start_position >= request.num_prompt_tokens
        is_decode_flags.append(is_decode)
        if not is_decode:
            assert chunk.num_tokens <= config.max_prefill_chunk
            num_prefill_tokens += chunk.num_tokens
    assert num_prefill_tokens <= config.prefill_token_budget
    assert is_decode_flags == sorted(is_decode_flags, reverse=True), "decodes come before prefill chunks"


def step_until_done(
    scheduler: Scheduler,
    runner: ScriptedModelRunner | None = None,
    *,
    arrivals: Mapping[int, Sequence[Request]] | None = None,
    max_steps: int = 2000,
    advance_s: float = 0.0,
    on_step: Callable[[int, SchedulerOutput], None] | None = None,
) -> Run:
    """Drive the scheduler like the engine does until every request finished.

    Adds ``arrivals[i]`` before step i, checks budgets and invariants after every schedule
    and update, records what the scheduler finished (it decides stopping itself), and
    advances a FakeClock by ``advance_s`` per step.

    Raises:
        AssertionError: a budget or invariant broke, or ``max_steps`` passed (a hang).
    """
    runner = runner or ScriptedModelRunner(scheduler.block_manager)
    arrivals = arrivals or {}
    run = Run()
    last_arrival = max(arrivals, default=-1)
    for step in range(max_steps):
        for request in arrivals.get(step, ()):
            scheduler.add_request(request)
        if step > last_arrival and not scheduler.has_unfinished():
            return run
        output = scheduler.schedule()
        run.steps.append(output)
        scheduler.check_invariants()
        assert_step_within_budgets(scheduler, output)
        _record_admissions(scheduler, output, run, step)
        if on_step is not None:
            on_step(step, output)
        scheduler.update(output, runner.execute(output))
        _record_finishes(scheduler, runner, run, step)
        scheduler.check_invariants()
        clock = scheduler.clock
        if advance_s and isinstance(clock, FakeClock):
            clock.advance(advance_s)
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.stats()}")


def _record_admissions(scheduler: Scheduler, output: SchedulerOutput, run: Run, step: int) -> None:
    for chunk in output.chunks:
        if chunk.request_id not in run.admitted_step:
            run.admitted_step[chunk.request_id] = step
            run.admitted_time_s[chunk.request_id] = scheduler.clock.now()


def _record_finishes(scheduler: Scheduler, runner: ScriptedModelRunner, run: Run, step: int) -> None:
    for request in scheduler.take_finished():
        run.outputs[request.request_id] = list(request.output_token_ids)
        run.statuses[request.request_id] = request.status
        run.finished_step[request.request_id] = step
        runner.request_to_token_ids.pop(request.request_id, None)


def assert_no_leaks(scheduler: Scheduler) -> None:
    """The end of every scenario: no requests left, both pools entirely free, invariants hold."""
    assert not scheduler.has_unfinished()
    assert scheduler.num_waiting == scheduler.num_running == scheduler.num_swapped == 0
    block_manager = scheduler.block_manager
    assert block_manager.num_free_gpu_blocks == block_manager.num_gpu_blocks
    assert block_manager.num_free_cpu_blocks == block_manager.num_cpu_blocks
    scheduler.check_invariants()


def reference_outputs(
    requests: Sequence[Request], eos_token_id: int | None = None, vocab_size: int = 50
) -> dict[str, list[int]]:
    """Outputs of the same requests run with ample memory and budgets (fresh copies)."""
    copies = [make_request(r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                           max_tokens=r.sampling_params.max_tokens) for r in requests]
    num_tokens = sum(r.max_total_tokens for r in copies)
    scheduler = make_scheduler(num_gpu_blocks=num_tokens, block_size=1, max_num_batched_tokens=num_tokens,
                               max_prefill_chunk=num_tokens, max_num_seqs=len(copies), eos_token_id=eos_token_id)
    runner = ScriptedModelRunner(scheduler.block_manager, vocab_size)
    run = step_until_done(scheduler, runner, arrivals={0: copies})
    assert_no_leaks(scheduler)
    return run.outputs
