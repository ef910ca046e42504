"""What output-length prediction keeps on each request (``Request.length_state``): the job it belongs to, the
history keys that predict it, and its estimates. Written by the predictor (engine/core/length_predictor.py), read
by the scheduler's ordering and the predicted-KV budget (engine/core/kv_budget.py). Standard library only."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from tokenmill.engine.core.length_history import KeyHistory, LengthEstimate


@dataclass(slots=True)
class LengthState:
    """One request's length prediction.

    ``group`` is given with the request; the rest is the predictor's.
    """

    group: str | None = None  # the job whose history predicts it (None: its prompt and kind only)
    keys: tuple[KeyHistory, ...] = ()  # its history keys' histories, most specific first (made on first estimate)
    is_tracked: bool = False  # counted live under its keys (from its first estimate until it finishes or is forgotten)
    estimate: LengthEstimate | None = None  # the latest estimate ...
    history_size: int = 0  # ... and the history's size then
    # the template (a prompt-prefix key it shares with other live requests) whose rows its length varies with, when
    # its estimate came from coarser history than that template's own (the KV budget adds their deviations)
    correlation: Hashable | None = None
    # ... and that template has fewer than min_samples rows started or finished: ordering by length runs it first
    exploring: bool = False
    admitted_estimate: LengthEstimate | None = None  # the one in force when first admitted (its error is measured by)

    def for_sample(self) -> LengthState:
        """A parallel sample's state: the parent's job, keys and admission estimate; estimated afresh."""
        return LengthState(self.group, self.keys, admitted_estimate=self.admitted_estimate)
