"""The INT8 accuracy guard's measure: which check each output gets, the held-out samples,
and one score the checks and the tuner share.

:func:`mixprec.quantize` holds out samples it never calibrates on (or takes
``eval_data``), runs the INT8 model and the user's FP32 model on them in ONNX Runtime,
and holds each output to the check its kind calls for
(:mod:`mixprec.core.output_kinds` says which, and why):

* class scores (a Softmax/LogSoftmax output, or plain logits: Gemm/MatMul, or a Conv
  before a global pool): top-1 agreement on **the class axis** (kind ``"top1@AXIS"``
  when it is not the last; a segmentation ``Softmax(axis=1)`` is read across channels),
  at least ``1 - drop`` (default 0.99); an axis of size 1 is never a class axis;
* embeddings (pooled encoder outputs, normalized vectors, outputs named like one): the
  mean cosine of each row (one embedding) to FP32's, over every held-out row, at least
  ``cosine`` (default 0.99: on MiniLM's sentence embeddings dynamic all-INT8 scores 0.994
  with the nearest neighbour of 32 held-out sentences unchanged for every one, while the
  static all-INT8 variants score 0.82-0.86 and change 3-12% of them);
* other float outputs: the relative L2 of each channel along the short feature axis
  (:mod:`mixprec.core.readings`), each over every held-out row, the worst channel at most
  ``rel_l2`` (default 0.1); one without such an axis (a scalar, a vector): the relative
  L2 of the worst held-out sample (as :func:`validate` reports);
* integer outputs (an ArgMax, a length): the share of equal elements, at least
  ``1 - drop`` (default 0.99).

The defaults are the int8 rows of :data:`mixprec.core.ops.TOLERANCES`. An output whose
shape changed (a value-dependent length) is a miss, never an error. The user's own
metric (:class:`UserMetric`) replaces the per-output checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

import numpy as np
import onnx_ir as ir

from mixprec.checks.confidence import CONFIDENCE, lower_bound, rows_to_confirm
from mixprec.checks.guard_samples import GUARD_MIN_SAMPLES
from mixprec.checks.user_metric import Candidate, Labels, call_user_metric, shape_miss
from mixprec.core.detections import detection_f1 as _detection_f1
from mixprec.core.detections import head_layout
from mixprec.core.metrics import (
    OutputComparison,
    active_top1,
    channel_rel_l2,
    channel_rows,
    decision_agreement,
    equal_share,
    neighbour_agreement,
    row_cosines,
    top1_agreement,
    worst_rel_l2,
)
from mixprec.core.ops import ROW_BUDGETS, tolerance
from mixprec.core.output_kinds import OutputKind, classify_outputs
from mixprec.core.readings import readings

__all__ = [
    "AGREEMENT_KINDS",
    "GUARD_MIN_SAMPLES",
    "GuardBudget",
    "OutputCheck",
    "UserMetric",
    "check_outputs",
    "closeness_checks",
    "guard_metric",
    "guard_score",
    "least_confirmed",
    "missed",
    "output_kinds",
    "reading_lines",
    "row_budget",
    "row_readings",
    "search_and_grade",
    "shown",
    "user_check",
]

Outputs = Mapping[str, np.ndarray]
Kinds = Mapping[str, OutputKind | str]
_T = TypeVar("_T")
#: The checks that count rows whose answer holds, whose share gets a confidence bound.
AGREEMENT_KINDS = frozenset(ROW_BUDGETS)
#: The checks whose value is an error (lower is better).
_ERRORS = frozenset({"rel-l2", "max-abs", "channels", "kl", "perplexity-rise"})
_LABELS = {
    "top1": "top-1",
    "top1-active": "top-1 of rows with a score >= 0.5",
    "rel-l2": "rel L2",
    "max-abs": "max abs error",  # tune's metric of that name
    "channels": "worst channel's rel L2",
    "cosine": "cosine",
    "row-cosine": "rows at the cosine bound",
    "neighbours": "nearest neighbours kept",
    "decision": "decisions at 0.5",
    "detection": "detections F1",
    "match": "equal elements",
    "metric": "score",
    # a language model's next-token checks (mixprec.repair.language_guard)
    "kl": "mean KL",
    "next-token": "next-token agreement",
    "perplexity-rise": "perplexity rise",
}
#: A language model's checks, measured over the check windows' tokens.
_NEXT_TOKEN = frozenset({"kl", "next-token", "perplexity-rise"})
#: The most rows the neighbour check compares (every k-th beyond: its cost is R^2).
_NEIGHBOUR_ROWS = 4096


@dataclass(frozen=True)
class UserMetric:
    """The user's own measure of the INT8 model (``--metric MODULE:FUNCTION``,
    ``quantize(metric=callable)``): ``score(fp32_outputs, int8_outputs[, labels])`` gets
    one dict of outputs by name per held-out sample, in order, and, when it takes a third
    argument, the samples' labels (:func:`~mixprec.checks.user_metric.call_user_metric`); it
    returns a number, higher is better; the guard passes when it is at least ``budget``.
    It replaces the per-output checks, in the guard and in the repair's search alike."""

    score: Callable[..., float]
    budget: float
    name: str = "metric"


