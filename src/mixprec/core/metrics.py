"""Comparison of a converted model's outputs with FP32 reference outputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from mixprec.core.jsonio import json_ready
from mixprec.core.ops import DEFAULT_ATOL, TOLERANCES, is_float_dtype
from mixprec.core.output_kinds import OutputKind, shape_class_axis

__all__ = [
    "DEFAULT_RTOL",
    "NEIGHBOUR_TIE",
    "SCORE_TIE",
    "OutputComparison",
    "active_top1",
    "channel_rel_l2",
    "channel_rows",
    "compare_outputs",
    "cosine_similarity",
    "decision_agreement",
    "equal_share",
    "max_abs_error",
    "nearest_neighbours",
    "neighbour_agreement",
    "rel_l2_error",
    "row_cosines",
    "top1_agreement",
    "worst_rel_l2",
]

#: Default relative L2 tolerance of a converted model's outputs, by target (the rel-l2
#: row of :data:`mixprec.core.ops.TOLERANCES`).
DEFAULT_RTOL = TOLERANCES["rel-l2"][1]

#: The floor of a relative error's denominator (a reference of zeros).
_TINY = float(np.finfo(np.float64).tiny)


@dataclass(frozen=True)
class OutputComparison:
    """How one output of a converted model compares with the FP32 reference.

    Attributes:
        name: Output name.
        max_abs_error: ``max |out - ref|`` over positions where both are finite.
        rel_l2_error: :func:`rel_l2_error`: ``||out - ref||_2 / max(||ref||_2, tiny)``
            over the reference's finite positions; inf where the output is not finite
            where the reference is.
        ref_abs_max: ``max |ref|`` over finite reference values.
        top1_agreement: Fraction of rows whose argmax over the class axis agrees, for
            class scores (:mod:`mixprec.core.output_kinds`: the graph's kinds when given,
            else float outputs of rank 2 or 3 whose last dim is in ``[2, 100000]``);
            ``None`` otherwise. Reported only; it does not affect ``passed``.
        passed: ``rel_l2_error <= rtol or max_abs_error <= atol``, no non-finite value
            where the reference is finite, and matching shapes.
        note: Why a comparison failed or was limited, or empty.
    """

    name: str
    max_abs_error: float
    rel_l2_error: float
    ref_abs_max: float
    top1_agreement: float | None
    passed: bool
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict; non-finite floats become the strings ``"inf"``/``"nan"``."""
        return {f.name: json_ready(getattr(self, f.name)) for f in dataclasses.fields(self)}


# --- the output checks: one home for validate, tune, the INT8 guard and batch ----------------


def rel_l2_error(ref: np.ndarray, out: np.ndarray) -> float:
    """``||out - ref|| / max(||ref||, tiny)`` in float64 over the reference's finite
    positions (its non-finite ones are not compared); inf when ``out`` is not finite
    where the reference is (such an output is infinitely wrong, whatever the others).

    The one relative L2 of mixprec: validate's reports (:func:`compare_outputs`), the
    guard, tune and batch read it, one sample at a time (:func:`worst_rel_l2`).

    Example:
        >>> rel_l2_error(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
        0.1
    """
    a = np.asarray(ref, dtype=np.float64).ravel()
    b = np.asarray(out).astype(np.float64).ravel()
    fin = np.isfinite(a)
    if np.any(fin & ~np.isfinite(b)):
        return math.inf
    diff = b[fin] - a[fin]
    return float(np.linalg.norm(diff)) / max(float(np.linalg.norm(a[fin])), _TINY)


def worst_rel_l2(refs: Iterable[np.ndarray], outs: Iterable[np.ndarray]) -> float:
    """The largest :func:`rel_l2_error` over samples (pairs of one output's arrays), 0
    for none: the worst sample, as validate reports each one. Pooling samples into one
    norm let a bad sample hide behind good ones (MiniLM: 0.0985 pooled over 3 samples,
    0.105 on other inputs)."""
    return max((rel_l2_error(r, o) for r, o in zip(refs, outs, strict=True)), default=0.0)


