"""Per-request state of the logits processors that look at the tokens so far (penalties, the
structured-output matcher). Standard library only: the Request carries one, the sampler fills it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class SamplingState:
    """What the sampler keeps for one request between steps.

    The sampler builds the parts lazily (only for requests whose parameters need them) and brings
    them up to date with ``output_token_ids`` before each use, so they always describe exactly the
    tokens generated so far: preemption (swap or recompute) never changes those tokens, and a
    recomputed request's matcher simply carries on. ``eq=False``: compared and hashed by identity.
    """

    prompt_token_ids: list[int]  # the request's own list (not a copy)
    output_token_ids: list[int]  # the request's own list: it grows as tokens are sampled
    matcher: Any = None  # grammar matcher (engine/sample/grammar.py), built on the first structured step
    num_matched_tokens: int = 0  # output tokens the matcher has consumed
    # NOTE: whether the grammar's forced continuations are bounded (engine/sample/grammar_bounds.py), set with
    # the matcher: only then may grammar-forced drafts walk them
    allows_jump_forward: bool = False
    penalty_slot: int | None = None  # row of the sampler's penalty table (engine/sample/penalties.py)
    num_counted_tokens: int = 0  # output tokens counted in that row
