"""What :func:`mixprec.tune` holds a candidate model to: metrics, budgets, candidates.

Built-in metrics compare a candidate's outputs with the FP32 model's on the same samples:

* ``rel-l2``: the worst output's relative L2 error in its worst sample (lower is
  better; the budget is the largest accepted value);
* ``max-abs``: the largest absolute difference (lower is better);
* ``top1``: the lowest agreement of the argmax over the last axis, over the outputs
  that look like class scores (higher is better; the budget is the smallest accepted);
* ``cosine``: the lowest cosine similarity of an output's flattened values (higher is
  better).

A callable metric gets a :class:`~mixprec.checks.user_metric.Candidate` (its outputs on
the tuning data, and a way to run it on any other input, e.g. labelled data the caller
holds) and returns a score, higher is better (accuracy, BLEU, a negated loss). Its budget
is the accepted drop from the FP32 model's score: a number (absolute drop) or a string
``"N%"`` (relative drop).

The user's own score, as the INT8 guard takes it (``--metric MODULE:FUNCTION
--metric-budget S``, ``metric_budget=``): ``FUNCTION(fp32_outputs, outputs[, labels])``
gets one dict of outputs per sample and returns a number, higher is better; the budget is
its lowest accepted value. The guard and ``tune`` load it (:func:`~mixprec.core.callables.
load_callable`) and call it (:func:`~mixprec.checks.user_metric.call_user_metric`) the
same way; what a callable metric is given lives in :mod:`mixprec.checks.user_metric`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from mixprec.checks.user_metric import Candidate, Outputs, shape_miss
from mixprec.core.callables import load_callable
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import (
    cosine_similarity,
    max_abs_error,
    top1_agreement,
    worst_rel_l2,
)
from mixprec.core.ops import TOLERANCES
from mixprec.core.output_kinds import OutputKind, shape_class_axis

__all__ = [
    "BUILTIN_METRICS",
    "MISS",
    "Budget",
    "Metric",
    "resolve_metric",
    "score_budget",
]

logger = logging.getLogger(__name__)
#: name -> (higher is better, default budget by target or None).
BUILTIN_METRICS = TOLERANCES


def _pooled(ref: Sequence[Outputs], out: Sequence[Outputs]) -> dict[str, tuple[np.ndarray, ...]]:
    """Per output name: (reference, candidate) values of every sample, flattened (outputs
    of the same shapes: :func:`shape_miss` first)."""
    pooled: dict[str, tuple[np.ndarray, ...]] = {}
    for name in ref[0]:
        a = np.concatenate([np.asarray(r[name], np.float64).ravel() for r in ref])
        b = np.concatenate([np.asarray(o[name]).astype(np.float64).ravel() for o in out])
        pooled[name] = (a, b)
    return pooled


def rel_l2(ref: Sequence[Outputs], out: Sequence[Outputs]) -> float:
    """The worst output's rel L2 in its worst sample (:func:`worst_rel_l2`, as validate
    and the guard read it)."""
    return max(
        (worst_rel_l2([r[name] for r in ref], [o[name] for o in out]) for name in ref[0]),
        default=0.0,
    )


def max_abs(ref: Sequence[Outputs], out: Sequence[Outputs]) -> float:
    return max((max_abs_error(a, b) for a, b in _pooled(ref, out).values()), default=0.0)


def top1(
    ref: Sequence[Outputs], out: Sequence[Outputs], kinds: Mapping[str, OutputKind] | None = None
) -> float:
    """The lowest top-1 agreement over the class-score outputs: those the model's output
    ``kinds`` call class scores, on their class axis; without them, float outputs by
    :func:`~mixprec.core.output_kinds.shape_class_axis` (the one rule by shape)."""
    agreements = []
    for name in ref[0]:
        shape = np.shape(ref[0][name])
        axis = _class_axis(name, ref[0][name], kinds)
        if axis is None:
            continue
        per_sample = [
            (top1_agreement(r[name], o[name], axis), np.asarray(r[name]).size // shape[axis])
            for r, o in zip(ref, out, strict=True)
        ]
        rows = sum(n for _, n in per_sample)
        agreements.append(sum(v * n for v, n in per_sample) / max(rows, 1))
    if not agreements:
        raise MixprecError(
            "metric top1 needs an output of class scores (a Softmax/LogSoftmax output or "
            "plain logits, with a class axis of 2 or more; see mixprec.core.output_kinds)"
        )
    return min(agreements)


def _class_axis(name: str, value: np.ndarray, kinds: Mapping[str, OutputKind] | None) -> int | None:
    shape = np.shape(value)
    if kinds is not None and name in kinds:
        kind = kinds[name]
        fits = kind.check in ("top1", "scores") and -len(shape) <= kind.axis < len(shape)
        return kind.axis if fits and shape[kind.axis] >= 2 else None
    if np.asarray(value).dtype.kind != "f":
        return None
    return shape_class_axis(tuple(shape))


def cosine(ref: Sequence[Outputs], out: Sequence[Outputs]) -> float:
    return min((cosine_similarity(a, b) for a, b in _pooled(ref, out).values()), default=1.0)


Compare = Callable[[Sequence[Outputs], Sequence[Outputs]], float]


def _guarded(compare: Compare, miss: float) -> Compare:
    """``compare``, scoring ``miss`` (its worst value) when an output's shape differs."""

    def guarded(ref: Sequence[Outputs], out: Sequence[Outputs]) -> float:
        why = shape_miss(ref, out)
        if why is not None:
            logger.info("tune: %s: scored as a miss", why)
            return miss
        return compare(ref, out)

    guarded.__name__ = compare.__name__
    return guarded