def max_abs_error(ref: np.ndarray, out: np.ndarray) -> float:
    """``max |out - ref|`` over the reference's finite positions (inf: see rel_l2_error)."""
    a = np.asarray(ref, dtype=np.float64).ravel()
    b = np.asarray(out).astype(np.float64).ravel()
    fin = np.isfinite(a)
    if np.any(fin & ~np.isfinite(b)):
        return math.inf
    return float(np.max(np.abs(b[fin] - a[fin]), initial=0.0))


def top1_agreement(ref: np.ndarray, out: np.ndarray, axis: int = -1) -> float:
    """The share of positions whose arg-max over the class ``axis`` agrees (a Softmax's
    own axis: a segmentation ``Softmax(axis=1)`` is read across channels, not width)."""
    a, b = np.asarray(ref), np.asarray(out)
    if a.size == 0:
        return 1.0
    return float(np.mean(np.argmax(a, axis=axis) == np.argmax(b, axis=axis)))


def cosine_similarity(ref: np.ndarray, out: np.ndarray) -> float:
    """The cosine of the two tensors as vectors (-1 when ``out`` is not finite)."""
    a = np.asarray(ref, dtype=np.float64).ravel()
    b = np.asarray(out).astype(np.float64).ravel()
    if not np.all(np.isfinite(b)):
        return -1.0
    fin = np.isfinite(a)
    a, b = a[fin], b[fin]
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return 1.0 if na == nb == 0.0 else float(a @ b) / max(na * nb, 1e-300)


def row_cosines(ref: np.ndarray, out: np.ndarray, axis: int = -1) -> np.ndarray:
    """The cosine of each row (a vector along ``axis``: one embedding) of ``out`` to the
    same row of ``ref``, in float64: 1 where both rows are zero, 0 where one of them is,
    -1 where ``out`` is not finite."""
    a = np.moveaxis(np.asarray(ref, dtype=np.float64), axis, -1)
    b = np.moveaxis(np.asarray(out).astype(np.float64), axis, -1)
    a, b = a.reshape(-1, a.shape[-1] if a.ndim else 1), b.reshape(-1, b.shape[-1] if b.ndim else 1)
    finite = np.all(np.isfinite(b), axis=1)
    a, b = np.where(np.isfinite(a), a, 0.0), np.where(np.isfinite(b), b, 0.0)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    cos = np.sum(a * b, axis=1) / np.maximum(na * nb, 1e-300)
    cos = np.where((na == 0) & (nb == 0), 1.0, cos)
    return np.where(finite, cos, -1.0)


def active_top1(
    ref: np.ndarray, out: np.ndarray, axis: int = -1, threshold: float = 0.5
) -> tuple[float, int]:
    """Argmax agreement over the rows (vectors along ``axis``) where FP32 has a score at
    ``threshold`` or above, and how many such rows there are (1.0 for none): a sigmoid
    row's top bin is its answer only where a bin is on (a silent frame has no top note,
    and its argmax over noise flips freely). A new top bin that FP32 scored within
    :data:`SCORE_TIE` of its own top is a tie, not a changed answer (two bins of a
    chord both at 0.51)."""
    a = np.moveaxis(np.asarray(ref, dtype=np.float64), axis, -1)
    b = np.moveaxis(np.asarray(out).astype(np.float64), axis, -1)
    if a.size == 0:
        return 1.0, 0
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    on = np.max(a, axis=1) >= threshold
    rows = int(np.sum(on))
    top, new = np.argmax(a, axis=1), np.argmax(b, axis=1)
    index = np.arange(len(a))
    same = (top == new) | (a[index, top] - a[index, new] <= SCORE_TIE)
    return (float(np.mean(same[on])) if rows else 1.0), rows


