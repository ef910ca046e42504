"""The context manager of the producer side's closable things (a ``Producer``, a bulk job's line writer):
``with thing:`` closes it on the way out, however the block ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType

from typing_extensions import Self


class Closing(ABC):
    """``with x:`` (or ``with X(...) as x:``) yields ``x`` and calls ``x.close()`` at the end of the block."""

    @abstractmethod
    def close(self) -> None:
        """Release what the object holds."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
