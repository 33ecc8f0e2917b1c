"""The search of :func:`mixprec.tune`: which candidate nodes go back to float.

The steps (:mod:`mixprec.tune.run` drives them):

1. Prepare and calibrate once (:class:`~mixprec.pipeline.stages.Pipeline`), annotate with the
   default policy: the nodes it puts in low precision (INT8: the Conv/MatMul/Gemm it
   quantizes) are the N candidates.
2. Score the all-low model on every sample; if it meets the budget, that is the answer.
   Otherwise rank the candidates from one instrumented run (:mod:`mixprec.tune.sensitivity`).
   A candidate whose output changed shape, or that the runtime refuses to run (a length
   that depends on values changed inside the graph), scores the metric's worst value
   with the reason (``Step.note``): a miss, never an error.
3. Search over the ranked list: moving the first ``k`` back to float (the policy's node
   exclusions; only ``annotate`` and ``apply`` re-run on copies of the calibrated model).
   The all-low model (k = 0) is scored on every sample; if it misses the budget, ``k`` is
   bisected on the worst quarter of the samples (halving the MACs at stake, then the
   error energy at stake: :meth:`Search.next_subset_step`), the subset's answer is
   confirmed on the full set, and if that fails the bisection goes on, on the full set,
   above it (halving the node count, until the bracket holds < 1% of the MACs). At
   most ceil(log2 N) + 3 full-set evaluations; each evaluation is counted.
4. Give-back: the heaviest float nodes are handed back to low precision one at a time,
   each kept if the budget still holds (on the worst samples, confirmed on all); the
   refinements (this and the error-energy steps) stop at 6x an estimated plain
   conversion's time.
5. The passing model with the largest low-precision MAC share is finished (cleanup,
   check) and returned with the nodes kept float, their sensitivity, and the search path.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import CALIBRATION, MACS, SHAPES, CountMacsPass
from mixprec.checks.user_metric import Candidate, Labels, call_user_metric, shape_miss
from mixprec.core.graphs import iter_nodes
from mixprec.passes.emulate import emulate_low_precision
from mixprec.pipeline.stages import Stage
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError, Session
from mixprec.runtime.engines import engine_for
from mixprec.tune.metrics import Budget, Metric
from mixprec.tune.moves import Move, halving, midpoint, narrow, shares
from mixprec.tune.result import Step
from mixprec.tune.sensitivity import NodeSensitivity

__all__ = ["Search"]

logger = logging.getLogger(__name__)

#: Samples the instrumented run uses (errors are pooled over them).
SENSITIVITY_SAMPLES = 2
#: The bisection stops once the bracket's MACs differ by less than this share of the
#: model's MACs: nodes without MACs cost no MAC share, so finer steps gain nothing.
MAC_SHARE_RESOLUTION = 0.01
#: It first tries every node that costs no MACs, at once, when they hold at least this
#: share of the candidates' error energy.
FREE_ENERGY = 0.25
#: The give-back refinement (heavy float nodes handed back one at a time) stops once the
#: tuning has taken this many times an estimated plain conversion.
REFINE_TIME_FACTOR = 6.0
#: ... but they always get this many seconds.
REFINE_MIN_SECONDS = 5.0
#: Then, among nodes holding fewer MACs than that, it stops once the bracket holds less
#: than this share of the candidates' error energy (squared sensitivity scores).
ENERGY_RESOLUTION = 0.01


class Search:
    """The repair search of INT8 or bf16/fp16 nodes back to float
    (:class:`mixprec.tune.moves.Moves`: a move's cost is its MACs): builds, runs and
    scores candidates; keeps the counts and the path."""

    def __init__(
        self,
        target: Any,
        base: ir.Model,
        candidates: Sequence[str],
        measure: Callable[[], list[NodeSensitivity]],
        metric: Metric,
        samples: list[dict[str, np.ndarray]],
        reference: list[dict[str, np.ndarray]],
        budget: Budget | None,
        max_evaluations: int | None,
        threads: int,
        runtime: RuntimeOptions | None = None,
    ) -> None:
        self.target = target
        # Serialized afresh per candidate (the apply stage may take over weight buffers),
        # not kept as bytes beside it: MiniLM's 90 MB once more at the search's peak.
        self.base = base
        self.macs = {n.name or "": int(n.meta.get(MACS, 0)) for n in iter_nodes(base.graph)}
        self.order = list(candidates)  # ranked once measured
        self.measure = measure
        self.ranked: list[NodeSensitivity] = []
        self.moves: list[Move] = []  # the ranked nodes to float
        self.metric = metric
        self.samples = samples
        self.reference = reference
        self.budget = budget
        self.max_evaluations = max_evaluations
        self.threads = threads
        #: Where candidates run (default: ONNX Runtime's CPU provider, ``threads``).
        self.runtime = runtime or RuntimeOptions(threads=threads)
        self.counts = {"subset": 0, "full": 0, "reference": 1}
        self.path: list[Step] = []
        self.full: dict[int, Step] = {}  # by k, the ranked prefix moved to float
        self.passing: list[tuple[tuple[str, ...], Step]] = []  # full-set passes
        self.deadline = math.inf  # the give-back refinement stops here (perf_counter)
        self.labels: Labels | None = None  # per sample, for the user's own score
        self.moved_share: list[float] = []
        self.energy: list[float] = []

    def rank(self) -> None:
        """Measure the sensitivities (only once the all-low model misses the budget)."""
        ranked = self.measure()
        self.ranked = ranked
        self.moves = [s.move() for s in ranked]
        self.order = [m.name for m in self.moves]
        total = float(sum(self.macs.values())) or 1.0
        self.moved_share = shares([m.cost for m in self.moves], total)
        self.energy = shares([min(s.score, 1e6) ** 2 if s.measured else 0.0 for s in ranked])

    def grade(self, k: int) -> bool:
        """Whether the first ``k`` ranked nodes moved to float meet the budget on every
        sample."""
        return self.passes(k, None)

    def next_subset_step(self, lo: int, hi: int) -> int | None:
        """Where the subset bisection looks next, or None when it is done.

        While the bracket holds >= 1% of the model's MACs it first tries every node that
        costs no MACs beyond ``lo`` at once (when they hold >= 25% of the error energy),
        then halves the MACs at stake; then,
        among the rest, it halves the error energy (squared scores) at stake while that
        is >= 1% of the candidates' total, so fewer nodes go float (fewer casts) for the
        same MAC share.
        """
        if hi - lo <= 1 or self.exhausted():
            return None
        if self.moved_share[-1] < MAC_SHARE_RESOLUTION:
            return (lo + hi) // 2
        if self.moved_share[hi] - self.moved_share[lo] >= MAC_SHARE_RESOLUTION:
            # First every node that costs no more MACs than ``lo`` does, all at once.
            free = int(np.searchsorted(np.asarray(self.moved_share), self.moved_share[lo], "right"))
            free -= 1
            if lo < free < hi and self.energy[free] - self.energy[lo] >= FREE_ENERGY:
                return free
            return midpoint(self.moved_share, lo, hi)
        if self.energy[hi] - self.energy[lo] >= ENERGY_RESOLUTION:
            if time.perf_counter() > self.deadline:
                return None  # a refinement, like the give-back: within the time budget
            return midpoint(self.energy, lo, hi)
        return None

    def open_bracket(self, lo: int, hi: int) -> bool:
        """Whether bisection between ``lo`` (fails) and ``hi`` (passes) goes on."""
        if hi - lo <= 1 or self.exhausted():
            return False
        gap = self.moved_share[hi] - self.moved_share[lo]
        return gap >= MAC_SHARE_RESOLUTION or self.moved_share[-1] < MAC_SHARE_RESOLUTION

    def exhausted(self) -> bool:
        used = self.counts["subset"] + self.counts["full"]
        return self.max_evaluations is not None and used >= self.max_evaluations

    def names(self, k: int | Sequence[str]) -> list[str]:
        return self.order[:k] if isinstance(k, int) else list(k)

    def build(self, k: int | Sequence[str], *, finish: bool) -> tuple[ir.Model, float]:
        """Candidate ``k``: the first ``k`` ranked nodes (or the nodes named) moved to
        float. Annotate re-runs without counting MACs again (they and the shapes are the
        base model's)."""
        model = ir.from_proto(ir.to_proto(self.base))
        meta = self.base.meta
        model.meta.update({k: meta[k] for k in (CALIBRATION, SHAPES) if k in meta})
        for node in iter_nodes(model.graph):
            node.meta[MACS] = self.macs.get(node.name or "", 0)
        pipeline = self.target.pipeline(self.names(k), check=finish)
        annotate = pipeline.build("annotate", model)
        passes = [p for p in annotate.passes if not isinstance(p, CountMacsPass)]
        stage = Stage("annotate", *passes)
        model = stage(model).model
        share = self.target.low_mac_share(model)
        self.last_low = set(self.target.candidates(model))
        model = pipeline.run(model, start="apply", until="check" if finish else "apply")
        pipeline.stages = {"annotate": stage, **pipeline.stages}
        self.last_pipeline = pipeline
        return model, share

    def session(self, model: ir.Model) -> tuple[onnx.ModelProto, Session]:
        """Candidate ``model`` as the target runs it (as is, or emulated) and its session
        in the search's runtime; a model the runtime refuses to load is emulated (FP16 ops
        a CPU provider has no kernel for), except INT8 candidates."""
        engine = engine_for(self.runtime)
        proto, optimization = self.target.runnable(model, engine)
        options = dataclasses.replace(self.runtime, optimization=optimization)
        try:
            return proto, engine.session(proto, options)
        except RuntimeLoadError:
            if self.target.int8 or optimization == "off":
                raise
            proto = emulate_low_precision(proto)
            options = dataclasses.replace(self.runtime, optimization="off")
            return proto, engine.session(proto, options)

    def score(
        self, k: int | Sequence[str], subset: Sequence[int] | None
    ) -> tuple[float, list[float]]:
        """The metric of candidate ``k`` on ``subset`` (indices) or every sample, and the
        per-sample values (built-in metrics on the full set only)."""
        t = time.perf_counter()
        model, share = self.build(k, finish=False)
        proto, session = self.session(model)
        idx = list(range(len(self.samples))) if subset is None else list(subset)
        value, each, note = self._evaluate(proto, session, idx, full=subset is None)
        if note:
            logger.info("tune: %s: scored as a miss", note)
        self.counts["subset" if subset is not None else "full"] += 1
        passed = self.budget.met(value) if self.budget is not None else False
        moved = self.names(k)
        seconds = time.perf_counter() - t
        step = Step(len(moved), subset is not None, value, passed, share, seconds, note)
        self.path.append(step)
        if subset is None:
            if isinstance(k, int):
                self.full[k] = step
            if passed:
                self.passing.append((tuple(moved), step))
        logger.info(
            "tune: %d kept float, %s: %s %.6g (%s)",
            len(moved),
            "subset" if subset is not None else "full",
            self.metric.name,
            value,
            "pass" if passed else "fail",
        )
        return value, each

    def passes(self, k: int | Sequence[str], subset: Sequence[int] | None) -> bool:
        """Whether candidate ``k`` meets the budget on ``subset`` (:meth:`score`)."""
        self.score(k, subset)
        return self.path[-1].passed

    def _evaluate(
        self, proto: onnx.ModelProto, session: Session, idx: list[int], *, full: bool
    ) -> tuple[float, list[float], str]:
        """The metric on the samples ``idx``, the per-sample values (built-in metrics,
        ``full`` only), and why the candidate is a miss ("" when it is not).

        A candidate the runtime refuses to run (a length that depends on values changed
        inside the graph: operands that no longer broadcast) scores the metric's worst
        value, like one whose output changed shape; the search goes on.
        """
        samples = [self.samples[i] for i in idx]
        candidate = Candidate(proto, session, samples)
        if self.metric.user is not None:
            try:
                return float(self.metric.user(candidate)), [], ""
            except RuntimeRunError as exc:
                return self.metric.miss, [], str(exc)
        compare = self.metric.compare or self._user_score(idx)
        ref = [self.reference[i] for i in idx]
        outs: list[dict[str, np.ndarray] | None] = []
        note = ""
        for sample in samples:
            try:
                outs.append(candidate.run(sample))
            except RuntimeRunError as exc:
                outs.append(None)
                note = note or str(exc)
        each = []
        if full and self.metric.builtin:
            for r, o in zip(ref, outs, strict=True):
                each.append(self.metric.miss if o is None else compare([r], [o]))
        ran = [o for o in outs if o is not None]
        if note:
            return self.metric.miss, each, note
        return compare(ref, ran), each, shape_miss(ref, ran) or ""

    def _user_score(
        self, idx: list[int]
    ) -> Callable[[Sequence[dict[str, np.ndarray]], Sequence[dict[str, np.ndarray]]], float]:
        """The user's own score (``metric_budget``) on the samples ``idx``, with their
        labels, as a comparison of outputs (a failing score is a miss)."""
        score = self.metric.score
        assert score is not None
        labels = [self.labels[i] for i in idx] if self.labels is not None else None

        def compare(
            ref: Sequence[dict[str, np.ndarray]], out: Sequence[dict[str, np.ndarray]]
        ) -> float:
            try:
                return call_user_metric(score, ref, out, labels)
            except Exception as exc:  # the user's code: its failure is a measured miss
                logger.info("tune: %s raised %r: scored as a miss", self.metric.name, exc)
                return self.metric.miss

        return compare

    def run(self, subset_size: int) -> tuple[str, ...] | None:
        """The nodes to move to float: the passing candidate with the largest MAC share
        found on the full set, or None."""
        n = len(self.order)
        _, each = self.score(0, None)
        if self.full[0].passed or n == 0:
            return () if self.full[0].passed else None
        if self.exhausted():
            return None
        self.rank()
        lo = 0
        worst: list[int] | None = None
        if self.metric.builtin and 0 < subset_size < len(self.samples):
            worst = self._worst(each, subset_size)
            found = self._bisect_subset(worst)
            if found is not None:
                return self._give_back(found, worst)
            lo = next((k for k, s in self.full.items() if k > 0 and not s.passed), 0)
        _, hi = narrow(
            self.grade, lo, n, lambda lo, hi: halving(lo, hi) if self.open_bracket(lo, hi) else None
        )
        if hi not in self.full and not self.exhausted():
            self.score(hi, None)
        if not self.passing:
            return None
        best = max(self.passing, key=lambda p: (p[1].low_mac_share, -len(p[0])))[0]
        return self._give_back(best, worst)

    def _bisect_subset(self, worst: list[int]) -> tuple[str, ...] | None:
        """Bisect on the worst samples, confirm on all: the prefix if confirmed."""
        n = len(self.order)
        cap = math.ceil(math.log2(n)) if n > 1 else 1

        def step(lo: int, hi: int) -> int | None:
            return self.next_subset_step(lo, hi) if self.counts["subset"] < cap else None

        _, hi = narrow(lambda k: self.passes(k, worst), 0, n, step)
        if hi < n and not self.exhausted():
            self.score(hi, None)
            if self.full[hi].passed:
                return tuple(self.order[:hi])
        return None

    def _give_back(self, moved: tuple[str, ...], worst: list[int] | None) -> tuple[str, ...]:
        """Greedy refinement: hand the heaviest float nodes back to low precision one at a
        time, keeping each whose return still meets the budget (on the worst samples,
        then confirmed on all). Tries: what the subset allowance (ceil(log2 N)) left, at
        least 2; never past the full-set bound or the time budget."""
        n = len(self.order)
        bound = math.ceil(math.log2(n)) + 3 if n > 1 else 4
        if worst is None:
            tries = bound - self.counts["full"]
        else:
            tries = max(2, math.ceil(math.log2(max(n, 2))) - self.counts["subset"])
        heavy = [m for m in sorted(moved, key=lambda m: -self.macs.get(m, 0)) if self.macs.get(m)]
        kept = list(moved)
        changed = False
        for name in heavy[:tries]:
            if self.exhausted() or time.perf_counter() > self.deadline:
                break
            if worst is None and self.counts["full"] >= bound:
                break
            trial = [m for m in kept if m != name]
            if self.passes(trial, worst):
                kept, changed = trial, True
        if not changed:
            return moved
        if worst is None:
            return tuple(kept)  # scored on every sample already
        if self.counts["full"] < bound and not self.exhausted() and self.passes(kept, None):
            return tuple(kept)
        return moved

    def _worst(self, each: list[float], size: int) -> list[int]:
        order = sorted(
            range(len(each)), key=lambda i: each[i], reverse=not self.metric.higher_is_better
        )
        return sorted(order[:size])