def decision_agreement(ref: np.ndarray, out: np.ndarray, threshold: float = 0.5) -> float:
    """The share of scores on the same side of ``threshold`` (a sigmoid's yes/no per bin,
    tag or pixel)."""
    a, b = np.asarray(ref), np.asarray(out)
    return float(np.mean((a > threshold) == (b > threshold))) if a.size else 1.0


def channel_rel_l2(ref: np.ndarray, out: np.ndarray, axis: int, atol: float = 0.0) -> np.ndarray:
    """The :func:`rel_l2_error` of each channel along ``axis`` (each over the rest of the
    tensor): 4 box coordinates in pixels cannot hide 80 class scores in [0, 1]. A channel
    whose :func:`max_abs_error` is at most ``atol`` counts 0 (a channel near zero, as
    :func:`compare_outputs` passes an output near zero)."""
    a = np.moveaxis(np.asarray(ref, dtype=np.float64), axis, 0)
    b = np.moveaxis(np.asarray(out).astype(np.float64), axis, 0)
    pairs = zip(a, b, strict=True)
    return np.array(
        [0.0 if atol > 0 and max_abs_error(x, y) <= atol else rel_l2_error(x, y) for x, y in pairs]
    )


def channel_rows(arrays: Sequence[np.ndarray], axis: int) -> np.ndarray:
    """The samples of one output as ``[C, rows]``: each channel along ``axis`` with every
    sample's values of it side by side, so that :func:`channel_rel_l2` measures a channel
    over every held-out row. Per sample, the worst channel of the worst sample grew with
    the number of samples: MTCNN O-Net's 4 box offsets at INT8, 48 samples of 8 crops,
    read 0.38 in their worst sample and 0.082 over the 384 rows (2026-12-03)."""
    return np.concatenate(
        [np.moveaxis(np.asarray(a), axis, 0).reshape(np.shape(a)[axis], -1) for a in arrays],
        axis=1,
    )


#: Two scores in [0, 1] this close in FP32 are a tie: either one as the top bin keeps the
#: answer (bf16 stores a score near 0.5 in steps of 0.004).
SCORE_TIE = 1e-2
#: Two neighbours this close in cosine to a row are a tie: either one keeps the answer.
NEIGHBOUR_TIE = 1e-3


def _similarities(rows: np.ndarray) -> np.ndarray:
    """The cosine of each row to every other one (``-inf`` to itself)."""
    x = np.asarray(rows, dtype=np.float64)
    x = np.where(np.isfinite(x), x, 0.0)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    similarity = x @ x.T
    np.fill_diagonal(similarity, -np.inf)
    return similarity


def nearest_neighbours(rows: np.ndarray) -> np.ndarray:
    """Each row's nearest other row by cosine (rows: ``[R, D]``, R >= 2)."""
    return np.argmax(_similarities(rows), axis=1)


def neighbour_agreement(ref_rows: np.ndarray, out_rows: np.ndarray) -> float:
    """The share of rows whose nearest neighbour among the others (by cosine) is the same
    row in both (a sentence encoder's search results), or one the reference ties with it
    (within :data:`NEIGHBOUR_TIE`: near-duplicate rows); 1 for fewer than 3 rows."""
    if len(ref_rows) < 3:
        return 1.0
    similarity = _similarities(ref_rows)
    best = np.max(similarity, axis=1)
    chosen = similarity[np.arange(len(similarity)), nearest_neighbours(out_rows)]
    return float(np.mean(chosen >= best - NEIGHBOUR_TIE))


def equal_share(ref: np.ndarray, out: np.ndarray) -> float:
    """The share of equal elements (integer outputs: counts, indices, masks)."""
    same = np.asarray(ref) == np.asarray(out)
    return float(np.mean(same)) if same.size else 1.0


