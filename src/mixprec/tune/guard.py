"""The INT8 accuracy guard's measure: which check each output gets, the held-out samples,
and one score the checks and the tuner share.

:func:`mixprec.quantize` holds out samples it never calibrates on (or takes
``eval_data``), runs the INT8 model and the user's FP32 model on them in ONNX Runtime,
and holds each output to the check its kind calls for:

* class scores (a float output that a Softmax/LogSoftmax produces, through shape-only
  ops): top-1 agreement over **the Softmax's own axis** (kind ``"top1@AXIS"``; a
  segmentation ``Softmax(axis=1)`` is read across channels), at least ``1 - drop``
  (default 0.99); an axis of size 1 is never a class axis (rel L2 instead);
* other float outputs: relative L2 on the worst held-out sample (as :func:`validate`
  reports), at most ``rel_l2`` (default 0.1);
* integer outputs (an ArgMax, a length): the share of equal elements, at least
  ``1 - drop`` (default 0.99).

The defaults are the int8 rows of :data:`mixprec.core.ops.TOLERANCES`. An output whose
shape changed (a value-dependent length) is a miss, never an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np
import onnx_ir as ir

from mixprec.core.metrics import equal_share, rel_l2_error, top1_agreement
from mixprec.core.ops import tolerance
from mixprec.tune.metrics import Candidate, shape_miss

__all__ = [
    "GUARD_MIN_SAMPLES",
    "GuardBudget",
    "OutputCheck",
    "UserMetric",
    "check_outputs",
    "guard_metric",
    "guard_score",
    "output_kinds",
    "search_and_grade",
    "split_samples",
    "user_check",
]

Outputs = Mapping[str, np.ndarray]
_T = TypeVar("_T")
#: Samples are held out of the calibration only when there are at least this many.
GUARD_MIN_SAMPLES = 5
#: The share held out (at least one sample).
HELD_OUT_SHARE = 0.2
_SHAPE_ONLY = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity"})
_LABELS = {"top1": "top-1", "rel-l2": "rel L2", "match": "equal elements", "metric": "score"}


@dataclass(frozen=True)
class UserMetric:
    """The user's own measure of the INT8 model (``--metric MODULE:FUNCTION``,
    ``quantize(metric=callable)``): ``score(fp32_outputs, int8_outputs)`` gets one dict of
    outputs by name per held-out sample, in order, and returns a number, higher is
    better; the guard passes when it is at least ``budget``. It replaces the per-output
    checks, in the guard and in the repair's search alike."""

    score: Callable[[Sequence[Outputs], Sequence[Outputs]], float]
    budget: float
    name: str = "metric"


def user_check(
    metric: UserMetric, reference: Sequence[Outputs], outputs: Sequence[Outputs]
) -> OutputCheck:
    """The user's metric as the guard's one check (a failing metric is a miss, with why)."""
    try:
        value = float(metric.score(list(reference), list(outputs)))
        best = float(metric.score(list(reference), list(reference)))
    except Exception as e:  # the user's code: its failure is a measured miss
        return OutputCheck(metric.name, "metric", math.nan, metric.budget, False, repr(e))
    ok = math.isfinite(value) and value >= metric.budget
    return OutputCheck(metric.name, "metric", value, metric.budget, ok, best=best)


@dataclass(frozen=True)
class GuardBudget:
    """The bounds the INT8 model's outputs are held to."""

    top1: float
    rel_l2: float

    @classmethod
    def of(cls, drop: float | None, rel_l2: float | None) -> GuardBudget:
        """Top-1 agreement >= 1 - ``drop`` and rel L2 <= ``rel_l2``; None: the int8
        defaults of :data:`~mixprec.core.ops.TOLERANCES`."""
        top1, rel = tolerance("top1", "int8"), tolerance("rel-l2", "int8")
        assert top1 is not None and rel is not None
        return cls(top1 if drop is None else 1.0 - drop, rel if rel_l2 is None else rel_l2)

    def limit(self, kind: str) -> float:
        return self.rel_l2 if kind == "rel-l2" else self.top1


@dataclass(frozen=True)
class OutputCheck:
    """One output held to its check."""

    output: str
    kind: str
    value: float
    limit: float
    passed: bool
    note: str = ""
    best: float = 1.0  # the user's metric: the FP32 model's own score (slack 1 there)

    def needs(self) -> str:
        """``top-1 >= 0.99 on 'probs'`` (the user's metric: ``score >= 0.9 of 'f1'``)."""
        side = "<=" if self.kind == "rel-l2" else ">="
        of = "of" if self.kind == "metric" else "on"
        return f"{_LABELS[self.kind]} {side} {self.limit:g} {of} {self.output!r}"

    def text(self) -> str:
        miss = f"a miss ({self.note or 'non-finite values'})"
        got = f"{self.value:.3g}" if math.isfinite(self.value) else miss
        return f"{got}, needs {self.needs()}"

    def slack(self) -> float:
        """1 for an exact match, 0 at the limit, negative past it."""
        if self.note:
            return -math.inf
        if self.kind == "rel-l2":
            return 1.0 - self.value / self.limit if self.limit > 0 else -math.inf
        if self.kind == "metric":  # any scale: 1 at the FP32 model's score, 0 at the budget
            span = self.best - self.limit
            if span <= 0:
                return 0.0 if self.passed else -1.0
            return (self.value - self.limit) / span
        span = 1.0 - self.limit
        return (self.value - self.limit) / span if span > 0 else (0.0 if self.passed else -1.0)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def output_kinds(model: ir.Model) -> dict[str, str]:
    """Each graph output's check: "top1" (class scores on the last axis), "top1@AXIS" (on
    a Softmax's own axis), "rel-l2" or "match"."""
    kinds = {}
    for value in model.graph.outputs:
        dtype = value.dtype
        if dtype is not None and not dtype.is_floating_point():
            kinds[value.name or ""] = "match"
            continue
        axis = _softmax_axis(value)
        kinds[value.name or ""] = "rel-l2" if axis is None else _top1_kind(value, axis)
    return kinds


