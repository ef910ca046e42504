"""Exceptions raised by the engine. Imports nothing but the standard library."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model could not be found, or is not a supported decoder-only model."""


class InvariantError(EngineError):
    """An internal invariant broke (a bug, never bad input). Tests must fail loudly on it."""


class DeviceLost(EngineError):
    """Part of the engine's compute is gone (a tensor-parallel rank exited or hangs): no step can run again.
    No request's fault, so never contained to the step's requests: it ends the engine (a worker stops and its
    entries are reclaimed by the fleet)."""


class GrammarError(EngineError, ValueError):
    """A structured-output spec (JSON schema, regex, grammar) cannot be compiled."""


class SamplingError(EngineError):
    """Rows of a step's logits admit no valid choice (NaN, infinite, or every token masked): a fault of
    those requests (their parameters, or the model on their input), which finish with an error."""

    def __init__(self, rows: list[int], message: str) -> None:
        super().__init__(f"rows {rows}: {message}")
        self.rows = rows
