"""Generated inputs a model accepts: learn from ONNX Runtime's refusals.

When the user gives no inputs, :func:`~mixprec.inputs.feeds.resolve_input_shapes` picks the
first guess (1 for each input's first symbolic dim, :data:`DEFAULT_SYMBOLIC_DIM` for the
others). If ONNX Runtime refuses the inputs generated at those shapes, :func:`fit_shapes`
reads its message for the dims it expected (``Got invalid dimensions for input: state
... index: 1 Got: 64 Expected: 1``); when a length op refused (a reflect ``Pad``, a
``Conv`` or pooling window, an ``STFT`` frame longer than the guess:
:data:`~mixprec.inputs.bounds.LENGTH_OPS`) it grows only the guessed dims that op's length
axes carry (the one axis ORT names for a Pad) to the next of :data:`GROWTH`. Any other
refusal teaches nothing: no second run. At most :data:`MAX_RUNS` runs, and never a sample
over :data:`~mixprec.inputs.feeds.MAX_SAMPLE_BYTES`; the notes say the shapes used and why,
and when nothing works the one-line error names the input and the dim and gives a
``--shape`` to try.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TypeVar

from mixprec.core.errors import MixprecError
from mixprec.inputs.bounds import LENGTH_OPS, LENGTH_STEPS
from mixprec.inputs.feeds import DEFAULT_SYMBOLIC_DIM, MAX_SAMPLE_BYTES, GuessedDims
from mixprec.runtime.engine import RuntimeRunError

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
_NODE = re.compile(r"running (?P<op>\w+) node\. Name:'(?P<name>[^']*)'")
_PAD_AXIS = re.compile(
    r"Pad reflect: \w+-pad \(\d+\) exceeds maximum allowed \(\d+\) for axis (\d+)"
)

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


def _refused_dims(text: str, guessed: Guessed) -> list[tuple[str, int]]:
    """The guessed dims a length op's refusal points at (the innermost node ORT names,
    the axis it names for a Pad); none for any other refusal."""
    nodes = list(_NODE.finditer(text))
    if not nodes or nodes[-1]["op"] not in LENGTH_OPS or not isinstance(guessed, GuessedDims):
        return []
    readers = guessed.readers(nodes[-1]["name"])
    axis = _PAD_AXIS.search(text)
    if axis is not None:
        readers = {k: v for k, v in readers.items() if k == int(axis[1])}
    dims = [dim for found in readers.values() for dim in found if dim in guessed]
    return list(dict.fromkeys(dims))


def _grow(
    shapes: Shapes, guessed: Guessed, text: str, first_line: str, why: list[str]
) -> list[str]:
    """Grow the guessed lengths a length op refused to their next step; what grew (none
    when the sample would pass the limit: ``why`` then says so)."""
    grown = {k: list(v) for k, v in shapes.items()}
    done = []
    for name, axis in _refused_dims(text, guessed):
        now = grown[name][axis]
        bigger = [g for g in GROWTH if g > now]
        if now < DEFAULT_SYMBOLIC_DIM or not bigger:
            continue
        grown[name][axis] = bigger[0]
        label = guessed[(name, axis)]
        done.append(
            f"input {name!r} dim {axis} ({label}): {bigger[0]} ({now} was refused: {first_line})"
        )
    if done and isinstance(guessed, GuessedDims) and guessed.oversize(grown) is not None:
        why.append(
            f"the next lengths would take {guessed.sample_bytes(grown) / 2**20:.0f} MiB, over "
            f"the {MAX_SAMPLE_BYTES >> 20} MiB limit on a generated sample"
        )
        return []
    shapes.update(grown)
    return done


def _give_up(
    shapes: Shapes, guessed: Guessed, runs: int, exc: BaseException, why: list[str]
) -> MixprecError:
    longest = max(guessed, key=lambda k: shapes[k[0]][k[1]], default=None)
    if longest is None:
        return MixprecError(f"{exc} (no symbolic input dim to change)")
    name, axis = longest
    dims = ",".join("N" if k == axis else str(d) for k, d in enumerate(shapes[name]))
    reason = f"; {why[0]}" if why else ""
    return MixprecError(
        f"no generated input shape ran after {runs} run(s) (input {name!r} dim {axis} "
        f"last tried {shapes[name][axis]}{reason}): give the shapes, e.g. --shape "
        f"{name}={dims} with the N the model needs; last refusal: {_innermost(str(exc))}"
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
            :class:`~mixprec.runtime.engine.RuntimeRunError` when the runtime refuses them).

    Returns:
        ``(attempt's result, the shapes used, notes)``: one note per changed dim, and
        the number of runs when more than one ran.

    Raises:
        MixprecError: still refused after :data:`MAX_RUNS` runs, or nothing left to try.
    """
    current = {k: list(v) for k, v in shapes.items()}
    notes: list[str] = []
    for runs in range(1, MAX_RUNS + 1):
        too_large = guessed.oversize(current) if isinstance(guessed, GuessedDims) else None
        if too_large is not None:  # nothing is allocated
            raise too_large
        try:
            result = attempt(current)
        except RuntimeRunError as exc:
            text, why = _full_text(exc), list[str]()
            changed = _expected(text, current, guessed)
            changed = changed or _grow(current, guessed, text, _innermost(str(exc)), why)
            if not changed or runs == MAX_RUNS:
                raise _give_up(current, guessed, runs, exc, why) from exc
            notes.extend(changed)
            continue
        if runs > 1:
            used = "; ".join(f"{k} {v}" for k, v in current.items())
            notes.append(f"generated inputs ran on try {runs} of {MAX_RUNS}: {used}")
        return result, current, notes
    raise AssertionError("unreachable")  # pragma: no cover
