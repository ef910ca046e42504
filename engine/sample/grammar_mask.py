"""Token masks of structured-output rows, for the sampler: brings each request's grammar matcher
up to date with its output, fills one bitmask row per request (xgrammar, on the CPU) and sets the
logits of tokens the grammar does not allow next to -inf, in place. Imports torch (a sampler helper).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.engine.errors import InvariantError
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.protocol.sampling import SamplingParams

# dtypes xgrammar's C++ CPU kernel takes; others (float64 in tests) use its torch implementation.
_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GrammarMasks:
    """Per-step masking of the rows whose requests have a structured ``response_format``.

    Args:
        compiler: compiles (or finds cached) grammars and makes matchers.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(vocab / 32)] int32 on the CPU, grown on demand

    def apply_(self, logits: torch.Tensor, rows: list[int], states: list[SamplingState],
               params: list[SamplingParams], draft_prefixes: list[list[int]] | None = None) -> None:
        """Mask ``logits[rows[j]]`` in place with the grammar of request ``j``.

        Args:
            logits: ``[batch, vocab]`` scores, modified in place (only the given rows).
            rows: batch rows with a structured response_format.
            states: each row's request state (its matcher is made or advanced here).
            params: each row's sampling parameters.
            draft_prefixes: per row, the draft tokens before it: its mask is the grammar's after them
                (the matcher accepts them, fills the row, and rolls back). A row after a draft token
                the grammar refuses (or after a stop token) keeps the mask before that token: its row
                cannot sample the refused token, so the draft is cut there and the later rows' tokens
                are never kept.

        Raises:
            InvariantError: a generated token was not allowed by the grammar (the mask was bypassed).
        """
        import xgrammar  # noqa: PLC0415 - present whenever a structured request was admitted

        bitmask = self._buffer(logits.shape[0])
        prefixes = draft_prefixes or [[] for _ in rows]
        for row, state, row_params, prefix in zip(rows, states, params, prefixes):
            matcher = synced_matcher(self.compiler, state, row_params)
            num_accepted = 0
            for token_id in prefix:
                if not matcher.accept_token(token_id):
                    break
                if matcher.is_terminated():  # NOTE: a stop token: the request ends there, later rows are never kept
                    matcher.rollback(1)
                    break
                num_accepted += 1
            matcher.fill_next_token_bitmask(bitmask, row)
            if num_accepted:
                matcher.rollback(num_accepted)
        on_cpu = logits.device.type == "cpu"
        backend: Literal["auto", "torch_native"] = (
            "auto" if not on_cpu or logits.dtype in _CPU_KERNEL_DTYPES else "torch_native")
        device_bitmask = bitmask if on_cpu else bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, device_bitmask, vocab_size=self.compiler.vocab_size,
                                             indices=rows, backend=backend)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        num_words = (self.compiler.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = torch.full((num_rows, num_words), -1, dtype=torch.int32,
                                       pin_memory=torch.cuda.is_available())
        return self._bitmask


def synced_matcher(compiler: GrammarCompiler, state: SamplingState, params: SamplingParams) -> Any:
    """The request's matcher, made on first use and fed the output tokens it has not seen yet."""
    if state.matcher is None:
        if params.response_format is None:
            raise InvariantError("a structured row without a response_format")
        state.matcher, state.num_matched_tokens = compiler.new_matcher(params.response_format), 0
        state.allows_jump_forward = compiler.allows_jump_forward(params.response_format)
    for token_id in state.output_token_ids[state.num_matched_tokens:]:
        if not state.matcher.accept_token(token_id):
            raise InvariantError(f"token {token_id} was generated against the grammar")
        state.num_matched_tokens += 1
    return state.matcher
