"""The mutable plan of one ``Scheduler.schedule()`` call: budgets left and what was chosen.

Standard library only. Turned into the plain :class:`SchedulerOutput` at the end of the step.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

from tokenmill.engine.config import SchedulerConfig
from tokenmill.engine.core.request import Request
from tokenmill.engine.core.scheduler_policy import is_decode
from tokenmill.engine.core.step_io import ScheduledChunk, SchedulerOutput
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.kv.block_manager import BlockManager


@dataclass
class StepPlan:
    """Budgets left in this step and the work chosen so far.

    Invariant: the tokens in ``request_to_num_tokens`` plus ``num_tokens_left`` equal the
    step's total budget, and likewise for prefill tokens and for decode tokens (drafts included), so removing a
    chunk refunds exactly.
    """

    index: int  # 0-based step number (Scheduler stats num_steps before this step)
    now_s: float  # clock time read once at the start of the step
    max_prefill_chunk: int  # per-request prefill tokens per step
    num_tokens_left: int  # of max_num_batched_tokens
    num_prefill_tokens_left: int  # of SchedulerConfig.prefill_token_budget
    num_decode_tokens_left: int  # of SchedulerConfig.decode_token_budget (decodes and their drafts)
    request_to_num_tokens: dict[str, int] = field(default_factory=dict)  # scheduled, in order
    prefill_request_ids: set[str] = field(default_factory=set)  # chunks charged to the prefill budget
    admitted_request_ids: set[str] = field(default_factory=set)  # admitted or resumed this step
    preempted_request_ids: list[str] = field(default_factory=list)  # lost their device blocks this step
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device) copies
    # request -> (position, source, destination): copy-on-write of a shared block it writes this step
    copies: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    # prefix-cache keys of the next block each prefill scheduled this step computes (see Scheduler)
    inflight_block_keys: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)
    # the predicted-KV budget (engine/core/kv_budget.py): steps until the request it held back this step has
    # room (None: none held back), and how many requests behind it may still be checked for backfilling
    backfill_steps: float | None = None
    num_backfill_checks_left: int = 0
    num_paced_skips_left: int = 64  # long requests passed over while the budget paces them (Scheduler._is_paced)

    @classmethod
    def start(cls, config: SchedulerConfig, index: int, now_s: float) -> StepPlan:
        """A fresh plan with the full budgets of ``config``."""
        return cls(
            index=index,
            now_s=now_s,
            max_prefill_chunk=config.max_prefill_chunk,
            num_tokens_left=config.max_num_batched_tokens,
            num_prefill_tokens_left=config.prefill_token_budget,
            num_decode_tokens_left=config.decode_token_budget,
        )

    def num_tokens_for(self, request: Request, start: int | None = None) -> int:
        """Most tokens the budgets allow the request this step (0: none left for it).

        Args:
            start: tokens already in the cache (default: the request's computed tokens; a prefix
                hit not taken yet counts here).
        """
        if is_decode(request):
            return min(1, self.num_tokens_left, self.num_decode_tokens_left)
        num_remaining = request.num_schedulable_tokens - (request.num_computed_tokens if start is None else start)
        return max(
            0, min(num_remaining, self.max_prefill_chunk, self.num_tokens_left, self.num_prefill_tokens_left)
        )

    def add(self, request: Request, num_tokens: int) -> None:
        """Schedule ``num_tokens`` of the request and charge the budgets.

        Raises:
            InvariantError: the request is already scheduled, or a budget would go negative.
        """
        if request.request_id in self.request_to_num_tokens or num_tokens < 1:
            raise InvariantError(f"bad chunk for {request.request_id}: {num_tokens} tokens")
        is_prefill = not is_decode(request)
        self.num_tokens_left -= num_tokens
        if is_prefill:
            self.num_prefill_tokens_left -= num_tokens
            self.prefill_request_ids.add(request.request_id)
        else:
            self.num_decode_tokens_left -= num_tokens
        if self.num_tokens_left < 0 or self.num_prefill_tokens_left < 0 or self.num_decode_tokens_left < 0:
            raise InvariantError(f"budget exceeded scheduling {request.request_id}")
        self.request_to_num_tokens[request.request_id] = num_tokens

    def add_decodes(self, requests: list[Request]) -> None:
        """:meth:`add` of one token each for requests known to be decoding, within the budgets (the scheduler
        checked them for the whole batch first).

        Raises:
            InvariantError: one is scheduled already.
        """
        request_to_num_tokens = self.request_to_num_tokens
        num_before = len(request_to_num_tokens)
        request_to_num_tokens.update((request.request_id, 1) for request in requests)
        if len(request_to_num_tokens) != num_before + len(requests):
            raise InvariantError("a decode was scheduled twice")
        self.num_tokens_left -= len(requests)
        self.num_decode_tokens_left -= len(requests)

    def add_drafts(self, request_ids: list[str], num_draft_tokens: list[int]) -> None:
        """Grow scheduled decodes by draft tokens (``request.draft_token_ids``), ``num_draft_tokens[i]`` for
        ``request_ids[i]``, charged to the step's budget like any token.

        NOTE: checked and applied by builtins over the lists (this runs every step over every drafting request).

        Raises:
            InvariantError: a request is not scheduled as a one-token decode (or named twice), a draft is empty, or
                the budget would go negative.
        """
        if not request_ids:
            return
        request_to_num_tokens = self.request_to_num_tokens
        if set(map(request_to_num_tokens.get, request_ids)) != {1} or len(set(request_ids)) != len(request_ids) or \
                not self.prefill_request_ids.isdisjoint(request_ids) or min(num_draft_tokens) < 1 or \
                len(num_draft_tokens) != len(request_ids):
            raise InvariantError(f"bad drafts: {dict(zip(request_ids, num_draft_tokens))}")
        request_to_num_tokens.update(zip(request_ids, map(operator.add, itertools.repeat(1), num_draft_tokens)))
        total = sum(num_draft_tokens)
        self.num_tokens_left -= total
        self.num_decode_tokens_left -= total
        if self.num_tokens_left < 0 or self.num_decode_tokens_left < 0:
            raise InvariantError(f"budget exceeded drafting {total} tokens")

    def remove(self, request_id: str) -> None:
        """Unschedule the request's chunk (if any) and refund its tokens."""
        num_tokens = self.request_to_num_tokens.pop(request_id, 0)
        self.num_tokens_left += num_tokens
        if request_id in self.prefill_request_ids:
            self.prefill_request_ids.discard(request_id)
            self.num_prefill_tokens_left += num_tokens
        else:
            self.num_decode_tokens_left += num_tokens

    def build_output(self, requests: dict[str, Request], block_manager: BlockManager) -> SchedulerOutput:
        """The plain output for the runner: decode chunks first, then prefill chunks."""
        chunks = [self._chunk(requests[rid], n, block_manager) for rid, n in self.request_to_num_tokens.items()]
        if self.prefill_request_ids:
            chunks.sort(key=lambda chunk: chunk.request_id in self.prefill_request_ids)
        return SchedulerOutput(
            chunks=chunks,
            swap_out=list(self.swap_out),
            swap_in=list(self.swap_in),
            copy_blocks=[(source, destination) for _, source, destination in self.copies.values()],
            preempted_request_ids=list(self.preempted_request_ids),
        )

    @staticmethod
    def _chunk(request: Request, num_tokens: int, block_manager: BlockManager) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_tokens
        num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
        num_draft_tokens = end - num_known if end > num_known else 0  # the tail past the known tokens: the draft's
        token_ids = request.token_slice(start, end - num_draft_tokens)
        if num_draft_tokens:
            drafts = request.draft_token_ids  # NOTE: as long as the plan's draft (the scheduler cut it): no copy
            token_ids += drafts if len(drafts) == num_draft_tokens else drafts[:num_draft_tokens]
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=block_manager.block_table(request.request_id),
            needs_sample=end >= num_known,
            sampling_params=request.sampling_params,
            num_output_tokens=len(request.output_token_ids),
            sampling_state=request.sampling_state,
            num_draft_tokens=num_draft_tokens,
        )