def _top1_kind(value: ir.Value, axis: int) -> str:
    """``top1`` on ``axis`` of ``value``, or rel-l2 when that axis has size 1."""
    shape = value.shape
    if shape is None or not len(shape):
        return "top1" if axis == -1 else f"top1@{axis}"
    axis %= len(shape)
    dim = shape[axis]
    if isinstance(dim, int) and dim < 2:
        return "rel-l2"  # one class: its arg-max always agrees
    return "top1" if axis == len(shape) - 1 else f"top1@{axis}"


def _softmax_axis(value: ir.Value) -> int | None:
    """The axis of the Softmax/LogSoftmax that produces ``value`` through shape-only ops
    (None: not class scores). Through a reshape the axis is the last one, as before."""
    node = value.producer()
    reshaped = False
    while node is not None and node.op_type in _SHAPE_ONLY and node.inputs:
        reshaped = True
        first = node.inputs[0]
        node = first.producer() if first is not None else None
    if node is None or node.op_type not in ("Softmax", "LogSoftmax"):
        return None
    attr = node.attributes.get("axis")
    axis = attr.as_int() if attr is not None else -1
    return -1 if reshaped else axis


def _split_kind(kind: str) -> tuple[str, int]:
    base, _, axis = kind.partition("@")
    return base, int(axis) if axis else -1


def split_samples(samples: list[_T], seed: int = 0) -> tuple[list[_T], list[_T], bool]:
    """``(calibrate, held_out, in_sample)``: a seeded random :data:`HELD_OUT_SHARE` held
    out (at least one) when there are :data:`GUARD_MIN_SAMPLES` or more, each list in
    the samples' order; otherwise every sample both calibrates and checks (``in_sample``
    True). Random, not the last fifth: ordered data (a sorted folder, one class after
    another) would bias the check."""
    if len(samples) < GUARD_MIN_SAMPLES:
        return samples, samples, True
    count = max(1, round(len(samples) * HELD_OUT_SHARE))
    chosen = set(np.random.default_rng(seed).choice(len(samples), count, replace=False).tolist())
    held = [s for k, s in enumerate(samples) if k in chosen]
    return [s for k, s in enumerate(samples) if k not in chosen], held, False


def search_and_grade(held: list[_T]) -> tuple[list[_T], list[_T]]:
    """The held-out samples the repair searches on and those it is graded on: the first
    half and the rest (one sample: both), so that a repair fitted to its samples is not
    also judged on them (MiniLM passed at 0.099 on its search samples and measured 0.105
    on other inputs)."""
    if len(held) < 2:
        return held, held
    half = (len(held) + 1) // 2
    return held[:half], held[half:]


def check_outputs(
    reference: Sequence[Outputs],
    outputs: Sequence[Outputs],
    kinds: Mapping[str, str],
    budget: GuardBudget,
    metric: UserMetric | None = None,
) -> list[OutputCheck]:
    """Every output of ``outputs`` against the FP32 ``reference``, sample by sample; the
    user's ``metric`` instead, when given."""
    if metric is not None:
        return [user_check(metric, reference, outputs)]
    miss = shape_miss(reference, outputs)
    checks = []
    for name, spelled in kinds.items():
        kind, axis = _split_kind(spelled)
        limit = budget.limit(kind)
        if miss is not None:
            checks.append(OutputCheck(name, kind, math.nan, limit, False, miss))
            continue
        ref, got = [r[name] for r in reference], [o[name] for o in outputs]
        value = _measure(kind, ref, got, axis)
        ok = value <= limit if kind == "rel-l2" else value >= limit
        checks.append(OutputCheck(name, kind, value, limit, bool(ok and not math.isnan(value))))
    return checks


def _measure(kind: str, ref: list[np.ndarray], got: list[np.ndarray], axis: int = -1) -> float:
    """The check's value over the samples (core.metrics holds each measure)."""
    pairs = list(zip(ref, got, strict=True))
    if kind == "match":
        sizes = [max(np.asarray(r).size, 1) for r, _ in pairs]
        shares = [equal_share(r, g) for r, g in pairs]
        return sum(v * n for v, n in zip(shares, sizes, strict=True)) / max(sum(sizes), 1)
    if kind == "top1":
        rows = [max(np.asarray(r).size // max(np.shape(r)[axis], 1), 1) for r, _ in pairs]
        shares = [top1_agreement(r, g, axis) for r, g in pairs]
        return sum(v * n for v, n in zip(shares, rows, strict=True)) / max(sum(rows), 1)
    # the worst sample, as validate() reports: a few held-out samples pooled into one
    # norm let one bad sample hide behind good ones (MiniLM passed at 0.0985 pooled over
    # 3 samples and measured 0.105 on other inputs)
    return max((rel_l2_error(r, g) for r, g in pairs), default=0.0)


def guard_score(checks: Sequence[OutputCheck]) -> float:
    """The least slack over the checks: >= 0 when every check passes (1: exact)."""
    return min((c.slack() for c in checks), default=1.0)


def guard_metric(
    reference: Sequence[Outputs],
    kinds: Mapping[str, str],
    budget: GuardBudget,
    metric: UserMetric | None = None,
) -> Callable[[Candidate], float]:
    """The guard as a tuner metric (higher is better; the FP32 model scores 1, so an
    accepted drop of 1 means "every check passes")."""

    def guard(candidate: Candidate) -> float:
        return guard_score(check_outputs(reference, candidate.outputs, kinds, budget, metric))

    return guard
