"""Shared test helpers: one numeric comparison, an ONNX Runtime runner, text models.

Import them from test modules as ``from helpers import assert_close, make_model, run_ort``
(pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.checker
import onnx.parser
import pytest

from mixprec.core.ops import DEFAULT_ATOL
from mixprec.core.ops import TOLERANCES as OPS_TOLERANCES

__all__ = ["TOLERANCES", "assert_close", "make_model", "run_ort", "sha256_of", "strict_json"]

#: (max relative L2 error, max absolute error accepted where the reference is near zero):
#: the package's own table for the low dtypes (:data:`mixprec.core.ops.TOLERANCES`, its
#: rel-l2 row, and :data:`~mixprec.core.ops.DEFAULT_ATOL`), so that a test holds a result
#: to what validate holds it to; float32 (two FP32 runs: another engine, a rewrite that
#: must be exact up to summation order) is the tests' own.
TOLERANCES: dict[str, tuple[float, float]] = {
    **{dtype: (rtol, DEFAULT_ATOL) for dtype, rtol in OPS_TOLERANCES["rel-l2"][1].items()},
    "float32": (1e-5, 1e-5),
}
_ALIASES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "float": "float32"}


def _tolerance(dtype: str) -> tuple[str, float, float]:
    key = _ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if key not in TOLERANCES:
        raise ValueError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}")
    rtol, atol = TOLERANCES[key]
    return key, rtol, atol


def assert_close(ref: np.ndarray, out: np.ndarray, dtype: str, *, name: str = "output") -> None:
    """Assert that ``out`` matches the FP32 reference ``ref`` within ``dtype``'s tolerance.

    Computed in float64 over the positions where the reference is finite. Passes when the
    relative L2 error is within the dtype's bound, or the max abs error is (outputs whose
    reference is near zero, where relative error means nothing). A non-finite value where
    the reference is finite, or a shape mismatch, always fails.

    Tolerances: float16 rel L2 1e-2 / abs 1e-3; bfloat16 8e-2 / 1e-2; float32 1e-5 / 1e-5.

    Raises:
        AssertionError: listing the 5 worst positions (index, ref, out, abs diff), the max
            abs error and the relative L2 error.
    """
    key, rtol, atol = _tolerance(dtype)
    a = np.asarray(ref)
    b = np.asarray(out)
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {b.shape} differs from the reference {a.shape}")
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    ref_finite = np.isfinite(a)
    bad = ref_finite & ~np.isfinite(b)
    compared = ref_finite & ~bad
    diff = np.zeros(a.shape)
    diff[compared] = np.abs(b[compared] - a[compared])
    diff[bad] = np.inf
    max_abs = float(diff.max()) if diff.size else 0.0
    ref_norm = float(np.linalg.norm(a[compared]))
    err_norm = float(np.linalg.norm(diff[compared]))
    rel = err_norm / max(ref_norm, float(np.finfo(np.float64).tiny))
    if bad.any():
        rel = float("inf")
    if rel <= rtol or max_abs <= atol:
        return
    flat = diff.ravel()
    worst = [i for i in np.argsort(flat, kind="stable")[::-1][:5] if flat[i] > 0]
    lines = [
        f"{name}: {key} mismatch: max abs error {max_abs:.4g} (atol {atol:g}), "
        f"rel L2 {rel:.4g} (rtol {rtol:g}), {int(bad.sum())} non-finite where ref is finite, "
        f"ref max |x| {float(np.abs(a[ref_finite]).max(initial=0.0)):.4g}; worst positions:"
    ]
    for i in worst:
        index = tuple(int(x) for x in np.unravel_index(int(i), a.shape))
        lines.append(
            f"  {index}: ref {a.ravel()[i]:.6g}, out {b.ravel()[i]:.6g}, abs diff {flat[i]:.4g}"
        )
    raise AssertionError("\n".join(lines))


def run_ort(
    model_or_path: onnx.ModelProto | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    optimize: bool = False,
) -> dict[str, np.ndarray]:
    """Run a model once on ONNX Runtime's CPU provider; outputs by name.

    Graph optimizations are off unless ``optimize``: the graph runs as written, so
    fusions cannot hide (or cause) differences.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    source = (
        model_or_path.SerializeToString()
        if isinstance(model_or_path, onnx.ModelProto)
        else os.fspath(model_or_path)
    )
    session = ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    values = session.run(names, {k: np.asarray(v) for k, v in feeds.items() if k in wanted})
    return dict(zip(names, values, strict=True))


def make_model(text: str) -> onnx.ModelProto:
    """Parse an ONNX text model (``onnx.parser`` syntax) and check it."""
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def sha256_of(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def strict_json(text: str) -> object:
    """``json.loads`` as a strict parser reads: ``Infinity``, ``-Infinity`` or ``NaN`` in
    ``text`` fails the test (what mixprec writes for users is strict JSON)."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON: {text}"))
