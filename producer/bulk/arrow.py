"""pyarrow (the ``parquet`` extra), imported only by jobs that read or write Parquet, with one clear
error when it is not installed. Never imports torch, the engine or the worker.
"""

from __future__ import annotations

from typing import Any

from tokenmill.producer.bulk.errors import BulkError

INSTALL_HINT = "pip install 'tokenmill[parquet]'"


def import_pyarrow(purpose: str, error: type[BulkError] = BulkError) -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``.

    Raises:
        BulkError: (of type ``error``) pyarrow is missing: ``purpose`` needs it, and how to install it.
    """
    try:
        import pyarrow  # noqa: PLC0415 - optional extra
        import pyarrow.parquet  # noqa: PLC0415 - optional extra
    except ImportError as exc:
        raise error(f"{purpose} needs pyarrow: {INSTALL_HINT}") from exc
    return pyarrow, pyarrow.parquet
