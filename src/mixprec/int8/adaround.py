"""AdaRound (Nagel et al., 2020) for one layer: the numbers, no graph.

Round-to-nearest minimises each weight's own error, not the layer's output error. With
the scale fixed (as :func:`~mixprec.int8.params.quantize_weight` sets it), AdaRound
chooses for every weight between ``floor(w / s)`` and that plus one so that the output
on real inputs changes least: ``min ||X Wᵀ - X_q W~ᵀ||²`` over captured input rows ``X``
(:mod:`mixprec.calibrate.capture`; ``X_q``, the rows as the INT8 layer reads them, is
``X`` unless given).

The relaxation: ``W~ = s * (floor(W / s) + h(V))`` with the rectified sigmoid ``h``, a
regulariser ``reg * mean(1 - |2h - 1|^beta)`` that pushes ``h`` to 0 or 1 while ``beta``
anneals from 20 to 2 after a 20% warm-up, and Adam on ``V``. The loss is quadratic in
``W~``, so it is computed from the Gram matrix ``X_qᵀ X_q`` (or from the rows, when they
are fewer than half the width): a step costs ``O * D * min(D, 2n)`` multiply-adds.

A quarter of the rows is held out: per output channel, the learned codes are kept only
where they give a smaller output error on those rows than round-to-nearest, and the
errors reported are the held-out ones. A layer with fewer than
:data:`MIN_ROWS_PER_WEIGHT` fitting rows per weight of an output channel (a Conv after a
global pool sees one row per sample) keeps nearest: its fit would be noise. Each code
differs from nearest by at most 1 and stays in ``[-qmax, qmax]``. Torch runs the loop
when importable (the ``[torch]`` extra), numpy otherwise: the same arithmetic, with the
gradients written out.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from mixprec.core.config import check_choice
from mixprec.core.errors import MixprecError
from mixprec.core.held_out import held_out_draw

__all__ = [
    "BACKENDS",
    "MIN_ROWS_PER_WEIGHT",
    "ROUNDING",
    "LearnedCodes",
    "RoundingBudget",
    "RoundingFit",
    "backend_name",
    "learn_rounding",
]

BACKENDS = ("auto", "torch", "numpy")
#: ``node.meta`` key of a layer's :class:`LearnedCodes` (set by
#: :class:`~mixprec.int8.rounding.LearnedRoundingPass`, read by the QDQ apply).
ROUNDING = "mixprec.rounding"
_ZETA, _GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch
_BETA = (20.0, 2.0)
_WARMUP = 0.2
#: The share of a layer's rows held out to check the fit (the guard's one seeded draw).
_HOLD_OUT_SHARE = 0.25
#: Fewest fitting rows per weight of one output channel. With fewer, the up/down choices
#: fit the rows, not the layer: on PP-OCR cls, squeeze-excite convolutions (one row per
#: image, 96 rows for 32-88 weights) lowered their held-out error and raised the model's.
MIN_ROWS_PER_WEIGHT = 4


@dataclass(frozen=True)
class LearnedCodes:
    """A weight's learned int8 codes (in the weight's layout) and the scale they go with."""

    codes: np.ndarray
    scale: np.ndarray

    def fits(self, data: np.ndarray, scale: np.ndarray) -> bool:
        """Whether these codes replace ``data`` quantized at ``scale`` (the same grid)."""
        return self.codes.shape == data.shape and np.array_equal(self.scale, scale)


@dataclass(frozen=True)
class RoundingBudget:
    """How much optimisation each layer gets.

    Attributes:
        iterations: Adam steps per layer (fewer on wide layers, see ``macs``).
        macs: most multiply-adds of one layer's steps together; a layer whose step costs
            more gets fewer steps, and keeps nearest below ``min_iterations``.
        min_iterations: the fewest steps worth taking.
        lr: Adam's step size on ``V``.
        reg: the regulariser's weight against the output error (scaled so that
            round-to-nearest scores 1).
        threads: torch's intra-op threads while it runs (restored after).
    """

    iterations: int = 300
    macs: float = 3e10
    min_iterations: int = 100
    lr: float = 0.03
    reg: float = 0.2
    threads: int = 1


@dataclass(frozen=True)
class RoundingFit:
    """One layer's learned rounding.

    Attributes:
        codes: the integer codes, ``[groups, out, width]`` like the weight given.
        nearest: round-to-nearest's output error on the held-out rows (squared error
            summed over output channels, averaged over rows); NaN without rows.
        learned: the same for ``codes`` (never above ``nearest``).
        energy: the held-out rows' mean squared FP32 output (for relative errors).
        changed: how many codes differ from round-to-nearest.
        iterations: Adam steps taken (0: nearest kept, see ``why``).
        why: why the layer kept nearest without learning ("" when it learned).
    """

    codes: np.ndarray
    nearest: float
    learned: float
    energy: float
    changed: int
    iterations: int
    why: str = ""


def backend_name(backend: str) -> str:
    """The backend that runs: "torch" when asked or ("auto") importable, else "numpy"."""
    check_choice("rounding backend", backend, BACKENDS)
    if backend == "auto":
        return "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    if backend == "torch" and importlib.util.find_spec("torch") is None:
        raise MixprecError("rounding backend 'torch' needs PyTorch: pip install 'mixprec[torch]'")
    return backend


class _Ops:
    """The few array operations the loop needs beyond arithmetic, on numpy or torch."""

    def __init__(self, name: str) -> None:
        self.torch: ModuleType | None = None
        if name == "torch":
            import torch

            self.torch = torch

    def array(self, a: np.ndarray) -> Any:
        a = np.array(a, dtype=np.float32)  # a private, writable copy
        return self.torch.from_numpy(a) if self.torch is not None else a

    def numpy(self, a: Any) -> np.ndarray:
        return a.numpy() if self.torch is not None else np.asarray(a)

    def sigmoid(self, a: Any) -> Any:
        if self.torch is not None:
            return self.torch.sigmoid(a)
        return 0.5 * (1.0 + np.tanh(0.5 * a))

    def clip(self, a: Any, lo: float, hi: float) -> Any:
        return a.clamp(lo, hi) if self.torch is not None else np.clip(a, lo, hi)

    def sign(self, a: Any) -> Any:
        return self.torch.sign(a) if self.torch is not None else np.sign(a)

    def sqrt(self, a: Any) -> Any:
        return self.torch.sqrt(a) if self.torch is not None else np.sqrt(a)

    @contextlib.contextmanager
    def threads(self, count: int) -> Iterator[None]:
        if self.torch is None:
            yield
            return
        before = self.torch.get_num_threads()
        self.torch.set_num_threads(max(1, count))
        try:
            yield
        finally:
            self.torch.set_num_threads(before)


class _Quadratic:
    """The output error on some rows as a function of the weight error ``E = W~ - W``, per
    group: ``c0 - 2 <C, E> + <E H, E>`` with ``H = Bᵀ B`` (dense, or as the rows ``B``)."""

    def __init__(self, ops: _Ops, weight: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
        n = max(1, a.shape[1])
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        wt = weight.astype(np.float64).transpose(0, 2, 1)
        diff = (a64 - b64) @ wt  # the input's own rounding error through W: [G, n, O]
        self.c0 = float((diff**2).sum()) / n
        self.energy = float(((a64 @ wt) ** 2).sum()) / n
        self.cross = ops.array((diff.transpose(0, 2, 1) @ b64) / n)  # [G, O, D]
        self.dense = b.shape[2] <= 2 * b.shape[1]
        self.inner = b.shape[2] if self.dense else 2 * b.shape[1]
        if self.dense:
            self.h = ops.array((b64.transpose(0, 2, 1) @ b64) / n)  # [G, D, D]
        else:
            rows = b64 / math.sqrt(n)
            self.b = ops.array(rows)
            self.bt = ops.array(rows.transpose(0, 2, 1))

    def times_h(self, e: Any) -> Any:
        return e @ self.h if self.dense else (e @ self.bt) @ self.b

    def weights_alone(self, e: Any) -> float:
        """The output error ``<E H, E>`` that the weight error alone causes."""
        found = (self.times_h(e) * e).sum()
        return float(found.item() if hasattr(found, "item") else found)

    def per_channel(self, e: Any) -> np.ndarray:
        """Each output channel's error ``[G, O]``, less the constant ``c0``."""
        found = (self.times_h(e) * e).sum(-1) - 2.0 * (self.cross * e).sum(-1)
        return np.asarray(found.numpy() if hasattr(found, "numpy") else found, np.float64)


