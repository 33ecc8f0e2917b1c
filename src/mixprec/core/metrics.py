"""Comparison of a converted model's outputs with FP32 reference outputs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from mixprec.core.ops import TOLERANCES

__all__ = [
    "DEFAULT_RTOL",
    "OutputComparison",
    "compare_outputs",
    "cosine_similarity",
    "equal_share",
    "max_abs_error",
    "rel_l2_error",
    "top1_agreement",
]

#: Default relative L2 tolerance of a converted model's outputs, by target (the rel-l2
#: row of :data:`mixprec.core.ops.TOLERANCES`).
DEFAULT_RTOL = TOLERANCES["rel-l2"][1]

_BF16 = np.dtype(ml_dtypes.bfloat16)


def _is_float_dtype(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype == _BF16


def _json_float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)


@dataclass(frozen=True)
class OutputComparison:
    """How one output of a converted model compares with the FP32 reference.

    Attributes:
        name: Output name.
        max_abs_error: ``max |out - ref|`` over positions where both are finite.
        rel_l2_error: ``||out - ref||_2 / max(||ref||_2, tiny)`` over the same positions.
        ref_abs_max: ``max |ref|`` over finite reference values.
        top1_agreement: Fraction of rows whose argmax over the last axis agrees, for
            outputs that look like class scores (float, rank 2 or 3, last dim in
            ``[2, 100000]``); ``None`` otherwise. Reported only; it does not affect
            ``passed``.
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
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = _json_float(value) if isinstance(value, float) else value
        return out


# --- the output checks: one home for validate, tune, the INT8 guard and batch ----------------


def rel_l2_error(ref: np.ndarray, out: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` in float64 over the reference's finite positions; inf
    when ``out`` is not finite where the reference is."""
    a = np.asarray(ref, dtype=np.float64).ravel()
    b = np.asarray(out).astype(np.float64).ravel()
    fin = np.isfinite(a)
    if np.any(fin & ~np.isfinite(b)):
        return math.inf
    diff = b[fin] - a[fin]
    return float(np.linalg.norm(diff)) / max(float(np.linalg.norm(a[fin])), 1e-30)


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


def equal_share(ref: np.ndarray, out: np.ndarray) -> float:
    """The share of equal elements (integer outputs: counts, indices, masks)."""
    same = np.asarray(ref) == np.asarray(out)
    return float(np.mean(same)) if same.size else 1.0


def _compare_one(
    name: str, ref: np.ndarray, out: np.ndarray, rtol: float, atol: float
) -> OutputComparison:
    if ref.dtype == object or out.dtype == object:
        return OutputComparison(name, 0.0, 0.0, 0.0, None, True, "not a tensor; not compared")
    ref_float = _is_float_dtype(ref.dtype)
    numeric = ref_float or ref.dtype.kind in "iub"
    a = ref.astype(np.float64) if numeric else ref
    finite_ref = a[np.isfinite(a)] if ref_float else a
    ref_abs_max = float(np.abs(finite_ref).max()) if numeric and finite_ref.size else 0.0
    if ref.shape != out.shape:
        note = f"shape {list(out.shape)} differs from the reference shape {list(ref.shape)}"
        return OutputComparison(name, math.inf, math.inf, ref_abs_max, None, False, note)
    if not ref_float or not _is_float_dtype(out.dtype):
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
    ref_norm = float(np.linalg.norm(a[mask])) if diff.size else 0.0
    rel = float(np.linalg.norm(diff)) / max(ref_norm, float(np.finfo(np.float64).tiny))
    top1: float | None = None
    if 2 <= a.ndim <= 3 and 2 <= a.shape[-1] <= 100_000 and a.size:
        top1 = top1_agreement(a, b)
    passed = (rel <= rtol or max_abs <= atol) and not bad
    return OutputComparison(name, max_abs, rel, ref_abs_max, top1, passed, "; ".join(notes))


def compare_outputs(
    ref: Mapping[str, np.ndarray],
    out: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float = 1e-3,
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

    Returns:
        One comparison per reference output, in ``ref`` order.
    """
    results: list[OutputComparison] = []
    for name, ref_value in ref.items():
        if name not in out:
            note = "missing from the converted model's outputs"
            results.append(OutputComparison(name, math.inf, math.inf, 0.0, None, False, note))
            continue
        results.append(_compare_one(name, np.asarray(ref_value), np.asarray(out[name]), rtol, atol))
    return results