def user_check(
    metric: UserMetric,
    reference: Sequence[Outputs],
    outputs: Sequence[Outputs],
    labels: Labels | None = None,
) -> OutputCheck:
    """The user's metric as the guard's one check (a failing metric is a miss, with why)."""
    try:
        value = call_user_metric(metric.score, reference, outputs, labels)
        best = call_user_metric(metric.score, reference, reference, labels)
    except Exception as e:  # the user's code: its failure is a measured miss
        return OutputCheck(metric.name, "metric", math.nan, metric.budget, False, repr(e))
    ok = math.isfinite(value) and value >= metric.budget
    return OutputCheck(metric.name, "metric", value, metric.budget, ok, best=best)


@dataclass(frozen=True)
class GuardBudget:
    """The bounds the INT8 model's outputs are held to: ``top1`` the least share of rows
    whose answer holds (argmax, equal elements, decisions, rows at the cosine bound),
    ``detection`` and ``neighbours`` their own least shares, ``rel_l2`` the most relative
    L2 (a channel's, or an output's), ``cosine`` the bound a row's cosine must reach;
    ``atol``: a channel whose max abs error is at most this counts no error (validate's
    near-zero rule; the INT8 guard: 0, none)."""

    top1: float
    rel_l2: float
    cosine: float = 0.99
    detection: float = ROW_BUDGETS["detection"][0]
    neighbours: float = ROW_BUDGETS["neighbours"][0]
    atol: float = 0.0

    @classmethod
    def of(
        cls, drop: float | None, rel_l2: float | None, cosine: float | None = None
    ) -> GuardBudget:
        """Shares of rows >= 1 - ``drop`` (every row check), rel L2 <= ``rel_l2`` and
        cosine >= ``cosine``; None: the int8 defaults of
        :data:`~mixprec.core.ops.TOLERANCES` and :data:`~mixprec.core.ops.ROW_BUDGETS`."""
        top1, rel = tolerance("top1", "int8"), tolerance("rel-l2", "int8")
        cos = tolerance("cosine", "int8")
        assert top1 is not None and rel is not None and cos is not None
        shares = {} if drop is None else {"detection": 1.0 - drop, "neighbours": 1.0 - drop}
        return cls(
            top1 if drop is None else 1.0 - drop,
            rel if rel_l2 is None else rel_l2,
            cos if cosine is None else cosine,
            **shares,
        )

    def limit(self, kind: str) -> float:
        if kind in _ERRORS:
            return self.rel_l2
        if kind == "cosine":
            return self.cosine
        return {"detection": self.detection, "neighbours": self.neighbours}.get(kind, self.top1)


def row_budget(target: str, rtol: float, atol: float) -> GuardBudget:
    """The bounds a ``target`` model (``"float16"``, ``"bfloat16"``, ``"int8"``; another:
    float16's, the strictest) is validated to: rows at the ``top1`` and ``cosine`` rows of
    :data:`~mixprec.core.ops.TOLERANCES` for it, the worst channel at ``rtol`` (a channel
    within ``atol`` counts none)."""
    dtype = target if tolerance("top1", target) is not None else "float16"
    top1, cosine = tolerance("top1", dtype), tolerance("cosine", dtype)
    assert top1 is not None and cosine is not None
    return GuardBudget(top1, rtol, cosine, atol=atol)


