"""Exceptions of the worker process. Owns the worker's error hierarchy; imports nothing from engine or producer."""

from __future__ import annotations


class WorkerError(Exception):
    """Base class of every error the worker raises on purpose."""


class StartupError(WorkerError):
    """The worker cannot start serving: its engine cannot be built (a missing or unloadable model,
    a KV budget too small). The message says why in one line."""