def _initial_v(rest: np.ndarray) -> np.ndarray:
    """``V`` with ``h(V) = rest``: the soft weights start at the FP32 weights."""
    p = np.clip((rest - _GAMMA) / (_ZETA - _GAMMA), 1e-4, 1 - 1e-4)
    return np.log(p / (1.0 - p)).astype(np.float32)


def _optimise(
    ops: _Ops, quad: _Quadratic, start: tuple[np.ndarray, ...], steps: int, budget: RoundingBudget
) -> np.ndarray:
    """Adam on ``V`` from ``start = (scale, rest, movable)``; the final soft ``h`` in
    [0, 1]. The output error is scaled so that the error round-to-nearest's weights alone
    cause scores 1, whatever the input's own error (the constant ``c0``)."""
    scale, rest, movable = (ops.array(a) for a in start[:3])
    unit = 1.0 / max(quad.weights_alone(scale * (((rest >= 0.5) * movable) - rest)), 1e-30)
    v = ops.array(_initial_v(start[1]))
    m, s2 = v * 0, v * 0
    count = float(v.numel() if ops.torch is not None else v.size)
    warm = int(_WARMUP * steps)
    b1, b2 = 0.9, 0.999
    for t in range(steps):
        sig = ops.sigmoid(v)
        h = ops.clip(sig * (_ZETA - _GAMMA) + _GAMMA, 0.0, 1.0) * movable
        # gradients of the loss per weight (times count): Adam's eps stays negligible
        grad = (2.0 * unit * count) * (quad.times_h(scale * (h - rest)) - quad.cross) * scale
        if t >= warm:
            beta = _BETA[0] + (_BETA[1] - _BETA[0]) * (t - warm) / max(1, steps - warm)
            u = 2.0 * h - 1.0
            grad = grad - (2.0 * budget.reg * beta) * abs(u) ** (beta - 1.0) * ops.sign(u)
        grad = grad * (sig * (1.0 - sig) * (_ZETA - _GAMMA)) * ((h > 0) * (h < 1) * movable)
        m = b1 * m + (1 - b1) * grad
        s2 = b2 * s2 + (1 - b2) * grad * grad
        rate = budget.lr * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))
        v = v - rate * m / (ops.sqrt(s2) + 1e-8)
    return ops.numpy(ops.clip(ops.sigmoid(v) * (_ZETA - _GAMMA) + _GAMMA, 0.0, 1.0) * movable)