def shown(value: float, limit: float) -> str:
    """``value`` to 3 significant digits, or more where those would print the ``limit``
    it misses or meets only narrowly (0.9897 for a limit of 0.99, not 0.99)."""
    for digits in (3, 4, 5, 6, 8):
        text = f"{value:.{digits}g}"
        if value == limit or float(text) != limit:
            return text
    return repr(value)


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
    reason: str = ""  # why the output gets this check (its kind)
    rows: int = 0  # the held-out answers measured (rows, elements, embeddings, samples)
    #: agreement checks: the 95% lower confidence bound of ``value`` on ``rows``
    #: (:func:`~mixprec.checks.confidence.lower_bound`); None for the other kinds
    bound: float | None = None

    @property
    def confirmed(self) -> bool:
        """A pass the held-out rows support: its lower bound meets the limit too (a
        check without a bound: its pass as measured)."""
        return self.passed and (self.bound is None or self.bound >= self.limit)

    def to_confirm(self) -> str:
        """Why an unconfirmed pass is one, and the rows that would confirm it: ``412
        held-out rows cannot confirm top-1 >= 0.99 on 'probs' (95% lower bound 0.982):
        about 2,310 rows at this agreement would``."""
        assert self.bound is not None
        text = (
            f"{self.rows:,} held-out rows cannot confirm {self.needs()} ({CONFIDENCE:.0%} "
            f"lower bound {shown(self.bound, self.limit)})"
        )
        needed = rows_to_confirm(self.value, self.limit)
        if needed is None:
            return f"{text}: the agreement sits at the limit, so no number of rows would"
        return f"{text}: about {needed:,} rows at this agreement would"

    @property
    def side(self) -> str:
        """``"<="`` for an error (rel L2), ``">="`` for a share or a score."""
        return "<=" if self.kind in _ERRORS else ">="

    def needs(self) -> str:
        """``top-1 >= 0.99 on 'probs'`` (the user's metric: ``score >= 0.9 of 'f1'``)."""
        of = "of" if self.kind == "metric" else "on"
        return f"{_LABELS[self.kind]} {self.side} {self.limit:g} {of} {self.output!r}"

    def measured(self) -> str:
        """``top-1 0.98 over 412 rows (needs >= 0.99)``: what was measured, on what."""
        got = shown(self.value, self.limit) if math.isfinite(self.value) else "a miss"
        by_row = self.kind in AGREEMENT_KINDS or self.kind == "channels"
        unit = ("row" if self.rows == 1 else "rows") if by_row else "sample(s)"
        unit = "tokens" if self.kind in _NEXT_TOKEN else unit
        need = f"needs {self.side} {self.limit:g}"
        return f"{_LABELS[self.kind]} {got} over {self.rows:,} {unit} ({need})"

    def text(self) -> str:
        miss = f"a miss ({self.note or 'non-finite values'})"
        got = shown(self.value, self.limit) if math.isfinite(self.value) else miss
        return f"{got}, needs {self.needs()}"

    def slack(self) -> float:
        """1 for an exact match, 0 at the limit, negative past it."""
        if self.note:
            return -math.inf
        if self.kind in _ERRORS:
            return 1.0 - self.value / self.limit if self.limit > 0 else -math.inf
        if self.kind == "metric":  # any scale: 1 at the FP32 model's score, 0 at the budget
            span = self.best - self.limit
            if span <= 0:
                return 0.0 if self.passed else -1.0
            return (self.value - self.limit) / span
        span = 1.0 - self.limit
        return (self.value - self.limit) / span if span > 0 else (0.0 if self.passed else -1.0)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "confirmed": self.confirmed}


def least_confirmed(checks: Iterable[OutputCheck]) -> OutputCheck:
    """The check furthest from being confirmed: the lowest 95% lower bound (a check
    without one counts as 0). ``checks`` must not be empty."""
    return min(checks, key=lambda c: c.bound or 0.0)


def output_kinds(model: ir.Model) -> dict[str, OutputKind]:
    """Each graph output's kind and why (:func:`~mixprec.core.output_kinds.classify_outputs`):
    its check is ``kind.spec``: "top1" (class scores on the last axis), "top1@AXIS",
    "cosine", "rel-l2" or "match"."""
    return classify_outputs(model)


