"""What ``mixprec.tune`` returns: the tuned model, what stayed float and why, the search
path (:class:`Step`), and its ``--json`` and text forms."""

from __future__ import annotations

import dataclasses

from mixprec.checks.outputs import OutputCheck
from mixprec.core.jsonio import json_ready
from mixprec.pipeline.convert import ConversionResult
from mixprec.tune.metrics import MISS, Budget
from mixprec.tune.sensitivity import NodeSensitivity

__all__ = ["Step", "TuneResult"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One evaluation on the search path."""

    kept_float: int  # how many of the ranked candidates were moved to float
    subset: bool  # scored on the worst samples only
    value: float
    passed: bool
    low_mac_share: float
    seconds: float
    note: str = ""  # why it is a miss: an output changed shape, the runtime refused it


@dataclasses.dataclass
class TuneResult(ConversionResult):
    """The tuned model, what was kept float and why, and how the search went.

    Attributes (besides ``model``, ``report``, ``input_kind``, ``save()``):
        target: "float16", "bfloat16" or "int8".
        metric: the metric's name.
        budget: the budget as a bound (``budget.limit``, ``budget.text``).
        achieved: the returned model's metric on the full data (None when not measured).
        passed: whether it meets the budget (False when not even the all-float model
            does, or ``max_evaluations`` ran out first).
        kept_float: the candidates that are float in the returned model, each with its
            sensitivity: those moved by name and those painting then kept float (an INFER
            op fed only by a node moved to float).
        candidates: N, the nodes the default policy puts in low precision (INT8).
        ranking: every candidate, most harmful first (empty when the all-low model met
            the budget, or ``max_evaluations`` ran out, before sensitivity was needed).
        evaluations: model evaluations: {"subset": .., "full": .., "reference": ..}.
        path: every evaluation in order.
        seconds: the whole tuning time; ``plain_seconds`` that of one plain conversion's
            stages (prepare, calibrate, annotate, apply, cleanup, check) within it.
        low_mac_share: the returned model's low-precision (INT8) MAC share, 0..1.
        message: a plain sentence about the outcome.
        samples: the samples the returned model was measured on.
        checks: the verdict as the one schema of "is it still the same model?" holds it
            (:class:`~mixprec.checks.outputs.OutputCheck`, as validate, the guards and
            optimize do): the metric over every output and sample against the budget.
    """

    target: str = ""
    metric: str = ""
    budget: Budget | None = None
    achieved: float | None = None
    passed: bool = False
    kept_float: list[NodeSensitivity] = dataclasses.field(default_factory=list)
    candidates: int = 0
    ranking: list[NodeSensitivity] = dataclasses.field(default_factory=list)
    evaluations: dict[str, int] = dataclasses.field(default_factory=dict)
    path: list[Step] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    plain_seconds: float = 0.0
    low_mac_share: float = 0.0
    message: str = ""
    samples: int = 0

    @property
    def checks(self) -> tuple[OutputCheck, ...]:
        """The budget's verdict as one check: a built-in metric over every output (kind
        ``rel-l2``, ``max-abs``, ``top1`` or ``cosine``), a callable one as ``metric``
        under its name; none when nothing was measured."""
        if self.budget is None or self.achieved is None:
            return ()
        builtin = self.metric in MISS
        check = OutputCheck(
            "every output" if builtin else self.metric,
            self.metric if builtin else "metric",
            self.achieved,
            self.budget.limit,
            self.passed,
            reason=f"tune's budget: {self.budget.text}",
            rows=self.samples,
        )
        return (check,)

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` object."""
        return {
            "target": self.target,
            "metric": self.metric,
            "budget": self.budget.limit if self.budget else None,
            "budget_text": self.budget.text if self.budget else None,
            "achieved": json_ready(self.achieved),
            "passed": self.passed,
            "low_mac_share": round(self.low_mac_share, 6),
            "kept_float": [s.name for s in self.kept_float],
            "kept_float_sensitivity": [s.to_dict() for s in self.kept_float],
            "candidates": self.candidates,
            "evaluations": self.evaluations["subset"] + self.evaluations["full"],
            "evaluations_by_set": dict(self.evaluations),
            "seconds": round(self.seconds, 3),
            "plain_conversion_seconds": round(self.plain_seconds, 3),
            "path": [{**dataclasses.asdict(s), "value": json_ready(s.value)} for s in self.path],
            "message": self.message,
            "checks": [{**c.to_dict(), "text": c.measured()} for c in self.checks],
        }

    def format_summary(self) -> str:
        ev = self.evaluations
        achieved = "n/a" if self.achieved is None else f"{self.achieved:.6g}"
        lines = [
            f"mixprec tune: {self.target}, {self.budget.text if self.budget else ''}",
            f"  result            {'PASSED' if self.passed else 'NOT MET'}: {self.message}",
            f"  achieved          {self.metric} {achieved}",
            f"  low MAC share     {self.low_mac_share:.1%}",
            f"  candidates        {self.candidates}; kept float {len(self.kept_float)}",
            f"  evaluations       {ev['full']} full-set + {ev['subset']} subset "
            f"(+ {ev['reference']} reference run)",
            f"  time              {self.seconds:.2f} s "
            f"({self.seconds / max(self.plain_seconds, 1e-9):.1f}x the plain conversion "
            f"stages, {self.plain_seconds:.2f} s)",
        ]
        for s in self.kept_float[:25]:
            lines.append(
                f"  float  {s.op_type:14s} {s.name:40s} local {s.local:.3g} "
                f"downstream {s.downstream:.3g} accumulated {s.accumulated:.3g}"
            )
        if len(self.kept_float) > 25:
            lines.append(f"  ... {len(self.kept_float) - 25} more (see --json)")
        return "\n".join(lines)
