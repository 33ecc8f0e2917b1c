"""How each output is checked, as rows of answers: an output's kind (from the graph,
:mod:`mixprec.core.output_kinds`) and, where the graph cannot say, its FP32 values.

The unit of an answer is a row (a sample, a frame, a position, an anchor, a token): a
check counts the rows whose answer holds. :func:`readings` turns an output's kind into
the checks it gets, each an :class:`~mixprec.core.output_kinds.OutputKind` with its
reason:

* **top1**: argmax agreement on the class axis (a Softmax's scores, logits);
* **scores** (a Sigmoid's, or values in [0, 1]): **top1-active**, argmax agreement in
  the rows where FP32 has a score of 0.5 or more (a silent frame has no top bin; FP32's
  near-ties are ties), and
  **decision**, the share of scores on the same side of 0.5 (a bin, a tag, a pixel on
  or off);
* **embedding**: **row-cosine**, the share of rows (one vector each, along the last axis)
  at the cosine bound or above, and **neighbours**, the share of rows whose nearest
  neighbour among the held-out rows stays the same;
* an output the graph calls **other** is read by its FP32 values: a **detection** head
  (:mod:`mixprec.core.detections`: decoded detections, F1 against FP32's); values in
  [0, 1] as **scores** (rows summing to 1: **top1**, a Softmax the graph hides); a
  rank-2 or rank-3 float output without class structure and at least 8 features as an
  **embedding**; anything else, and every regression head, by
  **channels**: the relative L2 of each channel along its short feature axis, the worst
  one counted, so that 4 box coordinates cannot hide 80 scores. A single relative L2
  over a whole tensor is never an output's only check.

Integer outputs keep **match** (equal elements). The user's ``--output-kind NAME=KIND``
replaces the reading (:func:`parse_output_kind`); ``rel-l2`` (the worst sample's) and
``cosine`` (the mean of its rows) are the readings of before, for whoever wants them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mixprec.core.detections import head_layout
from mixprec.core.errors import MixprecError
from mixprec.core.output_kinds import OutputKind

__all__ = [
    "EMBEDDING_MIN_FEATURES",
    "KIND_NAMES",
    "parse_output_kind",
    "readings",
    "user_kinds",
    "with_user_kinds",
]

#: A float output without class structure reads as embeddings from this many features
#: (fewer: a box, a landmark, a small regression, read by channels).
EMBEDDING_MIN_FEATURES = 8
#: The kinds a user may name (``--output-kind NAME=KIND``; ``@AXIS`` after the axed ones).
KIND_NAMES = (
    "top1",
    "scores",
    "embedding",
    "detection",
    "channels",
    "match",
    "rel-l2",
    "cosine",
)


def readings(kind: OutputKind, samples: Sequence[np.ndarray]) -> list[OutputKind]:
    """The checks of an output of ``kind`` whose FP32 values on the held-out samples are
    ``samples`` (one array per sample)."""
    if kind.check == "scores":
        return _scores(kind.axis, _classes(kind.axis, samples) >= 2, kind.reason)
    if kind.check == "embedding":
        return _embedding(kind.reason)
    if kind.check != "other":
        return [kind]
    if not samples:
        return [OutputKind("rel-l2", kind.axis, kind.reason)]
    return _by_values(kind, samples)


def _classes(axis: int, samples: Sequence[np.ndarray]) -> int:
    """The size of the class ``axis`` (0 without samples or such an axis)."""
    if not samples or np.ndim(samples[0]) == 0:
        return 0
    shape = np.shape(samples[0])
    return shape[axis] if -len(shape) <= axis < len(shape) else 0


def _scores(axis: int, argmax: bool, why: str) -> list[OutputKind]:
    """Argmax on the class axis where a score is on (``argmax``: it has 2 entries or
    more) and the 0.5 decision."""
    checks = [OutputKind("decision", axis, f"{why}: each score's side of 0.5")]
    if argmax:
        top = f"{why}: argmax on axis {axis} in rows with a score >= 0.5"
        checks.insert(0, OutputKind("top1-active", axis, top))
    return checks


def _embedding(why: str) -> list[OutputKind]:
    return [
        OutputKind("row-cosine", -1, f"{why}: rows at the cosine bound"),
        OutputKind("neighbours", -1, f"{why}: each row's nearest neighbour kept"),
    ]


def _by_values(kind: OutputKind, samples: Sequence[np.ndarray]) -> list[OutputKind]:
    """An *other* float output read by its FP32 values (the module docstring)."""
    first = np.asarray(samples[0])
    shape = tuple(first.shape)
    regression = "regression" in kind.reason
    layout = None if regression else head_layout(shape, first)
    if layout is not None:
        features = shape[layout.axis]
        why = f"a detection head {layout.describe(features)}: detections F1 vs FP32"
        return [OutputKind("detection", layout.axis, why)]
    values = np.concatenate([np.asarray(s, dtype=np.float64).ravel() for s in samples])
    values = values[np.isfinite(values)]
    if not regression and first.ndim >= 1 and values.size and _unit(values):
        axis = 1 if first.ndim == 4 else -1
        size = shape[axis]
        if size >= 2 and _distribution(samples, axis):  # a Softmax the graph hides
            why = f"values in [0, 1] summing to 1 on axis {axis}: class scores"
            return [OutputKind("top1", axis, f"{why}: argmax on axis {axis}")]
        return _scores(axis, size >= 2, f"values in [0, 1], {size} on axis {axis}: scores")
    if not regression and first.ndim in (2, 3) and shape[-1] >= EMBEDDING_MIN_FEATURES:
        return _embedding(f"{shape[-1]} features a row, no class structure: an embedding")
    short = _short_axis(shape)
    if short is None:  # a scalar or a vector: one relative L2 is all there is to read
        return [OutputKind("rel-l2", -1, f"{kind.reason}: rel L2")]
    head = "a regression head" if regression else "other float output"
    why = (
        f"{head}: rel L2 of each of its {shape[short]} channels on axis {short} over "
        "every row, the worst"
    )
    return [OutputKind("channels", short, why)]


def _distribution(samples: Sequence[np.ndarray], axis: int) -> bool:
    """Whether every row along ``axis`` sums to 1 (probabilities of one answer)."""
    sums = [np.sum(np.asarray(s, dtype=np.float64), axis=axis) for s in samples]
    return all(np.allclose(total, 1.0, atol=1e-3) for total in sums)


def _unit(values: np.ndarray) -> bool:
    return bool(values.min() >= 0.0 and values.max() <= 1.0)


def _short_axis(shape: tuple[int, ...]) -> int | None:
    """The shortest axis after the first (the batch) with 2 entries or more."""
    axes = [(size, axis) for axis, size in enumerate(shape) if axis > 0 and size >= 2]
    return min(axes)[1] if axes else None


def parse_output_kind(text: str) -> tuple[str, OutputKind]:
    """``NAME=KIND`` (``KIND@AXIS`` for top1, scores, channels and detection) as the
    output's name and its kind, the reason saying the user chose it.

    Raises:
        MixprecError: no ``=``, or a kind or axis mixprec does not know.
    """
    name, sep, spelled = text.partition("=")
    base, _, axis_text = spelled.strip().partition("@")
    if not sep or not name.strip() or base not in KIND_NAMES:
        raise MixprecError(
            f"--output-kind {text!r}: give NAME=KIND with KIND one of {', '.join(KIND_NAMES)}"
            " (top1, scores, channels and detection take @AXIS)"
        )
    try:
        axis = int(axis_text) if axis_text else -1
    except ValueError:
        raise MixprecError(f"--output-kind {text!r}: the axis must be an integer") from None
    return name.strip(), OutputKind(base, axis, f"chosen by --output-kind {base}")


def user_kinds(given: Mapping[str, Any] | Sequence[str] | None) -> dict[str, OutputKind]:
    """The user's readings: ``{"out": "detection"}`` (or ``OutputKind`` values), or the
    CLI's ``["out=detection", ...]``, each checked (:func:`parse_output_kind`).

    Raises:
        MixprecError: a kind mixprec does not know, or not a mapping or a list of text.
    """
    if not given:
        return {}
    if isinstance(given, Mapping):
        items = [
            f"{name}={kind.spec if isinstance(kind, OutputKind) else kind}"
            for name, kind in given.items()
        ]
    elif isinstance(given, Sequence) and not isinstance(given, str):
        items = [str(item) for item in given]
    else:
        raise MixprecError(f"output_kinds must map output names to kinds, not {given!r}")
    return dict(parse_output_kind(item) for item in items)


def with_user_kinds(
    kinds: Mapping[str, OutputKind], user: Mapping[str, OutputKind]
) -> dict[str, OutputKind]:
    """The graph's ``kinds`` with the user's in their place.

    Raises:
        MixprecError: the user names an output the model does not have.
    """
    unknown = sorted(set(user) - set(kinds))
    if unknown:
        raise MixprecError(
            f"--output-kind names {', '.join(map(repr, unknown))}, not an output of the "
            f"model (its outputs: {', '.join(map(repr, kinds))})"
        )
    return {name: user.get(name, kind) for name, kind in kinds.items()}