#: Each built-in metric's worst value: what a candidate scores when its outputs cannot be
#: compared (an output changed shape) or ONNX Runtime refuses to run it (a length that
#: depends on values changed inside the graph). A callable metric's miss is -inf.
MISS: dict[str, float] = {"rel-l2": math.inf, "max-abs": math.inf, "top1": 0.0, "cosine": -1.0}

_FUNCTIONS: dict[str, Compare] = {
    name: _guarded(compare, MISS[name])
    for name, compare in (
        ("rel-l2", rel_l2), ("max-abs", max_abs), ("top1", top1), ("cosine", cosine)
    )
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Budget:
    """The accepted value of the metric: ``limit``, and which side of it passes.

    Attributes:
        limit: the bound the candidate's metric is held to.
        higher_is_better: True when the metric must be >= ``limit``, else <= ``limit``.
        text: how the budget was given, for reports.
    """

    limit: float
    higher_is_better: bool
    text: str

    def met(self, value: float) -> bool:
        if math.isnan(value):
            return False
        return value >= self.limit if self.higher_is_better else value <= self.limit


@dataclasses.dataclass(frozen=True)
class Metric:
    """A resolved metric: its name, direction and how to score a candidate."""

    name: str
    higher_is_better: bool
    compare: Callable[[Sequence[Outputs], Sequence[Outputs]], float] | None = None
    user: Callable[[Candidate], float] | None = None
    score: Callable[..., float] | None = None  # the user's own score (the guard's form)

    @property
    def builtin(self) -> bool:
        return self.compare is not None

    @property
    def miss(self) -> float:
        """The worst value (:data:`MISS`): a candidate that cannot be compared or run."""
        return MISS[self.name] if self.builtin else -math.inf


def resolve_metric(
    metric: str | Callable[..., float],
    metric_budget: float | None = None,
    kinds: Mapping[str, OutputKind] | None = None,
) -> Metric:
    """A built-in name, a callable taking a :class:`Candidate`, or, with ``metric_budget``,
    the user's own score (a callable or ``"MODULE:FUNCTION"`` / ``"FILE.py:FUNCTION"``,
    as the INT8 guard's ``--metric``). ``kinds``: the model's output kinds, which tell
    ``top1`` the class scores and their class axis."""
    if metric_budget is not None:
        if isinstance(metric, str) and metric in _FUNCTIONS:
            raise MixprecError(
                f"--metric-budget goes with your own metric (MODULE:FUNCTION); built-in "
                f"{metric} takes --budget"
            )
        score = load_callable(metric) if isinstance(metric, str) else metric
        if not callable(score):
            raise MixprecError(f"metric must be a callable or 'MODULE:FUNCTION', not {metric!r}")
        name = getattr(score, "__name__", type(score).__name__)
        return Metric(str(name), True, score=score)
    if isinstance(metric, str) and ":" in metric and metric not in _FUNCTIONS:
        raise MixprecError(f"--metric {metric!r} needs --metric-budget S (its lowest score)")
    if callable(metric):
        name = getattr(metric, "__name__", type(metric).__name__)
        return Metric(str(name), True, user=metric)
    if not isinstance(metric, str) or metric not in _FUNCTIONS:
        raise MixprecError(
            f"unknown metric {metric!r}; use one of {', '.join(_FUNCTIONS)}, a callable, or "
            "your own MODULE:FUNCTION with metric_budget (--metric-budget)"
        )
    if metric == "top1" and kinds is not None:

        def top1_on_class_axes(ref: Sequence[Outputs], out: Sequence[Outputs]) -> float:
            return top1(ref, out, kinds)

        compare = _guarded(top1_on_class_axes, MISS["top1"])
        return Metric(metric, True, compare=compare)
    return Metric(metric, BUILTIN_METRICS[metric][0], compare=_FUNCTIONS[metric])


def score_budget(metric: Metric, metric_budget: float) -> Budget:
    """The user's own score's budget: its lowest accepted value, as the guard holds it."""
    limit = _number(metric_budget, "metric_budget")
    return Budget(limit, True, f"{metric.name} >= {limit:g}")


def resolve_budget(
    metric: Metric, budget: float | str | None, target: str, reference_score: float | None
) -> Budget:
    """The budget as a bound on the metric.

    Built-in metrics take a number (default per target; ``max-abs`` has none). A callable
    takes the accepted drop from ``reference_score`` (the FP32 model's score): a number,
    or ``"N%"`` of the FP32 score.
    """
    if metric.builtin:
        if budget is None:
            default = BUILTIN_METRICS[metric.name][1].get(target)
            if default is None:
                raise MixprecError(f"metric {metric.name} needs a budget (--budget X)")
            budget = default
        value = _number(budget, "budget")
        if metric.name in ("top1", "cosine") and not -1.0 <= value <= 1.0:
            raise MixprecError(f"budget for {metric.name} must lie in [-1, 1], got {value}")
        if not metric.higher_is_better and value < 0:
            raise MixprecError(f"budget for {metric.name} must be >= 0, got {value}")
        side = ">=" if metric.higher_is_better else "<="
        return Budget(value, metric.higher_is_better, f"{metric.name} {side} {value:g}")
    if reference_score is None:
        raise MixprecError("a callable metric needs the FP32 score first")  # internal order
    if budget is None:
        raise MixprecError(
            "a callable metric needs a budget: the accepted drop from the FP32 score, "
            "a number (absolute) or a string such as '1%' (relative)"
        )
    if isinstance(budget, str) and budget.strip().endswith("%"):
        share = _number(budget.strip()[:-1], "budget") / 100.0
        drop = abs(reference_score) * share
        text = f"{metric.name} >= FP32 score {reference_score:.6g} - {budget.strip()}"
    else:
        drop = _number(budget, "budget")
        text = f"{metric.name} >= FP32 score {reference_score:.6g} - {drop:g}"
    if drop < 0:
        raise MixprecError(f"budget (an accepted drop) must be >= 0, got {budget!r}")
    # a metric built to read as a bound of its own says so (the INT8 guard's checks)
    text = getattr(metric.user or metric.score, "budget_text", text)
    return Budget(reference_score - drop, True, text)


def _number(value: object, what: str) -> float:
    if isinstance(value, bool):
        raise MixprecError(f"{what} must be a number, not {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise MixprecError(f"{what} must be a number, not {value!r}") from None
    if not math.isfinite(number):
        raise MixprecError(f"{what} must be finite, got {value!r}")
    return number
