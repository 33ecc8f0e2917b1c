"""Error types raised at mixprec's public boundary."""

from __future__ import annotations


class MixprecError(ValueError):
    """A user-facing error: bad input, bad configuration, or a model mixprec cannot handle.

    The CLI prints ``str(error)`` on one line and exits with status 2.

    Attributes:
        stage: the pipeline stage (and pass) that raised it, when known.
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class InternalError(RuntimeError):
    """A fault in mixprec itself (a bug), not in the user's input.

    Attributes:
        stage: the pipeline stage (and pass) that raised it, when known.
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage
