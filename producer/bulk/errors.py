"""Errors of bulk jobs. Never imports torch, the engine or the worker."""

from __future__ import annotations

from tokenmill.protocol.errors import ProducerError


class BulkError(ProducerError):
    """A bulk job cannot run (as opposed to one bad line, which is reported and skipped)."""


class BulkInputError(BulkError):
    """The input file cannot be read: missing, wrong format, no prompt column, no pyarrow."""
