"""The error every OpenAI body translation raises for a field it cannot honour."""

from __future__ import annotations


class BodyError(ValueError):
    """A body field that cannot be honoured.

    Attributes:
        param: the offending field (OpenAI's ``param``), e.g. ``"n"`` or ``"messages"``.
        message: why, for a person.
    """

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
        self.message = message
