"""Repetition penalties on the device: OpenAI's presence / frequency penalties over the tokens
generated so far, Hugging Face's repetition penalty over prompt + generated tokens. Imports torch
(a sampler helper).

Each penalized request owns one row of a :class:`PenaltyTable` (its output-token counts and its
prompt-token mask), kept up to date incrementally, so a step does one gather and a few
element-wise operations for all rows at once, never a Python loop over tensors.
"""

from __future__ import annotations

import weakref

import torch

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.protocol.sampling import SamplingParams

_MIN_SLOTS = 8


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    params: list[SamplingParams]) -> torch.Tensor:
    """Penalized copy of ``logits``, one row per request.

    Repetition (Hugging Face ``RepetitionPenaltyLogitsProcessor``): a token seen in the prompt or
    the output has its logit divided by the penalty when positive, multiplied when not. Then
    frequency and presence (OpenAI): ``logit -= frequency * count + presence * (count > 0)``.

    Args:
        logits: ``[rows, vocab]`` float scores.
        output_counts: ``[rows, vocab]`` times each token was generated (any number dtype).
        prompt_mask: ``[rows, vocab]`` bool, True for tokens of the prompt.
        params: each row's sampling parameters.

    Returns:
        A new ``[rows, vocab]`` tensor of ``logits``' dtype.
    """
    dtype, device = logits.dtype, logits.device

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)

    repetition = column([p.repetition_penalty for p in params])
    frequency = column([p.frequency_penalty for p in params])
    presence = column([p.presence_penalty for p in params])
    is_generated = output_counts > 0
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(prompt_mask | is_generated, penalized, logits)
    return logits - frequency * output_counts.to(dtype) - presence * is_generated.to(dtype)


class PenaltyTable:
    """Device rows of token counts and prompt masks, one per penalized live request.

    A request takes a row on its first penalized step; the row returns to the free list when the
    request's :class:`SamplingState` is garbage-collected (the request finished and was dropped).

    Args:
        vocab_size: columns (the logits' width).
        device: where the rows live (the logits' device).
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_slots: list[int] = []

    @property
    def num_used_slots(self) -> int:
        return self.output_counts.shape[0] - len(self._free_slots)

    def rows(self, states: list[SamplingState], draft_prefixes: list[list[int]] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output counts and prompt masks of ``states``' requests, up to date with their tokens.

        Args:
            states: one per row (a request with draft tokens has several rows).
            draft_prefixes: per row, the draft tokens before it, counted in that row only.

        Returns:
            ``([rows, vocab] int32 counts, [rows, vocab] bool prompt mask)``, gathered copies.
        """
        slots: list[int] = []
        counted_slots: list[int] = []
        counted_ids: list[int] = []
        for state in states:
            slot = self._assign(state) if state.penalty_slot is None else state.penalty_slot
            new_ids = state.output_token_ids[state.num_counted_tokens:]
            state.num_counted_tokens += len(new_ids)
            counted_slots += [slot] * len(new_ids)
            counted_ids += new_ids
            slots.append(slot)
        if counted_ids:
            index = (torch.tensor(counted_slots, device=self.device), torch.tensor(counted_ids, device=self.device))
            ones = torch.ones(len(counted_ids), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_(index, ones, accumulate=True)
        slot_tensor = torch.tensor(slots, device=self.device)
        counts = self.output_counts[slot_tensor]
        drafted = [(row, token_id) for row, prefix in enumerate(draft_prefixes or []) for token_id in prefix]
        if drafted:
            rows, ids = zip(*drafted)
            index = (torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device))
            counts.index_put_(index, torch.ones(len(ids), dtype=counts.dtype, device=self.device), accumulate=True)
        return counts, self.prompt_mask[slot_tensor]

    def _assign(self, state: SamplingState) -> int:
        """Give the request a row (zero counts, its prompt's mask), freed with the state; returns it."""
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        prompt_ids = [t for t in state.prompt_token_ids if 0 <= t < self.vocab_size]
        self.output_counts[slot] = 0
        self.prompt_mask[slot] = False
        self.prompt_mask[slot, torch.tensor(prompt_ids, dtype=torch.long, device=self.device)] = True
        state.penalty_slot, state.num_counted_tokens = slot, 0
        weakref.finalize(state, self._free_slots.append, slot)
        return slot

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(_MIN_SLOTS, 2 * old)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(new - old, self.vocab_size)])
        self.prompt_mask = torch.cat([self.prompt_mask, self.prompt_mask.new_zeros(new - old, self.vocab_size)])
        self._free_slots += range(new - 1, old - 1, -1)
