"""What the sampler and its logits processors know about one row of a step's batch: the request's
parameters, its output position, the model's EOS ids and its sampling state. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.core.sampling_state import SamplingState
from tokenmill.protocol.sampling import SamplingParams


@dataclass
class SamplingContext:
    """What the sampler needs to know about one row of the batch."""

    params: SamplingParams  # the request's sampling parameters
    num_output_tokens: int  # tokens generated so far == index of the token being sampled
    eos_token_ids: frozenset[int]  # the model's EOS ids (possibly several)
    state: SamplingState | None = None  # the request's penalty / grammar state (needed when it uses them)
    # Speculative decoding: the draft tokens between the request's output and this row (row i of a
    # draft chunk follows d1..di): penalties count them and the grammar has accepted them here.
    draft_prefix: list[int] = field(default_factory=list)

    @property
    def is_min_tokens_active(self) -> bool:
        """True while EOS and stop ids must be suppressed for this row."""
        return self.params.is_min_tokens_active(self.num_output_tokens)