def learn_rounding(
    weight: np.ndarray,
    scale: np.ndarray,
    rows: np.ndarray,
    quantized_rows: np.ndarray | None = None,
    *,
    qmax: int = 127,
    budget: RoundingBudget | None = None,
    backend: str = "auto",
) -> RoundingFit:
    """AdaRound codes for one layer (module docstring).

    Args:
        weight: ``[G, O, D]``: per group, the output channels' weights as rows (a Conv's
            ``W.reshape(group, O / group, -1)``, a Gemm's ``[N, K]`` as ``[1, N, K]``).
        scale: the weight scale, broadcastable to ``[G, O, 1]`` (per channel or one).
        rows: ``[G, n, D]``: per group, the captured FP32 input rows.
        quantized_rows: the same rows as the INT8 layer reads them (None: ``rows``).
        qmax: the code bound (127, or 63 for reduced range).
        budget: the optimisation budget (:class:`RoundingBudget`).
        backend: "auto", "torch" or "numpy".

    Returns:
        The :class:`RoundingFit` (round-to-nearest where learning cannot help).
    """
    budget = budget or RoundingBudget()
    ops = _Ops(backend_name(backend))
    w = np.asarray(weight, np.float32)
    s = np.broadcast_to(np.asarray(scale, np.float32), (w.shape[0], w.shape[1], 1))
    ratio = w / s
    floor = np.floor(ratio)
    nearest = np.clip(np.round(ratio), -qmax, qmax)
    movable = ((floor + 1 <= qmax) & (floor >= -qmax)).astype(np.float32)
    n = rows.shape[1]
    if n == 0:
        return RoundingFit(nearest.astype(np.int8), math.nan, math.nan, math.nan, 0, 0, "no rows")
    b_rows = rows if quantized_rows is None else quantized_rows
    held = np.zeros(n, dtype=bool)
    held[held_out_draw(n, _HOLD_OUT_SHARE, n)] = True
    with ops.threads(budget.threads):
        check = _Quadratic(ops, w, rows[:, held], b_rows[:, held])
        base = check.per_channel(ops.array(s * (nearest - ratio)))
        fit = _Quadratic(ops, w, rows[:, ~held], b_rows[:, ~held])
        steps = int(
            min(budget.iterations, budget.macs // (2.0 * w[..., 0].size * w.shape[2] * fit.inner))
        )
        why = _why_nearest(int((~held).sum()), w.shape[2], steps, budget)
        near = float(base.sum()) + check.c0
        if why:
            return RoundingFit(nearest.astype(np.int8), near, near, check.energy, 0, 0, why)
        start = (s, ratio - floor, movable)
        h = _optimise(ops, fit, start, steps, budget)
        codes = np.clip(floor + (h >= 0.5) * movable, -qmax, qmax)
        mine = check.per_channel(ops.array(s * (codes - ratio)))
    better = mine < base
    codes = np.where(better[..., None], codes, nearest)
    learned = float(np.where(better, mine, base).sum()) + check.c0
    changed = int((codes != nearest).sum())
    return RoundingFit(codes.astype(np.int8), near, learned, check.energy, changed, steps)


def _why_nearest(fitting: int, width: int, steps: int, budget: RoundingBudget) -> str:
    if fitting < MIN_ROWS_PER_WEIGHT * width:
        return f"{fitting} fitting rows for {width} weights per output channel"
    if steps < budget.min_iterations:
        return f"a step costs more than the budget allows {budget.min_iterations} of"
    return ""
