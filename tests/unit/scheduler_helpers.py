"""Shared builders for scheduler and block manager tests: requests, schedulers, a scripted
model runner that simulates the KV cache, a step loop with per-step checks, a leak check.

No torch, no model. The ScriptedModelRunner stores, for every device and host slot, the KV a
real model would: it depends on the position and on every token up to it (a chain hash of
them), so requests with the same prefix write the same KV and may share it. It executes swap
and block copies like the real runner and verifies, before every forward, that each position
it reads holds KV of that position consistent with what it read before for the same request.
Its sampled token is a hash of the context's chain and the request's seed, so outputs are
deterministic per (prompt, seed) and any scheduling mistake changes them or fails loudly.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.config import LengthConfig, SchedulerConfig
from tokenmill.engine.core.clock import ManualClock
from tokenmill.engine.core.length_predictor import LengthPredictor
from tokenmill.engine.core.request import ParallelGroup, Request, RequestStatus
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.step_io import ModelOutput, SchedulerOutput
from tokenmill.engine.kv.block_manager import BlockManager
from tokenmill.engine.kv.prefix_cache import PrefixCache
from tokenmill.protocol.sampling import SamplingParams

Slot = tuple[int, int] | None  # (position, chain hash of the tokens up to it) whose KV a slot holds
ROOT_CHAIN = 0


def make_request(
    request_id: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time_s: float = 0.0,
    prompt_token_ids: list[int] | None = None,
    n: int = 1,
    seed: int | None = None,
) -> Request:
    """A request with a deterministic prompt derived from its id."""
    if prompt_token_ids is None:
        prompt_seed = zlib.crc32(request_id.encode())
        prompt_token_ids = [(prompt_seed + 7 * i) % 97 + 1 for i in range(num_prompt_tokens)]
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, n=n, seed=seed),
        arrival_time_s=arrival_time_s,
        priority=priority,
    )


def make_scheduler(
    num_gpu_blocks: int = 64,
    num_cpu_blocks: int = 0,
    block_size: int = 4,
    clock: ManualClock | None = None,
    eos_token_id: int | None = None,
    prefix_caching: bool = False,
    length: LengthConfig | None = None,
    **scheduler_config: Any,
) -> Scheduler:
    """A scheduler over a fresh BlockManager and a ManualClock (pass ``clock`` to share one); ``length``
    gives it an output-length predictor with that config.

    Aging and the long-output cap are off unless asked for: each scenario names the policy it tests.
    """
    config = SchedulerConfig(**{"aging_interval_s": 0.0, "demote_after_decode_steps": 0, **scheduler_config})
    prefix_cache = PrefixCache(block_size) if prefix_caching else None
    block_manager = BlockManager(num_gpu_blocks, num_cpu_blocks, block_size, prefix_cache)
    eos_token_ids = frozenset() if eos_token_id is None else frozenset({eos_token_id})
    return Scheduler(config, block_manager, clock if clock is not None else ManualClock(), eos_token_ids,
                     prefix_cache=prefix_cache, length_predictor=LengthPredictor(length) if length else None)


def chain(previous: int, token_id: int) -> int:
    """The scripted KV of a position: a hash of the position's token and everything before it."""
    return zlib.crc32(f"{previous}:{token_id}".encode())


def next_token(seed: int | None, context_chain: int, vocab_size: int) -> int:
    """The scripted 'model': a stable hash of the request's seed and the whole context it read."""
    return zlib.crc32(f"{seed}:{context_chain}".encode()) % vocab_size


def scripted_continuation(prompt_token_ids: Sequence[int], num_tokens: int, seed: int | None = None,
                          vocab_size: int = 50) -> list[int]:
    """What the scripted runner samples after ``prompt_token_ids`` with ample room."""
    context = ROOT_CHAIN
    for token_id in prompt_token_ids:
        context = chain(context, token_id)
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(next_token(seed, context, vocab_size))
        context = chain(context, out[-1])
    return out


class KVMismatch(AssertionError):
    """The scheduler made the runner read KV that was never written for that position."""


