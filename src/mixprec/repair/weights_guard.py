"""The weight-only guard of a model that is not a language model: each output against
the FP32 model's on the check samples, read as rows of answers as the INT8 guard reads
them (:func:`~mixprec.checks.outputs.check_outputs`: argmax rows of class scores,
embedding rows at the cosine bound and their nearest neighbours, the worst channel, ...),
with the worst sample's relative L2 beside them as a second figure. One schema for "is
it still the same model?": the checks are :class:`~mixprec.checks.outputs.OutputCheck`
records, as INT8's. It fails where a budget was given (``guard_drop`` /
``guard_rel_l2``) and a reading misses it, or an output goes non-finite; without budgets
it reports each reading (weight-only INT4 of an encoder moves its rows by design: the
user's budget says how far is too far)."""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import onnx_ir as ir

from mixprec.checks.guard_samples import WINDOWS_HELD_OUT_SHARE, split_for_guard
from mixprec.checks.outputs import GuardBudget, OutputCheck, check_outputs
from mixprec.core.metrics import worst_rel_l2
from mixprec.core.output_kinds import OutputKind, classify_outputs
from mixprec.inputs.feeds import feeds_for
from mixprec.pipeline.streamed import Outputs
from mixprec.pipeline.weight_only import CHECK_SAMPLES, GuardContext, WeightsGuard, WeightsReport
from mixprec.weights.config import WeightsConfig
from mixprec.weights.select import class_score_outputs

__all__ = ["output_check", "output_check_data"]


def output_check_data(
    work: ir.Model, calibration_data: Any, eval_data: Any
) -> tuple[Any, Any, WeightsGuard]:
    """The output check's data and guard: ``eval_data`` when given, else the check samples
    held out of the calibration samples by the guard's one split
    (:func:`~mixprec.checks.guard_samples.split_for_guard`: a seeded fifth, at most
    :data:`~mixprec.pipeline.weight_only.CHECK_SAMPLES`), so that a data-aware method (AWQ,
    GPTQ) is not checked on the samples it fitted; fewer than
    :data:`~mixprec.checks.guard_samples.GUARD_MIN_SAMPLES`: every one does both."""
    if eval_data is not None or calibration_data is None:
        return calibration_data, eval_data, output_check
    split = split_for_guard(calibration_data, None, work, WINDOWS_HELD_OUT_SHARE, CHECK_SAMPLES)
    if split.in_sample:
        return calibration_data, None, output_check
    check = functools.partial(output_check, where="held-out calibration samples")
    return split.calibration, split.held, check


def output_check(
    model: ir.Model, report: WeightsReport, context: GuardContext, where: str | None = None
) -> tuple[ir.Model, WeightsReport]:
    """The default :data:`WeightsGuard`: each output against FP32 on the check samples,
    read as rows (module doc); fails on non-finite values where FP32 is finite, and on a
    reading that misses a budget given (``guard_rel_l2``, ``guard_drop``). ``where``
    names the check samples (default: the context's)."""
    config = context.config
    where = where or context.where
    feeds = [feeds_for(model, s) for s in context.samples]
    got = context.runs.quantized(model, feeds)
    reference = context.runs.fp32(feeds)
    checks = _checks(reference, got, config, _kinds(model))
    enforced = config.guard_drop is not None or config.guard_rel_l2 is not None
    broken = [c for c in checks if _broken(c)]
    passed = not broken and (not enforced or all(c.passed for c in checks))
    rel = {name: worst_rel_l2([r[name] for r in reference], [g[name] for g in got])
           for name in reference[0] if all(name in g for g in got)}  # fmt: skip
    report.guard = {
        "passed": passed,
        "checks": [{**c.to_dict(), "rel_l2": rel.get(c.output)} for c in checks],
        "samples": len(feeds),
        "eval": where,
        "enforced": enforced,
        "summary": _summary(report, checks, rel, passed, len(feeds), where)
        + _unenforced(checks, enforced),
    }
    return model, report


def _kinds(model: ir.Model) -> dict[str, OutputKind]:
    """Each output's kind (:func:`~mixprec.core.output_kinds.classify_outputs`); an
    lm_head's output (a MatMulNBits the graph reading does not know) is class scores."""
    kinds = classify_outputs(model)
    for name in class_score_outputs(model):
        if name in kinds and kinds[name].check == "other":
            kinds[name] = OutputKind("top1", -1, "class scores: an lm_head's logits")
    return kinds


def _checks(
    reference: list[Outputs], got: list[Outputs], config: WeightsConfig, kinds: dict
) -> list[OutputCheck]:
    """Every output's readings, held to the budgets given (else the INT8 defaults, which
    are then reported, not enforced)."""
    budget = GuardBudget.of(config.guard_drop, config.guard_rel_l2)
    missing = [name for name in reference[0] if any(name not in g for g in got)]
    if missing:
        why = "missing from the weight-only model's outputs"
        return [
            OutputCheck(name, "rel-l2", math.nan, budget.rel_l2, False, why) for name in missing
        ]
    return check_outputs(reference, got, kinds, budget)


def _unenforced(checks: list[OutputCheck], enforced: bool) -> str:
    """What the last line adds where a reading misses the INT8 guard's default budget
    that no budget given enforced."""
    if enforced or all(c.passed for c in checks):
        return ""
    return (
        "; below the INT8 guard's defaults, reported only (--max-drop / --max-rel-l2 hold "
        "the result to a budget)"
    )


def _broken(check: OutputCheck) -> bool:
    """A miss whatever the budget: an output that went non-finite, or is missing."""
    return bool(check.note) or math.isnan(check.value) or math.isinf(check.value)


def _summary(
    report: WeightsReport,
    checks: list[OutputCheck],
    rel: dict[str, float],
    passed: bool,
    n: int,
    where: str,
) -> str:
    """The command's last line: what became what, and each output against FP32."""
    counts = Counter(row.precision for row in report.nodes if row.op_type == "MatMul")
    done = ", ".join(f"{k} {p}" for p, k in sorted(counts.items()) if p != "fp32")
    outputs = list(dict.fromkeys(c.output for c in checks))
    parts = []
    for name in outputs[:3]:
        read = [f"{c.measured().split(' over ')[0]}" for c in checks if c.output == name]
        figure = f", rel L2 {rel[name]:.3g}" if name in rel else ""
        parts.append(f"{name!r} {', '.join(read)}{figure}")
    more = f", +{len(outputs) - 3} more" if len(outputs) > 3 else ""
    verdict = "outputs vs FP32" if passed else "output check FAILED"
    notes = "; ".join(dict.fromkeys(c.note for c in checks if c.note))
    where = where.replace("samples", "sample", 1) if n == 1 else where
    text = f"weight-only MatMul {done or 'none'}; {verdict} on {n} {where}: {'; '.join(parts)}"
    return text + more + (f" ({notes})" if notes else "")
