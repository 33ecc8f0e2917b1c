"""Range observers, pt2e-style: one small object per tensor, fed batch by batch.

Every observer takes raw arrays (:meth:`~MinMaxObserver.update`), merges with another
observer of its kind (:meth:`~MinMaxObserver.merge`) and reports
:class:`TensorStats`. :class:`AbsMaxObserver` and :class:`MinMaxObserver` also take
reductions computed elsewhere (:meth:`~MinMaxObserver.update_range`, the in-graph
``ReduceMin``/``ReduceMax`` probes); :class:`HistogramObserver` needs the data, whole
or as a sample with the exact range and tail (:meth:`~HistogramObserver.update_sample`).
Memory is fixed per tensor, whatever the number of samples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mixprec.core.errors import MixprecError
from mixprec.core.ops import is_float_dtype

__all__ = [
    "DEFAULT_BINS",
    "OBSERVERS",
    "AbsMaxObserver",
    "ChannelObserver",
    "HistogramObserver",
    "MinMaxObserver",
    "Observer",
    "TensorStats",
    "absmax_of",
    "channel_range",
    "chunks_of",
    "is_float_array",
    "make_observer",
]

#: Bins of a :class:`HistogramObserver` unless told otherwise.
DEFAULT_BINS = 2048


def is_float_array(array: Any) -> bool:
    """Whether ``array`` holds floating-point values (bfloat16 included)."""
    return is_float_dtype(np.asarray(array).dtype)


@dataclass(frozen=True)
class TensorStats:
    """Statistics of one tensor over all calibration samples.

    Attributes:
        absmax: ``max |x|`` over non-NaN values; ``inf`` when the tensor held an inf.
        min: Smallest non-NaN value, or None (absmax observer, or no element seen).
        max: Largest non-NaN value, or None.
        histogram: Counts of finite ``|x|`` in equal bins over ``[0, hist_upper]``, or
            None (histogram observer only); float64, estimated from samples where the
            tensors were sampled (:meth:`HistogramObserver.update_sample`).
        hist_upper: Upper edge of the histogram's range.
        channel_axis: For weights of rank >= 2: the output-channel axis of
            ``channel_min``/``channel_max``, else None.
        channel_min: Per output channel minimum (weights only).
        channel_max: Per output channel maximum (weights only).
    """

    absmax: float
    min: float | None = None
    max: float | None = None
    histogram: np.ndarray | None = None
    hist_upper: float = 0.0
    channel_axis: int | None = None
    channel_min: np.ndarray | None = None
    channel_max: np.ndarray | None = None


def _finite_abs(array: np.ndarray, finite: bool = False) -> np.ndarray:
    """``|array|`` as float32 without its non-finite values (``finite``: known to hold none)."""
    a = np.abs(np.asarray(array, np.float32))
    return a if finite else a[np.isfinite(a)]


def _non_nan(array: np.ndarray) -> np.ndarray:
    a = np.asarray(array)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    return a[~np.isnan(a)] if np.isnan(a).any() else a


class Observer:
    """Base of the observers: the interface the calibration loop uses."""

    #: True when the observer needs the tensors themselves (no in-graph reduction).
    needs_data: ClassVar[bool] = False

    def update(self, array: np.ndarray) -> None:
        """Folds one batch (one sample's tensor) into the statistics."""
        raise NotImplementedError

    def update_range(self, lo: float, hi: float) -> None:
        """Folds one batch given only its min and max (NaN-free or NaN)."""
        raise NotImplementedError

    def stats(self) -> TensorStats:
        """The statistics so far."""
        raise NotImplementedError


class AbsMaxObserver(Observer):
    """Running ``max |x|``: the max over samples of each sample's ``max |x|``."""

    def __init__(self) -> None:
        self.absmax = 0.0

    def update(self, array: np.ndarray) -> None:
        a = _non_nan(array)
        if a.size:
            self.update_range(float(a.min()), float(a.max()))

    def update_range(self, lo: float, hi: float) -> None:
        self.absmax = max(self.absmax, abs(lo), abs(hi))

    def stats(self) -> TensorStats:
        return TensorStats(self.absmax)


class MinMaxObserver(Observer):
    """Running min and max (NaN ignored, infs kept)."""

    def __init__(self) -> None:
        self.min: float | None = None
        self.max: float | None = None

    def update(self, array: np.ndarray) -> None:
        a = _non_nan(array)
        if a.size:
            self.update_range(float(a.min()), float(a.max()))

    def update_range(self, lo: float, hi: float) -> None:
        self.min = lo if self.min is None else min(self.min, lo)
        self.max = hi if self.max is None else max(self.max, hi)

    def _absmax(self) -> float:
        if self.min is None or self.max is None:
            return 0.0
        return max(abs(self.min), abs(self.max))

    def stats(self) -> TensorStats:
        return TensorStats(self._absmax(), self.min, self.max)


class HistogramObserver(MinMaxObserver):
    """Min/max plus a histogram of finite ``|x|`` with a fixed number of bins.

    The range ``[0, upper]`` starts at the first batch's ``max |x|`` and doubles as
    often as a later batch needs; doubling merges pairs of adjacent bins exactly, so
    counts are never re-interpolated and memory stays ``bins`` counters. A batch comes
    whole (:meth:`update`) or as a sample (:meth:`update_sample`), whose counts are
    weighted to stand for the whole batch (counts are floats).
    """

    needs_data = True

    def __init__(self, bins: int = DEFAULT_BINS) -> None:
        super().__init__()
        if bins < 2 or bins % 2:
            raise MixprecError(f"histogram bins must be an even number >= 2, got {bins}")
        self.bins = bins
        self.counts = np.zeros(bins, dtype=np.float64)
        self.upper = 0.0

    def update_range(self, lo: float, hi: float) -> None:
        raise TypeError("HistogramObserver needs the tensors (update), not only their range")

    def _grow(self, needed: float) -> None:
        if self.upper == 0.0:
            self.upper = needed if needed > 0 else 1.0
            return
        while self.upper < needed:
            self.counts = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.concatenate([self.counts, np.zeros(self.bins // 2)])
            self.upper *= 2.0

    def update(self, array: np.ndarray) -> None:
        a = _non_nan(array)
        if a.size:
            super().update_range(float(a.min()), float(a.max()))
        magnitude = np.abs(a[np.isfinite(a)]) if a.size else a
        if not magnitude.size:
            return
        self._grow(float(magnitude.max()))
        self._count(magnitude)

    def _count(self, magnitude: np.ndarray, weight: float = 1.0) -> None:
        """Adds ``weight`` per value of ``magnitude`` (finite, in ``[0, upper]``) to its
        bin (the top edge to the last bin, as ``np.histogram`` counts; 8x faster)."""
        scale = self.bins / self.upper  # float64 where float32 would overflow (tiny ranges)
        factor = np.float32(scale) if scale < 1e30 else np.float64(scale)
        index = (magnitude * factor).astype(np.intp)
        np.minimum(index, self.bins - 1, out=index)
        counts = np.bincount(index, minlength=self.bins)
        self.counts += counts * weight if weight != 1.0 else counts

    def update_sample(
        self, lo: float, hi: float, count: int, sample: np.ndarray, top: np.ndarray
    ) -> None:
        """Folds one NaN-free batch of ``count`` values known by its exact ``lo`` and
        ``hi``, a uniform ``sample`` of its values and its exact largest ``|x|`` (``top``).

        ``top`` is counted exactly; the sample's values up to the smallest of ``top``
        stand for the other ``count - len(top)`` values, each weighing as many. The tail
        (which the percentile and the clipping error read) is exact, the body estimated.
        """
        super().update_range(lo, hi)
        ends = [abs(v) for v in (lo, hi) if math.isfinite(v)]
        magnitude, tail = _finite_abs(sample, len(ends) == 2), _finite_abs(top, len(ends) == 2)
        peak = max([*ends, *(float(a.max()) for a in (magnitude, tail) if a.size)], default=0.0)
        if not (magnitude.size or tail.size):
            return
        self._grow(peak)
        body = magnitude[magnitude <= tail.min()] if tail.size else magnitude
        self._count(tail)
        if body.size and count > len(top):
            self._count(body, (count - len(top)) / body.size)

    def stats(self) -> TensorStats:
        return TensorStats(self._absmax(), self.min, self.max, self.counts.copy(), self.upper)


#: Observer classes by the name ``calibrate(observer=...)`` takes.
OBSERVERS: dict[str, type[Observer]] = {
    "absmax": AbsMaxObserver,
    "minmax": MinMaxObserver,
    "histogram": HistogramObserver,
}


class ChannelObserver:
    """Per-channel ``max |x|`` of one tensor over samples and, when ``rows`` > 0, up to
    ``rows`` rows of each sample (last axis: channels; SmoothQuant reads both).

    Args:
        axis: The channel axis of :meth:`update`'s arrays, or None (no absmax from data).
        rows: Rows kept per sample, drawn without replacement by a generator seeded
            with the sample's index (0: none).
    """

    def __init__(self, axis: int | None, rows: int = 0) -> None:
        self.axis = axis
        self.rows = rows
        self.absmax: np.ndarray | None = None
        self.kept: list[np.ndarray] = []

    def update(self, array: np.ndarray) -> None:
        """One sample's whole tensor: its channel absmax (when ``axis``) and rows."""
        if np.ndim(array) == 0:
            return
        if self.axis is not None:
            axis = self.axis % np.ndim(array)
            others = tuple(i for i in range(np.ndim(array)) if i != axis)
            self.update_absmax(np.max(np.abs(array), axis=others))
        self.update_rows(array)

    def update_absmax(self, absmax: np.ndarray) -> None:
        """One sample's per-channel ``max |x|`` (reduced elsewhere: the probes)."""
        absmax = np.asarray(absmax, np.float32).reshape(-1)
        if self.absmax is None:
            self.absmax = absmax
        elif self.absmax.shape == absmax.shape:  # else not a per-channel quantity
            self.absmax = np.fmax(self.absmax, absmax)

    def update_rows(self, array: np.ndarray) -> None:
        """Keeps up to ``rows`` rows of one sample's whole tensor."""
        if self.rows <= 0 or np.ndim(array) == 0:
            return
        flat = np.asarray(array, np.float32).reshape(-1, np.shape(array)[-1])
        if self.kept and self.kept[0].shape[1] != flat.shape[1]:
            return
        if len(flat) > self.rows:
            rng = np.random.default_rng(len(self.kept))
            flat = flat[np.sort(rng.choice(len(flat), self.rows, replace=False))]
        self.kept.append(flat.copy())

    def kept_rows(self) -> np.ndarray | None:
        """The kept rows, ``[rows, channels]``, or None."""
        return np.concatenate(self.kept) if self.kept else None


def make_observer(kind: str, bins: int = DEFAULT_BINS) -> Observer:
    """A new observer of kind ``"absmax"``, ``"minmax"`` or ``"histogram"``.

    Raises:
        MixprecError: An unknown kind, or a bad number of bins.
    """
    if kind not in OBSERVERS:
        raise MixprecError(f"unknown observer {kind!r}; use {', '.join(OBSERVERS)}")
    if kind == "histogram":
        return HistogramObserver(bins)
    return OBSERVERS[kind]()


def channel_range(array: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel min and max of a weight along ``axis`` (NaN ignored).

    Reduces in place over the other axes: no copy of the weight is made, so a large
    memory-mapped weight costs only its pages.
    """
    a = np.asarray(array)
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    axis %= a.ndim
    if a.size == 0:
        zeros = np.zeros(a.shape[axis], np.float32)
        return zeros, zeros
    others = tuple(i for i in range(a.ndim) if i != axis)
    # fmin/fmax skip NaN unless a whole channel is NaN (then NaN, as nanmin gives).
    lo = np.fmin.reduce(a, axis=others) if others else a.copy()
    hi = np.fmax.reduce(a, axis=others) if others else a.copy()
    return lo.astype(np.float32), hi.astype(np.float32)


#: Elements per chunk when a large constant is scanned (64 MB of float32).
CHUNK_ELEMENTS = 1 << 24


def chunks_of(array: np.ndarray) -> Iterator[np.ndarray]:
    """``array`` flattened, in views of at most :data:`CHUNK_ELEMENTS` (no copy when it is
    contiguous): scanning a large weight then never allocates a full-size temporary."""
    flat = np.asarray(array).reshape(-1)
    for start in range(0, flat.size, CHUNK_ELEMENTS):
        yield flat[start : start + CHUNK_ELEMENTS]


def absmax_of(array: np.ndarray) -> float:
    """``max |x|`` of a constant (0 when empty; NaN when it holds NaN), in chunks."""
    peak = 0.0
    for chunk in chunks_of(array):
        if chunk.size:
            lo, hi = float(chunk.min()), float(chunk.max())
            if math.isnan(lo) or math.isnan(hi):
                return math.nan
            peak = max(peak, abs(lo), abs(hi))
    return peak