class ScriptedModelRunner:
    """A fake runner with a simulated paged KV cache (no tensors)."""

    def __init__(self, block_manager: BlockManager, vocab_size: int = 50) -> None:
        self.block_size = block_manager.block_size
        self.vocab_size = vocab_size
        self.device: list[list[Slot]] = [[None] * self.block_size for _ in range(block_manager.num_gpu_blocks)]
        self.host: list[list[Slot]] = [[None] * self.block_size for _ in range(block_manager.num_cpu_blocks)]
        self.request_to_chains: dict[str, list[int]] = {}  # per request: the chain of each position it saw
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Swap out, swap in, then 'forward' every chunk; sample where asked."""
        _copy_blocks(scheduler_output.swap_out, self.device, self.host)
        _copy_blocks(scheduler_output.copy_blocks, self.device, self.device)
        _copy_blocks(scheduler_output.swap_in, self.host, self.device)
        self.num_swapped_out_blocks += len(scheduler_output.swap_out)
        self.num_swapped_in_blocks += len(scheduler_output.swap_in)
        _check_writes(scheduler_output, self.block_size)
        output = ModelOutput()
        for chunk in scheduler_output.chunks:
            end = chunk.start_position + chunk.num_tokens
            if len(chunk.block_ids) * self.block_size < end:
                raise KVMismatch(f"{chunk.request_id}: table {chunk.block_ids} too short for {end} tokens")
            context = self._read_prefix(chunk.request_id, chunk.start_position, chunk.block_ids)
            chains = self.request_to_chains[chunk.request_id]
            for position, token_id in zip(range(chunk.start_position, end), chunk.token_ids):
                context = chain(context, token_id)
                del chains[position:]
                chains.append(context)
                self._slot(chunk.block_ids, position)[position % self.block_size] = (position, context)
            if chunk.needs_sample:
                token_id = next_token(chunk.sampling_params.seed, context, self.vocab_size)
                output.sampled_token_ids[chunk.request_id] = [token_id]
        return output

    def _slot(self, block_ids: list[int], position: int) -> list[Slot]:
        return self.device[block_ids[position // self.block_size]]

    def _read_prefix(self, request_id: str, start: int, block_ids: list[int]) -> int:
        """The chain at ``start``; every position before it must hold KV of that position, and the
        same KV as when this request last read or wrote it (its record starts at first sight)."""
        chains = self.request_to_chains.setdefault(request_id, [])
        for position in range(start):
            slot = self._slot(block_ids, position)[position % self.block_size]
            if slot is None or slot[0] != position:
                raise KVMismatch(f"{request_id}: position {position} reads {slot}")
            if position < len(chains) and chains[position] != slot[1]:
                raise KVMismatch(f"{request_id}: position {position} changed under it")
            if position == len(chains):
                chains.append(slot[1])
        return chains[start - 1] if start else ROOT_CHAIN


def _check_writes(scheduler_output: SchedulerOutput, block_size: int) -> None:
    """No block is written by two chunks, nor written by one while another chunk reads it."""
    written: dict[int, str] = {}
    for chunk in scheduler_output.chunks:
        end = chunk.start_position + chunk.num_tokens
        for index in range(chunk.start_position // block_size, (end - 1) // block_size + 1):
            written[chunk.block_ids[index]] = chunk.request_id
    for chunk in scheduler_output.chunks:
        for block_id in chunk.block_ids:
            if written.get(block_id, chunk.request_id) != chunk.request_id:
                raise KVMismatch(f"block {block_id} is written by {written[block_id]} and held by {chunk.request_id}")


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
    advances a ManualClock by ``advance_s`` per step.

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
        if advance_s and isinstance(clock, ManualClock):
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
        runner.request_to_chains.pop(request.request_id, None)


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
    """Outputs of the same requests run with ample memory and budgets and no prefix cache (fresh
    copies); an n > 1 request becomes its samples run as separate requests (seed + index)."""
    copies = [make_request(ParallelGroup.sample_id(r.request_id, i) if r.sampling_params.n > 1 else r.request_id,
                           prompt_token_ids=list(r.prompt_token_ids), max_tokens=r.sampling_params.max_tokens,
                           seed=r.sampling_params.for_sample(i).seed)
              for r in requests for i in range(r.sampling_params.n)]
    num_tokens = sum(r.max_total_tokens for r in copies)
    scheduler = make_scheduler(num_gpu_blocks=num_tokens, block_size=1, max_num_batched_tokens=num_tokens,
                               max_prefill_chunk=num_tokens, max_num_seqs=len(copies), eos_token_id=eos_token_id)
    runner = ScriptedModelRunner(scheduler.block_manager, vocab_size)
    run = step_until_done(scheduler, runner, arrivals={0: copies})
    assert_no_leaks(scheduler)
    return run.outputs
