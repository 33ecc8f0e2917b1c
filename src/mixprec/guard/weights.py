"""The weight-only guard of a model that is not a language model: each output against
the FP32 model's on the check samples (the worst rel L2 over the samples and, for class
scores, the top-1 agreement, :mod:`mixprec.core.metrics`). It fails only where a budget
was given (``guard_drop`` / ``guard_rel_l2``) or an output goes non-finite; without
budgets it reports."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from mixprec.core.metrics import compare_outputs
from mixprec.io.feeds import feeds_for
from mixprec.pipeline.streamed import Outputs
from mixprec.pipeline.weights import GuardContext, WeightsReport
from mixprec.weights.config import WeightsConfig
from mixprec.weights.select import class_score_outputs

__all__ = ["output_check"]


def output_check(
    model: ir.Model, report: WeightsReport, context: GuardContext
) -> tuple[ir.Model, WeightsReport]:
    """The default :data:`WeightsGuard`: each output against FP32 on the check samples.

    Per output: the worst rel L2 over the samples and, for class scores (an lm_head's or
    a Softmax's output of rank 2-3), the top-1 agreement over the last axis. It fails on non-finite
    values where FP32 is finite, and on a budget given (``guard_rel_l2``, ``guard_drop``);
    without budgets it only reports (the language-model guard sets real ones).
    """
    config = context.config
    feeds = [feeds_for(model, s) for s in context.samples]
    got = context.runs.quantized(model, feeds)
    reference = context.runs.fp32(feeds)
    checks = _checks(reference, got, config, class_score_outputs(model))
    passed = all(c["passed"] for c in checks)
    report.guard = {
        "passed": passed,
        "checks": checks,
        "samples": len(feeds),
        "eval": context.where,
        "enforced": config.guard_drop is not None or config.guard_rel_l2 is not None,
        "summary": _summary(report, checks, passed, len(feeds), context.where),
    }
    return model, report


def _checks(
    reference: list[Outputs], got: list[Outputs], config: WeightsConfig, classes: set[str]
) -> list[dict]:
    """One check per output: worst rel L2, mean top-1 (``classes``: the outputs that hold
    class scores), and why it failed ("" passed)."""
    checks = []
    for name in reference[0]:
        rel, top1, why = 0.0, [], ""
        for ref, out in zip(reference, got, strict=True):
            if name not in out:
                why = "missing from the weight-only model's outputs"
                break
            (c,) = compare_outputs({name: ref[name]}, {name: out[name]}, rtol=1.0, atol=0.0)
            rel = max(rel, c.rel_l2_error)
            if name in classes and c.top1_agreement is not None:
                top1.append(c.top1_agreement)
            if not np.isfinite(c.rel_l2_error) or "non-finite" in c.note:
                why = c.note or "non-finite values"
        agreement = float(np.mean(top1)) if top1 else None
        why = why or _over_budget(rel, agreement, config)
        checks.append(
            {"output": name, "rel_l2": rel, "top1": agreement, "passed": not why, "note": why}
        )
    return checks


def _over_budget(rel: float, top1: float | None, config: WeightsConfig) -> str:
    if config.guard_rel_l2 is not None and rel > config.guard_rel_l2:
        return f"rel L2 {rel:.3g} > {config.guard_rel_l2:g} (--max-rel-l2)"
    if config.guard_drop is not None and top1 is not None and top1 < 1.0 - config.guard_drop:
        return f"top-1 {top1:.3g} < {1.0 - config.guard_drop:g} (--max-drop)"
    return ""


def _summary(report: WeightsReport, checks: list[dict], passed: bool, n: int, where: str) -> str:
    """The command's last line: what became what, and each output against FP32."""
    counts = Counter(row.precision for row in report.nodes if row.op_type == "MatMul")
    done = ", ".join(f"{k} {p}" for p, k in sorted(counts.items()) if p != "fp32")
    parts = []
    for c in checks[:3]:
        top1 = f", top-1 {c['top1']:.3g}" if c["top1"] is not None else ""
        parts.append(f"{c['output']!r} rel L2 {c['rel_l2']:.3g}{top1}")
    more = f", +{len(checks) - 3} more" if len(checks) > 3 else ""
    verdict = "outputs vs FP32" if passed else "output check FAILED"
    notes = "; ".join(c["note"] for c in checks if c["note"])
    where = where.replace("samples", "sample", 1) if n == 1 else where
    text = f"weight-only MatMul {done or 'none'}; {verdict} on {n} {where}: {', '.join(parts)}"
    return text + more + (f" ({notes})" if notes else "")
