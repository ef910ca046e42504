"""What changes a row's scores before sampling, other than temperature, top-k and top-p:
penalties, structured-output masks and min_tokens. Imports torch (a sampler helper).
"""

from __future__ import annotations

import torch

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.sample.context import SamplingContext
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_mask import GrammarMasks
from tokenmill.engine.sample.penalties import PenaltyTable, apply_penalties


class LogitsProcessors:
    """Applies, in this order, repetition / frequency / presence penalties, grammar masks and the
    min_tokens ban, each to the rows that ask for it, in a few batched tensor operations.

    Args:
        grammars: compiles structured-output grammars; None = no structured output (a structured
            row is then an internal error: the engine refuses such requests at admission).
    """

    def __init__(self, grammars: GrammarCompiler | None = None) -> None:
        self._grammar_masks = GrammarMasks(grammars) if grammars is not None else None
        self._penalty_table: PenaltyTable | None = None  # made on the first penalized step

    def needs_processing(self, context: SamplingContext) -> bool:
        params = context.params
        return params.has_penalties or params.is_structured or context.is_min_tokens_active

    def apply(self, logits: torch.Tensor, contexts: list[SamplingContext]) -> torch.Tensor:
        """Processed scores: ``logits`` itself when no row needs anything, else a processed copy.

        Args:
            logits: ``[rows, vocab]`` float scores; never modified.
            contexts: one per row.
        """
        if not any(self.needs_processing(c) for c in contexts):
            return logits
        processed = logits.clone()
        penalized = [i for i, c in enumerate(contexts) if c.params.has_penalties]
        if penalized:
            self._penalize_(processed, penalized, contexts)
        structured = [i for i, c in enumerate(contexts) if c.params.is_structured]
        if structured:
            if self._grammar_masks is None:
                raise InvariantError("a structured request reached a sampler without a grammar compiler")
            self._grammar_masks.apply_(processed, structured, [_state(contexts[i]) for i in structured],
                                       [contexts[i].params for i in structured],
                                       [contexts[i].draft_prefix for i in structured])
        _ban_min_tokens_(processed, contexts)
        return processed

    def _penalize_(self, logits: torch.Tensor, rows: list[int], contexts: list[SamplingContext]) -> None:
        if self._penalty_table is None:
            self._penalty_table = PenaltyTable(logits.shape[1], logits.device)
        counts, prompt_mask = self._penalty_table.rows([_state(contexts[i]) for i in rows],
                                                       [contexts[i].draft_prefix for i in rows])
        index = torch.tensor(rows, device=logits.device)
        penalized = apply_penalties(logits[index], counts, prompt_mask, [contexts[i].params for i in rows])
        logits[index] = penalized


def _state(context: SamplingContext) -> SamplingState:
    if context.state is None:
        raise InvariantError("a penalized or structured row without its request's sampling state")
    return context.state


def _ban_min_tokens_(logits: torch.Tensor, contexts: list[SamplingContext]) -> None:
    """EOS and stop ids to -inf, in place, on rows still below ``min_tokens``.

    NOTE: masks EOS even when ``ignore_eos`` is set: min_tokens means "no EOS before N tokens".
    Ids outside the vocabulary are ignored.
    """
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i, c in enumerate(contexts):
        if not c.is_min_tokens_active:
            continue
        banned_ids = [t for t in c.eos_token_ids | frozenset(c.params.stop_token_ids) if 0 <= t < vocab_size]
        row_idx += [i] * len(banned_ids)
        col_idx += banned_ids
    if col_idx:
        logits[torch.tensor(row_idx, device=logits.device), torch.tensor(col_idx, device=logits.device)] = float("-inf")
