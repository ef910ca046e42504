"""The errors the wire contract raises: a message that cannot be decoded or validated (:class:`SchemaError`),
settings that cannot be read (:class:`ConfigError`) and a Redis that cannot be reached (:class:`RedisUnavailable`,
raised by the connection factory and the embedded Redis). The standard library only.

All three are :class:`ProducerError`\\ s, the base of every error tokenmill's client side raises on purpose (the
producer catches and documents that one class): it is defined here, beneath the schema, the settings and the
connection that raise, so that protocol/ needs nothing of the producer while a caller of the producer still catches
everything with it.
"""

from __future__ import annotations


class ProducerError(Exception):
    """Base class of every error the producer (and the wire contract it speaks) raises on purpose."""


class SchemaError(ProducerError):
    """A message could not be decoded or validated.

    Attributes:
        code: one of :class:`protocol.outcomes.ErrorCode`'s values, e.g. ``"undecodable"``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class ConfigError(ProducerError):
    """A settings file cannot be read, or the environment names a setting in a refused way."""


class RedisUnavailable(ProducerError, ConnectionError):
    """Redis could not be reached (after retries) or the embedded server would not start."""
