"""Exceptions raised by the engine. Imports nothing but the standard library."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model could not be found, or is not a supported decoder-only model."""


class InvariantError(EngineError):
    """An internal invariant broke (a bug, never bad input). Tests must fail loudly on it."""


class GrammarError(EngineError, ValueError):
    """A structured-output spec (JSON schema, regex, grammar) cannot be compiled."""
