"""Generated inputs a model accepts: learn from ONNX Runtime's refusals.

When the user gives no inputs, :func:`~mixprec.io.feeds.resolve_input_shapes` picks the
first guess (1 for each input's first symbolic dim, :data:`DEFAULT_SYMBOLIC_DIM` for the
others). If ONNX Runtime refuses the inputs generated at those shapes, :func:`fit_shapes`
reads its message for the dims it expected (``Got invalid dimensions for input: state
... index: 1 Got: 64 Expected: 1``); otherwise it grows the guessed lengths along
:data:`GROWTH` (a reflect pad, a kernel or a frame longer than the guess). At most
:data:`MAX_RUNS` runs; the notes say the shapes used and why, and when nothing works
the one-line error names the input and the dim and gives a ``--shape`` to try.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from mixprec.core.errors import MixprecError
from mixprec.io.bounds import LENGTH_STEPS
from mixprec.io.feeds import DEFAULT_SYMBOLIC_DIM
from mixprec.runtime.ort import OrtRunError

__all__ = ["GROWTH", "MAX_RUNS", "fit_shapes"]

T = TypeVar("T")

#: The lengths a guessed dim grows through, one step per refusal.
GROWTH = LENGTH_STEPS[1:]
#: The most runs of the model (the first guess included).
MAX_RUNS = 5

_EXPECTED = re.compile(
    r"Got invalid dimensions for input: (?P<name>\S+) for the following indices\s*"
    r"(?P<pairs>(?:\s*index: \d+ Got: \d+ Expected: \d+)+)"
)
_PAIR = re.compile(r"index: (\d+) Got: (\d+) Expected: (\d+)")

Shapes = dict[str, list[int]]
Guessed = Mapping[tuple[str, int], str]


def _full_text(exc: BaseException) -> str:
    """The refusal with ORT's own multi-line message (the cause) when there is one."""
    return f"{exc}\n{exc.__cause__}" if exc.__cause__ is not None else str(exc)


def _innermost(message: str) -> str:
    """ORT's innermost status message (an If or Loop wraps its body's refusal)."""
    return message.rsplit("Status Message: ", 1)[-1].strip()[:200]


def _expected(text: str, shapes: Shapes, guessed: Guessed) -> list[str]:
    """Set the guessed dims ORT named with the value it expected; what was set."""
    done = []
    for found in _EXPECTED.finditer(text):
        name = found["name"].rstrip(",")
        for index, got, want in _PAIR.findall(found["pairs"]):
            axis = int(index)
            if (name, axis) in guessed and shapes[name][axis] == int(got):
                shapes[name][axis] = int(want)
                done.append(f"input {name!r} dim {axis}: {want} (onnxruntime expected it)")
    return done


def _grow(shapes: Shapes, guessed: Guessed, first_line: str) -> list[str]:
    """Grow every guessed length (not the batch-like 1s) to its next step; what grew."""
    done = []
    for (name, axis), label in guessed.items():
        now = shapes[name][axis]
        bigger = [g for g in GROWTH if g > now]
        if now < DEFAULT_SYMBOLIC_DIM or not bigger:
            continue
        shapes[name][axis] = bigger[0]
        done.append(
            f"input {name!r} dim {axis} ({label}): {bigger[0]} ({now} was refused: {first_line})"
        )
    return done


def _give_up(shapes: Shapes, guessed: Guessed, runs: int, exc: BaseException) -> MixprecError:
    longest = max(guessed, key=lambda k: shapes[k[0]][k[1]], default=None)
    if longest is None:
        return MixprecError(f"{exc} (no symbolic input dim to change)")
    name, axis = longest
    dims = ",".join("N" if k == axis else str(d) for k, d in enumerate(shapes[name]))
    return MixprecError(
        f"no generated input shape ran after {runs} run(s) (input {name!r} dim {axis} "
        f"last tried {shapes[name][axis]}): give the shapes, e.g. --shape {name}={dims} "
        f"with the N the model needs; last refusal: {_innermost(str(exc))}"
    )


def fit_shapes(
    shapes: Mapping[str, list[int]], guessed: Guessed, attempt: Callable[[Shapes], T]
) -> tuple[T, Shapes, list[str]]:
    """Run ``attempt(shapes)`` until ONNX Runtime accepts the generated inputs.

    Args:
        shapes: the first guess, by input name.
        guessed: ``{(input, axis): dim label}`` of the dims that were guessed (symbolic,
            not given by the user): the only ones changed.
        attempt: runs the model on inputs generated at the shapes (raises
            :class:`~mixprec.runtime.ort.OrtRunError` when ONNX Runtime refuses them).

    Returns:
        ``(attempt's result, the shapes used, notes)``: one note per changed dim, and
        the number of runs when more than one ran.

    Raises:
        MixprecError: still refused after :data:`MAX_RUNS` runs, or nothing left to try.
    """
    current = {k: list(v) for k, v in shapes.items()}
    notes: list[str] = []
    for runs in range(1, MAX_RUNS + 1):
        try:
            result = attempt(current)
        except OrtRunError as exc:
            changed = _expected(_full_text(exc), current, guessed)
            changed = changed or _grow(current, guessed, _innermost(str(exc)))
            if not changed or runs == MAX_RUNS:
                raise _give_up(current, guessed, runs, exc) from exc
            notes.extend(changed)
            continue
        if runs > 1:
            used = "; ".join(f"{k} {v}" for k, v in current.items())
            notes.append(f"generated inputs ran on try {runs} of {MAX_RUNS}: {used}")
        return result, current, notes
    raise AssertionError("unreachable")  # pragma: no cover