def _compare_one(
    name: str, ref: np.ndarray, out: np.ndarray, tols: tuple[float, float], kind: OutputKind | None
) -> OutputComparison:
    rtol, atol = tols
    if ref.dtype == object or out.dtype == object:
        return OutputComparison(name, 0.0, 0.0, 0.0, None, True, "not a tensor; not compared")
    ref_float = is_float_dtype(ref.dtype)
    numeric = ref_float or ref.dtype.kind in "iub"
    a = ref.astype(np.float64) if numeric else ref
    finite_ref = a[np.isfinite(a)] if ref_float else a
    ref_abs_max = float(np.abs(finite_ref).max()) if numeric and finite_ref.size else 0.0
    if ref.shape != out.shape:
        note = f"shape {list(out.shape)} differs from the reference shape {list(ref.shape)}"
        return OutputComparison(name, math.inf, math.inf, ref_abs_max, None, False, note)
    if not ref_float or not is_float_dtype(out.dtype):
        equal = bool(np.array_equal(ref, out))
        diff = (
            0.0
            if equal or not numeric or out.dtype.kind not in "iubf"
            else float(np.abs(a - out.astype(np.float64)).max(initial=0.0))
        )
        note = "" if equal else "non-float output differs from the reference"
        return OutputComparison(name, diff, 0.0 if equal else 1.0, ref_abs_max, None, equal, note)

    b = out.astype(np.float64)
    fin_a = np.isfinite(a)
    fin_b = np.isfinite(b)
    notes: list[str] = []
    bad = int(np.count_nonzero(fin_a & ~fin_b))
    if bad:
        notes.append(f"{bad} non-finite value(s) where the reference is finite")
    ref_nonfinite = int(a.size - np.count_nonzero(fin_a))
    if ref_nonfinite:
        notes.append(f"{ref_nonfinite} non-finite reference value(s) not compared")
    mask = fin_a & fin_b
    diff = b[mask] - a[mask]
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    rel = rel_l2_error(a, b)
    top1: float | None = None
    axis = shape_class_axis(a.shape) if kind is None else _class_axis(kind, a.ndim)
    if axis is not None and a.size:
        top1 = top1_agreement(a, b, axis)
    passed = (rel <= rtol or max_abs <= atol) and not bad
    return OutputComparison(name, max_abs, rel, ref_abs_max, top1, passed, "; ".join(notes))


def _class_axis(kind: OutputKind, ndim: int) -> int | None:
    """The class axis of a top1 output of rank ``ndim`` (None: not class scores)."""
    if kind.check != "top1" or ndim == 0 or not -ndim <= kind.axis < ndim:
        return None
    return kind.axis


def compare_outputs(
    ref: Mapping[str, np.ndarray],
    out: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float = DEFAULT_ATOL,
    kinds: Mapping[str, OutputKind] | None = None,
) -> list[OutputComparison]:
    """Compares converted-model outputs with reference outputs, in float64.

    An output passes when its relative L2 error is at most ``rtol`` or its max absolute
    error is at most ``atol`` (the latter for references near zero), and it has no
    non-finite value where the reference is finite. Non-float outputs must be equal.

    Args:
        ref: Reference (FP32) outputs by name; every one of them is compared.
        out: Converted-model outputs by name.
        rtol: Relative L2 tolerance.
        atol: Absolute tolerance.
        kinds: The reference model's output kinds
            (:func:`~mixprec.core.output_kinds.classify_outputs`): top-1 is reported on
            the class axis of class scores only; without them, by shape.

    Returns:
        One comparison per reference output, in ``ref`` order.
    """
    results: list[OutputComparison] = []
    for name, ref_value in ref.items():
        if name not in out:
            note = "missing from the converted model's outputs"
            results.append(OutputComparison(name, math.inf, math.inf, 0.0, None, False, note))
            continue
        kind = kinds.get(name) if kinds is not None else None
        a, b = np.asarray(ref_value), np.asarray(out[name])
        results.append(_compare_one(name, a, b, (rtol, atol), kind))
    return results