def _split_kind(kind: OutputKind | str) -> tuple[str, int, str]:
    """(check, axis, reason) of a kind, or of its spelling (``"top1@1"``)."""
    if isinstance(kind, OutputKind):
        return kind.check, kind.axis, kind.reason
    base, _, axis = kind.partition("@")
    return base, int(axis) if axis else -1, ""


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
    kinds: Kinds,
    budget: GuardBudget,
    metric: UserMetric | None = None,
    labels: Labels | None = None,
) -> list[OutputCheck]:
    """Every output of ``outputs`` against the FP32 ``reference``, sample by sample, by its
    kind (an :class:`~mixprec.core.output_kinds.OutputKind` or its spelling) read as rows
    (:func:`~mixprec.core.readings.readings`: one or more checks an output); the user's
    ``metric`` instead (given the samples' ``labels``), when given."""
    if metric is not None:
        return [user_check(metric, reference, outputs, labels)]
    miss = shape_miss(reference, outputs)
    if miss is not None:
        return missed(reference, kinds, budget, miss)
    checks = []
    for name, spelled in kinds.items():
        ref = [r[name] for r in reference]
        for read in readings(_as_kind(spelled), ref):
            kind, axis, why = read.check, read.axis, read.reason
            limit = budget.limit(kind)
            got = [o[name] for o in outputs]
            value, rows = _measure(kind, ref, got, axis, budget)
            ok = value <= limit if kind in _ERRORS else value >= limit
            passed = bool(ok and not math.isnan(value))
            bound = lower_bound(value, rows) if kind in AGREEMENT_KINDS else None
            checks.append(
                OutputCheck(name, kind, value, limit, passed, reason=why, rows=rows, bound=bound)
            )
    return checks


def closeness_checks(
    per_sample: Iterable[Sequence[OutputComparison]], rtol: float, atol: float
) -> list[OutputCheck]:
    """Each output's whole-tensor comparisons (validate's and the torch check's table, one
    per sample: :func:`~mixprec.core.metrics.compare_outputs`) as one ``rel-l2`` check:
    the worst sample's relative L2 against ``rtol``, over the samples. A sample whose max
    abs error is within ``atol`` passes (a reference near zero), and the reason says so;
    a failed comparison's note (a shape changed, values not finite) is the check's."""
    by_name: dict[str, list[OutputComparison]] = {}
    for comparisons in per_sample:
        for c in comparisons:
            by_name.setdefault(c.name, []).append(c)
    checks = []
    for name, found in by_name.items():
        worst = max(c.rel_l2_error if not math.isnan(c.rel_l2_error) else math.inf for c in found)
        passed = all(c.passed for c in found)
        note = "" if passed else next((c.note for c in found if not c.passed and c.note), "")
        reason = "the whole tensor's relative L2, its worst sample"
        near_zero = sum(c.passed and c.rel_l2_error > rtol for c in found)
        if near_zero:
            reason += f"; {near_zero} sample(s) within max abs {atol:g} (a reference near zero)"
        checks.append(
            OutputCheck(name, "rel-l2", worst, rtol, passed, note, reason=reason, rows=len(found))
        )
    return checks


def row_readings(
    reference: Sequence[Outputs], outputs: Sequence[Outputs], kinds: Kinds, budget: GuardBudget
) -> list[OutputCheck]:
    """The readings a comparison adds beside its whole-tensor rel L2 (validate, the check
    against eager torch): :func:`check_outputs` without its ``rel-l2`` readings, which the
    comparison already holds; none where an output's shape changed (the comparison's
    miss, not read again)."""
    pairs = zip(reference, outputs, strict=True)
    if any(np.shape(r[k]) != np.shape(o[k]) for r, o in pairs for k in r):
        return []
    return [c for c in check_outputs(reference, outputs, kinds, budget) if c.kind != "rel-l2"]


def missed(
    reference: Sequence[Outputs], kinds: Kinds, budget: GuardBudget, why: str
) -> list[OutputCheck]:
    """Every check of every output missed, for ``why`` (an output of another shape, a
    model the runtime refuses to run)."""
    return [
        OutputCheck(
            name, read.check, math.nan, budget.limit(read.check), False, why, reason=read.reason
        )
        for name, spelled in kinds.items()
        for read in readings(_as_kind(spelled), [r[name] for r in reference])
    ]


def _as_kind(kind: OutputKind | str) -> OutputKind:
    if isinstance(kind, OutputKind):
        return kind
    check, axis, why = _split_kind(kind)
    return OutputKind(check, axis, why)


