"""INT8 quantization parameters: activation ranges from calibration statistics (MinMax,
Entropy, Percentile) and weight/bias quantization. Numbers only, no graph."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mixprec.calibrate.observers import TensorStats
from mixprec.core.errors import MixprecError

__all__ = [
    "METHODS",
    "QParams",
    "activation_qparams",
    "entropy_threshold",
    "mse_threshold",
    "percentile_threshold",
    "quantize_bias",
    "quantize_weight",
]

METHODS = ("minmax", "entropy", "percentile", "mse")


@dataclass(frozen=True)
class QParams:
    """Scale and zero point of one tensor (per tensor, or per channel along ``axis``)."""

    scale: np.ndarray  # float32, shape () or (channels,)
    zero_point: np.ndarray  # uint8 / int8 / int32, same shape
    axis: int | None = None

    @property
    def dtype(self) -> np.dtype:
        return self.zero_point.dtype

    def describe(self) -> str:
        if self.scale.ndim == 0:
            return f"scale {float(self.scale):.4g} zp {int(self.zero_point)} ({self.dtype})"
        return (
            f"per-channel (axis {self.axis}) scale {float(self.scale.min()):.3g}.."
            f"{float(self.scale.max()):.3g} ({self.dtype})"
        )


def percentile_threshold(stats: TensorStats, percentile: float = 99.999) -> float | None:
    """The |x| below which ``percentile`` % of the calibrated values fall."""
    if stats.histogram is None or not stats.histogram.any():
        return None
    cumulative = np.cumsum(stats.histogram)
    k = int(np.searchsorted(cumulative, cumulative[-1] * percentile / 100.0))
    return (k + 1) * stats.hist_upper / len(stats.histogram)


def mse_threshold(stats: TensorStats, levels: int = 255) -> float | None:
    """The |x| clip that minimises the expected squared quantization error over the
    calibrated |x| histogram (a per-tensor MinMSE search, as TensorRT's and AMD Quark's).

    For a clip ``t`` the step is ``t / levels`` (``2t / levels`` when the tensor takes
    both signs); values under ``t`` cost the rounding noise ``step**2 / 12`` each, values
    over it their distance to ``t`` squared. Every bin edge from 1/64 of the range up is
    a candidate. Returns None without a histogram.
    """
    hist = stats.histogram
    if hist is None or not hist.any():
        return None
    counts = hist.astype(np.float64)
    bins = len(counts)
    width = stats.hist_upper / bins
    centers = (np.arange(bins) + 0.5) * width
    # Tail sums from bin i on: S0 = count, S1 = sum c, S2 = sum c^2 (for the clipped cost).
    s0 = np.cumsum(counts[::-1])[::-1]
    s1 = np.cumsum((counts * centers)[::-1])[::-1]
    s2 = np.cumsum((counts * centers**2)[::-1])[::-1]
    first = max(1, bins // 64)
    edges = np.arange(first, bins + 1)
    t = edges * width
    span = 2.0 if stats.min is not None and stats.min < 0 else 1.0
    step = span * t / levels
    inside = np.cumsum(counts)[edges - 1]
    tail = np.append(s0, 0.0)[edges], np.append(s1, 0.0)[edges], np.append(s2, 0.0)[edges]
    clipped = tail[2] - 2.0 * t * tail[1] + t**2 * tail[0]
    cost = inside * step**2 / 12.0 + clipped
    return float(t[int(np.argmin(cost))])


def entropy_threshold(stats: TensorStats, levels: int = 128) -> float | None:
    """The |x| threshold minimising the KL divergence between the calibrated |x|
    distribution and its quantization to ``levels`` levels (TensorRT's method).

    Values beyond a candidate threshold are folded into its last bin; the candidate
    distribution is merged into ``levels`` groups and expanded back over the non-zero
    bins. Returns None without a histogram.
    """
    hist = stats.histogram
    if hist is None or not hist.any():
        return None
    hist = hist.astype(np.float64)
    bins = len(hist)
    if bins <= levels:
        return stats.hist_upper
    best_kl, best_i = math.inf, bins
    # Candidate thresholds: every 16th bin edge from `levels` on (2048 bins: ~120 tries).
    for i in range(levels, bins + 1, max(1, (bins - levels) // 120)):
        p = hist[:i].copy()
        p[i - 1] += hist[i:].sum()  # the reference keeps the clipped mass in its last bin
        nonzero = p > 0
        # The candidate quantizes the unclipped bins into `levels` groups and spreads each
        # group's mass evenly over the reference's non-zero bins.
        edges = np.linspace(0, i, levels + 1).astype(int)
        group = np.searchsorted(edges[1:], np.arange(i), side="right")
        sums = np.bincount(group, weights=hist[:i], minlength=levels)
        counts = np.bincount(group, weights=nonzero.astype(np.float64), minlength=levels)
        q = np.where(nonzero, sums[group] / np.maximum(counts[group], 1.0), 0.0)
        kl = _kl(_smooth(p / p.sum()), _smooth(q / q.sum()) if q.sum() > 0 else None)
        if kl < best_kl:
            best_kl, best_i = kl, i
    return best_i * stats.hist_upper / bins


def _smooth(dist: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Give every empty bin ``eps`` of mass and renormalize, so that the divergence stays
    finite where one distribution is empty and the other is not."""
    zeros = dist == 0
    if not zeros.any() or zeros.all():
        return dist
    smoothed = dist + eps * zeros
    return smoothed / smoothed.sum()


def _kl(p: np.ndarray, q: np.ndarray | None) -> float:
    if q is None or np.any(q < 0) or np.any(p < 0):
        return math.inf
    mask = p > 0
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def activation_qparams(stats: TensorStats, method: str, unsigned: bool) -> QParams | str:
    """Per-tensor qparams of an activation, or the reason it cannot be quantized sanely.

    The range always holds 0 (so zero padding and ReLU stay exact). Unsigned: asymmetric
    uint8; signed: symmetric int8 with zero point 0.
    """
    if method not in METHODS:
        raise MixprecError(f"unknown calibration method {method!r}; use {', '.join(METHODS)}")
    lo, hi = stats.min, stats.max
    if lo is None or hi is None:
        return "no calibrated range"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # an infinite value has infinite squared error: mse, like minmax, keeps it float
        clipped = None if method in ("minmax", "mse") else _threshold(stats, method)
        if clipped is None:
            return f"calibrated range [{lo:.3g}, {hi:.3g}] is not finite"
        lo, hi = max(lo, -clipped), min(hi, clipped)
    elif method != "minmax":
        threshold = _threshold(stats, method)
        if threshold is not None and threshold > 0:
            lo, hi = max(lo, -threshold), min(hi, threshold)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if unsigned:
        scale = (hi - lo) / 255.0
        if scale <= 0:
            return QParams(np.array(1.0, np.float32), np.array(0, np.uint8))
        zp = int(np.clip(round(-lo / scale), 0, 255))
        return QParams(np.array(scale, np.float32), np.array(zp, np.uint8))
    bound = max(-lo, hi)
    scale = bound / 127.0 if bound > 0 else 1.0
    return QParams(np.array(scale, np.float32), np.array(0, np.int8))


def _threshold(stats: TensorStats, method: str) -> float | None:
    if method == "mse":
        return mse_threshold(stats)
    return entropy_threshold(stats) if method == "entropy" else percentile_threshold(stats)


def quantize_weight(
    array: np.ndarray, axis: int | None, *, qmax: int = 127
) -> tuple[np.ndarray, QParams] | str:
    """Symmetric int8 weights, per channel along ``axis`` (or per tensor), or a reason.

    ``qmax=63`` is the reduced range that avoids u8 x s8 saturation in AVX2 kernels
    without VNNI (VPMADDUBSW adds pairs of products into int16).
    """
    w = np.asarray(array, dtype=np.float32)
    if not np.all(np.isfinite(w)):
        return "weight holds NaN or inf"
    if axis is None:
        bound = float(np.max(np.abs(w))) if w.size else 0.0
        scale = np.array(bound / qmax if bound > 0 else 1.0, np.float32)
        q = np.clip(np.round(w / scale), -qmax, qmax).astype(np.int8)
        return q, QParams(scale, np.array(0, np.int8))
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    bounds = np.max(np.abs(moved), axis=1) if moved.size else np.zeros(w.shape[axis])
    scale = np.where(bounds > 0, bounds / qmax, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.round(w / scale.reshape(shape)), -qmax, qmax).astype(np.int8)
    return q, QParams(scale, np.zeros(len(scale), np.int8), axis)


def quantize_bias(
    bias: np.ndarray, input_scale: float, weight: QParams
) -> tuple[np.ndarray, QParams] | str:
    """int32 bias with scale ``input_scale * weight_scale`` (what ORT's QLinearConv takes)."""
    b = np.asarray(bias, dtype=np.float64)
    scale = (input_scale * weight.scale.astype(np.float64)).astype(np.float32)
    if not np.all(np.isfinite(b)):
        return "bias holds NaN or inf"
    q = np.round(b / scale.astype(np.float64))
    limit = 2**31 - 1
    if np.any(np.abs(q) > limit):
        return "bias does not fit int32 at the input and weight scales"
    axis = 0 if scale.ndim else None
    zeros = np.zeros(scale.shape, np.int32)
    return q.astype(np.int32), QParams(scale, zeros, axis)
