"""Exceptions of the worker process. Owns the worker's error hierarchy; imports nothing from engine or producer."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose."""


class RetryableError(WorkerError):
    """A transient failure (e.g. Redis unreachable): retry the same work after ``defer_s``.

    Works like arq's ``Retry``: the caller keeps the work it was doing and tries again.

    Attributes:
        defer_s: seconds to wait before the retry.
    """

    def __init__(self, message: str, defer_s: float = 1.0) -> None:
        super().__init__(message)
        self.defer_s = defer_s


class ConfigError(WorkerError):
    """The merged configuration (file, env, flags) is invalid or unreadable."""