def _measure(
    kind: str, ref: list[np.ndarray], got: list[np.ndarray], axis: int, budget: GuardBudget
) -> tuple[float, int]:
    """The check's value over the samples (core.metrics holds each measure) and the rows
    it was measured on: the answers (top-1, rows at the cosine bound, neighbours: a row
    each; equal elements and decisions: each element; detections: each one found; mean
    cosine: each embedding; rel L2: each sample)."""
    pairs = list(zip(ref, got, strict=True))
    if kind in ("match", "top1", "decision"):
        return _shares(kind, pairs, axis)
    if kind == "top1-active":
        found = [active_top1(r, g, axis) for r, g in pairs]
        rows = sum(n for _, n in found)
        return (sum(v * n for v, n in found) / rows if rows else 1.0), rows
    if kind == "detection":
        layout = head_layout(tuple(np.shape(ref[0])))
        return _detection_f1(ref, got, layout) if layout is not None else (math.nan, 0)
    if kind in ("cosine", "row-cosine"):
        cosines = np.concatenate([row_cosines(r, g, axis) for r, g in pairs] or [np.ones(1)])
        rows = len(cosines) if pairs else 0
        if kind == "cosine":  # the mean over every held-out row: one embedding each
            return float(np.mean(cosines)), rows
        return float(np.mean(cosines >= budget.cosine)), rows
    if kind == "neighbours":
        return _neighbours(pairs, axis)
    if kind == "channels":  # each channel over every held-out row, the worst channel
        if not pairs:
            return 0.0, 0
        ref_rows, got_rows = (channel_rows([p[i] for p in pairs], axis) for i in (0, 1))
        worst = float(np.max(channel_rel_l2(ref_rows, got_rows, 0, budget.atol)))
        return worst, ref_rows.shape[1]
    return worst_rel_l2(ref, got), len(pairs)  # the worst sample, as validate reports


def _shares(kind: str, pairs: list[tuple[np.ndarray, np.ndarray]], axis: int) -> tuple[float, int]:
    """A share of agreeing answers weighted by each sample's answers, and their count."""
    if kind == "top1":
        sizes = [max(np.asarray(r).size // max(np.shape(r)[axis], 1), 1) for r, _ in pairs]
        shares = [top1_agreement(r, g, axis) for r, g in pairs]
    else:
        sizes = [max(np.asarray(r).size, 1) for r, _ in pairs]
        measure = equal_share if kind == "match" else decision_agreement
        shares = [measure(r, g) for r, g in pairs]
    rows = sum(sizes)
    return sum(v * n for v, n in zip(shares, sizes, strict=True)) / max(rows, 1), rows


def _neighbours(pairs: list[tuple[np.ndarray, np.ndarray]], axis: int) -> tuple[float, int]:
    """Nearest-neighbour agreement over every held-out row (a vector along ``axis``), at
    most :data:`_NEIGHBOUR_ROWS` of them (every k-th)."""
    ref_rows = [np.moveaxis(np.asarray(r), axis, -1) for r, _ in pairs]
    got_rows = [np.moveaxis(np.asarray(g), axis, -1) for _, g in pairs]
    a = np.concatenate([r.reshape(-1, r.shape[-1]) for r in ref_rows]) if pairs else None
    b = np.concatenate([g.reshape(-1, g.shape[-1]) for g in got_rows]) if pairs else None
    if a is None or b is None or len(a) < 3:
        return 1.0, 0
    step = -(-len(a) // _NEIGHBOUR_ROWS)
    a, b = a[::step], b[::step]
    return neighbour_agreement(a, b), len(a)


def reading_lines(checks: Sequence[Mapping[str, object]]) -> list[str]:
    """How each output was read, from a report's checks (their dicts): ``read
    'output0': a detection head [N, 4+C, A], 80 classes: detections F1 vs FP32``, one
    line per output, its readings joined."""
    by_output: dict[str, list[str]] = {}
    for check in checks:
        reasons = by_output.setdefault(str(check.get("output", "")), [])
        reason = str(check.get("reason") or check.get("kind", ""))
        if reason and reason not in reasons:
            reasons.append(reason)
    return [f"read {name!r}: {'; '.join(why)}" for name, why in by_output.items() if why]


def guard_score(checks: Sequence[OutputCheck]) -> float:
    """The least slack over the checks: >= 0 when every check passes (1: exact)."""
    return min((c.slack() for c in checks), default=1.0)


def guard_metric(
    reference: Sequence[Outputs],
    kinds: Kinds,
    budget: GuardBudget,
    metric: UserMetric | None = None,
    labels: Labels | None = None,
) -> Callable[[Candidate], float]:
    """The guard as a tuner metric (higher is better; the FP32 model scores 1, so an
    accepted drop of 1 means "every check passes"); ``labels``: the samples' labels, for
    the user's ``metric``."""

    def guard(candidate: Candidate) -> float:
        outputs = candidate.outputs
        return guard_score(check_outputs(reference, outputs, kinds, budget, metric, labels))

    guard.budget_text = "every check of the accuracy guard"  # type: ignore[attr-defined]
    return guard
