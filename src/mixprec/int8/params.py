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
    "entropy_fallback",
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
    note: str = ""  # how the range was chosen, when not as the method says (a fallback)

    @property
    def dtype(self) -> np.dtype:
        return self.zero_point.dtype

    def describe(self) -> str:
        if self.scale.ndim == 0:
            text = f"scale {float(self.scale):.4g} zp {int(self.zero_point)} ({self.dtype})"
            return f"{text}; {self.note}" if self.note else text
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
    bins = len(hist)
    edges = np.arange(max(1, bins // 64), bins + 1)
    t, cost = _squared_errors(stats, edges, levels)
    return float(t[int(np.argmin(cost))])


def _squared_errors(
    stats: TensorStats, edges: np.ndarray, levels: int = 255
) -> tuple[np.ndarray, np.ndarray]:
    """The clips at the histogram's bin ``edges`` and, for each, the expected squared
    quantization error over the calibrated |x| (rounding noise inside, distance to the
    clip outside: :func:`mse_threshold`'s cost)."""
    assert stats.histogram is not None
    counts = stats.histogram.astype(np.float64)
    bins = len(counts)
    width = stats.hist_upper / bins
    centers = (np.arange(bins) + 0.5) * width
    # Tail sums from bin i on: S0 = count, S1 = sum c, S2 = sum c^2 (for the clipped cost).
    s0 = np.cumsum(counts[::-1])[::-1]
    s1 = np.cumsum((counts * centers)[::-1])[::-1]
    s2 = np.cumsum((counts * centers**2)[::-1])[::-1]
    t = edges * width
    span = 2.0 if stats.min is not None and stats.min < 0 else 1.0
    step = span * t / levels
    inside = np.cumsum(counts)[edges - 1]
    tail = np.append(s0, 0.0)[edges], np.append(s1, 0.0)[edges], np.append(s2, 0.0)[edges]
    clipped = tail[2] - 2.0 * t * tail[1] + t**2 * tail[0]
    return t, inside * step**2 / 12.0 + clipped


#: The entropy search's first candidate: the clip at this many bins (of 2048).
_ENTROPY_FIRST_BIN = 128


def entropy_threshold(
    stats: TensorStats, levels: int | None = None, *, unsigned: bool = True
) -> float | None:
    """The |x| threshold minimising the KL divergence between the calibrated |x|
    distribution and its quantization (TensorRT's method).

    Values beyond a candidate threshold are folded into its last bin; the candidate
    distribution is merged into as many groups as the tensor's INT8 grid has steps over
    ``[0, threshold]`` and expanded back over the non-zero bins. That count is ``levels``
    when given; else 127 (symmetric int8), 255 for a uint8 tensor that never goes
    negative (a ReLU's output spends all 256 levels on ``[0, t]``: counting 128 there
    chose clips twice too low), and in between for a uint8 tensor of both signs. The
    first bin (exact zeros: half of a ReLU's output) stays out of the groups: zero is on
    the grid, and smearing that spike over its group made the divergence prefer the
    lowest clips (a ReLU net's outputs went from rel L2 0.01 under min/max to 0.41).
    Returns None without a histogram.
    """
    hist = stats.histogram
    if hist is None or not hist.any():
        return None
    hist = hist.astype(np.float64)
    bins = len(hist)
    first = min(_ENTROPY_FIRST_BIN, bins)
    best_kl, best_i = math.inf, bins
    # Candidate thresholds: every 16th bin edge from the first on (2048 bins: ~120 tries).
    for i in range(first, bins + 1, max(1, (bins - first) // 120)):
        t = i * stats.hist_upper / bins
        steps = levels if levels is not None else _grid_steps(stats, t, unsigned)
        kl = _clip_divergence(hist, i, steps)
        if kl < best_kl:
            best_kl, best_i = kl, i
    return best_i * stats.hist_upper / bins


def _grid_steps(stats: TensorStats, t: float, unsigned: bool) -> int:
    """The INT8 grid's steps over ``[0, t]`` for a clip at ``t``: 127 for symmetric int8;
    for uint8 over ``[max(min, -t), min(max, t)]``, 255 times the positive side's share."""
    if not unsigned:
        return 127
    low = min(-(stats.min or 0.0), t) if (stats.min or 0.0) < 0 else 0.0
    return max(1, round(255 * t / (t + low))) if t > 0 else 255


def _clip_divergence(hist: np.ndarray, i: int, levels: int) -> float:
    """KL(reference || candidate) of the clip at ``i`` bins quantized to ``levels`` steps.

    The reference keeps the clipped mass in its last bin; the candidate merges the
    unclipped bins 1.. into ``levels`` groups and spreads each group's mass evenly over
    the reference's non-zero bins; bin 0 (zero, on the grid) is the same in both."""
    p = hist[:i].copy()
    p[i - 1] += hist[i:].sum()
    body, mass = p[1:], hist[1:i]
    nonzero = body > 0
    n = len(body)
    if n <= levels:  # every bin its own level: only the clipping counts
        q = mass.copy()
    else:
        edges = np.linspace(0, n, levels + 1).astype(int)
        group = np.searchsorted(edges[1:], np.arange(n), side="right")
        sums = np.bincount(group, weights=mass, minlength=levels)
        counts = np.bincount(group, weights=nonzero.astype(np.float64), minlength=levels)
        q = np.where(nonzero, sums[group] / np.maximum(counts[group], 1.0), 0.0)
    p, q = np.concatenate([p[:1], body]), np.concatenate([p[:1], q])
    return _kl(_smooth(p / p.sum()), _smooth(q / q.sum()) if q.sum() > 0 else None)


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
    uint8; signed: symmetric int8 with zero point 0. An entropy clip that costs more
    expected squared error than the full range (:func:`entropy_fallback`) is not used:
    min/max instead, with the reason in ``QParams.note``.
    """
    if method not in METHODS:
        raise MixprecError(f"unknown calibration method {method!r}; use {', '.join(METHODS)}")
    lo, hi = stats.min, stats.max
    if lo is None or hi is None:
        return "no calibrated range"
    note = ""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        # an infinite value has infinite squared error: mse, like minmax, keeps it float
        clipped = None if method in ("minmax", "mse") else _threshold(stats, method, unsigned)
        if clipped is None:
            return f"calibrated range [{lo:.3g}, {hi:.3g}] is not finite"
        lo, hi = max(lo, -clipped), min(hi, clipped)
    elif method != "minmax":
        threshold = _threshold(stats, method, unsigned)
        note = entropy_fallback(stats, threshold) if method == "entropy" else ""
        if threshold is not None and threshold > 0 and not note:
            lo, hi = max(lo, -threshold), min(hi, threshold)
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if unsigned:
        scale = (hi - lo) / 255.0
        if scale <= 0:
            return QParams(np.array(1.0, np.float32), np.array(0, np.uint8))
        zp = int(np.clip(round(-lo / scale), 0, 255))
        return QParams(np.array(scale, np.float32), np.array(zp, np.uint8), note=note)
    bound = max(-lo, hi)
    scale = bound / 127.0 if bound > 0 else 1.0
    return QParams(np.array(scale, np.float32), np.array(0, np.int8), note=note)


def entropy_fallback(stats: TensorStats, threshold: float | None) -> str:
    """Why the entropy clip at ``threshold`` is not used for this tensor ("" when it is):
    its expected squared quantization error over the calibrated |x| (rounding inside,
    clipping outside: :func:`mse_threshold`'s cost) exceeds the full range's. The KL
    divergence weighs values by how often they occur, not by how far they lie: on
    spiky or heavy-tailed histograms (SE-scaled features, flat image backgrounds) its clip
    can cut values that carry much of the tensor's energy (PP-OCR cls: one such clip
    alone took the output's rel L2 from 0.15 to 0.19)."""
    hist = stats.histogram
    if threshold is None or hist is None or not hist.any() or not math.isfinite(stats.absmax):
        return ""
    bins = len(hist)
    width = stats.hist_upper / bins
    at = min(bins, max(1, round(threshold / width)))
    full = min(bins, max(1, math.ceil(stats.absmax / width)))
    _, cost = _squared_errors(stats, np.array([at, full]))
    if at >= full or cost[0] <= cost[1]:
        return ""
    ratio = cost[0] / cost[1] if cost[1] > 0 else math.inf
    return (
        f"entropy clip at {threshold:.3g} (of max |x| {stats.absmax:.3g}) costs {ratio:.3g}x "
        "the squared error of the full range: min/max used"
    )


def _threshold(stats: TensorStats, method: str, unsigned: bool = True) -> float | None:
    if method == "mse":
        return mse_threshold(stats)
    if method == "entropy":
        return entropy_threshold(stats, unsigned=unsigned)
    return percentile_threshold(stats)


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
    limit = np.iinfo(np.int32).max
    if np.any(np.abs(q) > limit):
        return "bias does not fit int32 at the input and weight scales"
    axis = 0 if scale.ndim else None
    zeros = np.zeros(scale.shape, np.int32)
    return q.astype(np.int32), QParams(scale, zeros, axis)
