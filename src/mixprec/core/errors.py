"""Error types raised at mixprec's public boundary.

Two kinds, told apart by the CLI's exit status:

* :class:`MixprecError` (a ``ValueError``): the user's input, configuration or model is
  the problem. The CLI prints one line and exits with status 2.
* :class:`InternalError` (a ``RuntimeError``): mixprec itself is at fault (a pass broke
  the graph, an invariant does not hold). The CLI prints one line asking for a bug report
  and exits with status 3; so does any other exception that escapes a command.

Both may name the pipeline ``stage`` (pass) that failed.

Example:
    >>> try:                                                     # doctest: +SKIP
    ...     mixprec.convert("model.onnx", "fp8")
    ... except mixprec.MixprecError as exc:
    ...     print(exc, exc.stage)
"""

from __future__ import annotations

__all__ = ["InternalError", "MixprecError", "describe"]


class MixprecError(ValueError):
    """A user-facing error: bad input, bad configuration, or a model mixprec cannot handle.

    The CLI prints ``str(error)`` on one line and exits with status 2.

    Attributes:
        stage: The pipeline stage or pass that failed (e.g. ``"check"``), or ``None``.
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


class InternalError(RuntimeError):
    """A fault in mixprec itself, not in the user's input: please report it.

    The CLI prints one line asking for a bug report and exits with status 3.

    Attributes:
        stage: The pipeline stage or pass that failed (e.g. ``"check"``), or ``None``.
    """

    def __init__(self, message: str, *, stage: str | None = None) -> None:
        super().__init__(message)
        self.stage = stage


def describe(exc: BaseException) -> str:
    """One line for ``exc``: its message's first line, prefixed by its stage when known.

    Exceptions that are neither :class:`MixprecError` nor :class:`InternalError` are named
    by their type, since their message alone often does not say what went wrong.
    """
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    if not isinstance(exc, MixprecError | InternalError):
        first = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    stage = getattr(exc, "stage", None)
    if stage:
        return f"in stage {stage!r}: {first}"
    return first
