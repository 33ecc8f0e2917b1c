"""The INT8 accuracy guard around :func:`mixprec.quantize` (on by default).

1. Hold out samples (``eval_data``, else a seeded random half of the calibration
   samples, at most 64 or enough for 300 rows, when there are at least five; fewer:
   every sample both calibrates and checks, with a warning). Ranges never see the
   held-out samples. The samples stream from their source at each pass
   (:mod:`mixprec.checks.guard_samples`): only the held-out samples' FP32 outputs and labels
   are kept.
2. Quantize as asked (speed plan included) and hold each output to its check
   (:mod:`mixprec.checks.outputs`: top-1 on class scores, cosine on embeddings, rel L2
   elsewhere, each with the reason for its kind; or the user's metric, given the
   samples' labels) against the user's FP32 model run in the deployment's runtime too
   (its drift from ONNX Runtime's CPU provider reported where that runtime is another).
3. On a miss, first the other placements the speed plan found clearly faster, best
   first (:func:`~mixprec.repair.int8_repair.other_placement`): the first that passes
   on every held-out sample with rows that confirm it is the result. Otherwise the
   tuner's search (:func:`mixprec.tune`, target int8, the guard's checks
   as its metric, in the deployment's runtime with its graph optimizations) runs on the
   first half of the held-out samples and names the
   Conv/MatMul/Gemm nodes to keep float; quantize again without them (speed plan
   included) and grade it on the other half (one held-out sample: the same). If
   that still misses, the tuner's own model is the result when it is clearly faster than
   the input (timed as the speed plan times); if that misses too, more nodes stay float
   in the tuner's ranking (searched again on every held-out sample when the search
   samples ranked nothing), down to the input unchanged.
4. ``report.guard`` says what was measured, on how many rows (a batch of 16 is 16
   answers), and whether those rows confirm each agreement pass (the 95% lower bound of
   :mod:`mixprec.checks.confidence` at or above the budget); its ``summary`` is the
   command's last line, and ends with the rows it would take when they do not.
   A result that misses (only possible when the FP32 model itself misses the budget) has
   ``passed`` False: the CLI writes nothing and exits 1.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import Samples, split_for_guard
from mixprec.checks.outputs import (
    GuardBudget,
    OutputCheck,
    least_confirmed,
    output_kinds,
    shown,
)
from mixprec.core.readings import with_user_kinds
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.plan import IN_SUBGRAPH
from mixprec.pipeline.convert import CalibrationData
from mixprec.pipeline.quantize import Reuse
from mixprec.pipeline.report import Report
from mixprec.repair.int8_repair import Job, other_placement, repaired
from mixprec.repair.int8_runs import (
    Say,
    checked,
    copy_input,
    fp32_drift,
    fp32_reference,
    input_unchanged,
    quantize_once,
)

__all__ = ["EvalData", "guarded_quantize"]

logger = logging.getLogger(__name__)
EvalData = CalibrationData | str | os.PathLike[str]


def guarded_quantize(
    source: onnx.ModelProto,
    config: QuantizeConfig,
    calibration_data: CalibrationData | None,
    eval_data: EvalData | None,
    progress: Say | None,
) -> tuple[ir.Model, Report]:
    """Quantize ``source`` (the input as loaded), check on held-out samples, repair
    with the tuner on a miss."""
    say = progress or (lambda _msg: None)
    original = copy_input(source)
    split = split_for_guard(calibration_data, eval_data, original)
    calib = split.calibration
    budget = GuardBudget.of(config.guard_drop, config.guard_rel_l2, config.guard_cosine)
    kinds = with_user_kinds(output_kinds(original), config.output_kinds)
    clock = time.perf_counter()
    held = fp32_reference(original, split.held, config.runtime)
    drift = fp32_drift(original, held, config.runtime, (kinds, budget))
    del original  # the work copies are made from ``source``: one model's weights less
    count = len(held[1])
    spent = {"guard": time.perf_counter() - clock}
    reuse = Reuse()  # the repaired quantization takes the calibration and placement from here
    work, report = quantize_once(source, config, calib, progress, reuse)
    say(f"checking the INT8 model on {count} held-out sample(s)")
    clock = time.perf_counter()
    first = checked(work, held, config, (kinds, budget))
    spent["guard"] += time.perf_counter() - clock
    calibrated = len(calib) if calib is not None else 0
    guard = _guard_info(calibrated, count, split.in_sample, split.given)
    guard["kinds"] = {name: {"check": k.spec, "reason": k.reason} for name, k in kinds.items()}
    if drift is not None:  # the FP32 reference itself, this engine against ORT's CPU one
        guard["fp32_drift"] = [c.to_dict() for c in drift]
        guard["fp32_drift_note"] = (
            f"FP32 in {config.runtime.name} against ONNX Runtime's CPU provider on the held-out "
            "samples (the reference the INT8 model is held to moved this much): "
            + "; ".join(f"{c.output!r} {shown(c.value, c.limit)} ({c.kind})" for c in drift)
        )
    if all(c.passed for c in first):
        work, report = _unless_unconfirmed((source, config, calib), work, report, first, guard)
        report.timings = {**report.timings, **spent}
        return work, _finish(report, guard, first, (), first)
    spent["first quantize"] = sum(report.timings.values())
    clock = time.perf_counter()
    job = Job(source, config, calib, held, (kinds, budget), reuse, progress)
    if reuse.alternates:
        say(f"INT8 misses the budget ({_worst(first).text()}): trying the other placements")
        other = other_placement(job, guard)
        if other is not None:
            work, report, final = other
            spent["repair"] = time.perf_counter() - clock - sum(report.timings.values())
            report.timings = {**report.timings, **spent}
            return work, _finish(report, guard, final, (), first)
    say(f"INT8 misses the budget ({_worst(first).text()}): searching for nodes to keep float")
    work, report, final, names = repaired(job, guard)
    work, report = _unless_unconfirmed((source, config, calib), work, report, final, guard)
    # where the time went (the report's stages are the last quantization's)
    spent["repair"] = max(0.0, time.perf_counter() - clock - sum(report.timings.values()))
    report.timings = {**report.timings, **spent}
    return work, _finish(report, guard, final, names, first)


def _unless_unconfirmed(
    quantization: tuple[onnx.ModelProto, QuantizeConfig, Samples | None],
    work: ir.Model,
    report: Report,
    checks: list[OutputCheck],
    guard: dict[str, Any],
) -> tuple[ir.Model, Report]:
    """``work`` unless it is an INT8 result whose passes the held-out rows cannot
    confirm (an agreement's 95% lower bound under its budget): that is no pass, and the
    input is written unchanged, ``guard["unconfirmed"]`` saying why, unless the caller
    accepts it (``accept_unconfirmed``). ``quantization``: the input, the options and the
    calibration samples."""
    source, config, calib = quantization
    int8 = any(n.precision == "int8" for n in report.nodes)
    unsure = [c for c in checks if not c.confirmed]
    if config.accept_unconfirmed or not int8 or not unsure or not all(c.passed for c in checks):
        return work, report
    weakest = least_confirmed(unsure)
    guard["unconfirmed"] = {
        "passed": f"{shown(weakest.value, weakest.limit)} on {weakest.output!r}",
        "why": weakest.to_confirm(),
    }
    timed = (report.quantization or {}).get("speed")  # what the speed plan measured holds
    work, report = quantize_once(source, input_unchanged(config), calib, None)
    if timed is not None and report.quantization is not None:
        report.quantization["speed"] = timed
    report.notes.append(
        f"INT8 passed but {weakest.to_confirm()}: a pass the held-out rows cannot confirm is "
        "none, so the input is written unchanged (--accept-unconfirmed / accept_unconfirmed "
        "takes the INT8 model; more held-out samples, --eval-data, can confirm it)"
    )
    return work, report


def _guard_info(calibrated: int, held: int, in_sample: bool, given: bool) -> dict[str, Any]:
    if in_sample:
        logger.warning(
            "accuracy guard: only %d sample(s), too few to hold any out: the INT8 model is "
            "checked on the samples it was calibrated on, which says little about new "
            "inputs; give more samples or eval_data / --eval-data",
            held,
        )
    how = "eval data" if given else ("in-sample" if in_sample else "held out of calibration")
    return {"calibration_samples": calibrated, "eval_samples": held, "eval": how}


def _worst(checks: list[OutputCheck]) -> OutputCheck:
    return min(checks, key=lambda c: c.slack())


def _finish(
    report: Report,
    guard: dict[str, Any],
    checks: list[OutputCheck],
    kept: tuple[str, ...],
    first: list[OutputCheck],
) -> Report:
    passed = all(c.passed for c in checks)
    weighted = [n for n in report.nodes if n.op_class == "weighted"]
    int8 = sum(1 for n in weighted if n.precision == "int8")
    head = f"INT8 on {int8}/{len(weighted)} Conv/MatMul/Gemm"
    if nested := sum(1 for n in weighted if n.reason == IN_SUBGRAPH):
        head += f" ({nested} in If/Loop/Scan bodies stay float: not calibrated there)"
    worst = _worst(checks)
    if not passed:
        summary = f"{head}; accuracy guard FAILED: {worst.text()}"
    elif "unconfirmed" in guard:
        was = guard["unconfirmed"]
        summary = (
            f"{head}: the model stays float (INT8 passed with {was['passed']}, but "
            f"{was['why']}; --accept-unconfirmed takes it)"
        )
    elif guard.get("widened") is not None and int8 == 0:
        was = _worst(first)
        summary = (
            f"{head}: the model stays float (INT8 missed {was.needs()} with "
            f"{shown(was.value, was.limit)}, and every repair missed on the graded samples)"
        )
    elif kept and int8 == 0:
        was = _worst(first)
        missed = shown(was.value, was.limit)
        summary = (
            f"{head}: the model stays float (INT8 missed {was.needs()} with {missed}, "
            "and no accurate INT8 placement was faster than the input)"
        )
    elif kept:
        was = _worst(first)
        summary = (
            f"{head}; {len(kept)} kept float to meet {was.needs()} "
            f"(was {shown(was.value, was.limit)}, now {_value_of(checks, was.output):.3g})"
        )
    elif "placement_taken" in guard and int8:
        was = _worst(first)
        summary = (
            f"{head}; the speed plan's first placement ({guard['placement_first']!r}) missed "
            f"{was.needs()} with "
            f"{shown(was.value, was.limit)}; {guard['placement_taken']!r}, also faster, "
            f"passed: {worst.text()}"
        )
    else:
        summary = f"{head}; accuracy guard passed: {worst.text()}"
    # a pass the held-out rows cannot support is said on the last line (a float result
    # is the input itself: nothing to confirm, unless it was written for want of rows that
    # confirm INT8's pass: those checks stay unconfirmed, and the summary says it already)
    graded = int8 or "unconfirmed" in guard
    unsure = [c for c in checks if c.passed and not c.confirmed] if graded else []
    if passed and unsure and int8:
        summary += f"; but {least_confirmed(unsure).to_confirm()}"
    report.guard = {
        **guard,
        "passed": passed,
        "confirmed": passed and not unsure,
        "rows": max((c.rows for c in checks), default=0),
        "checks": [c.to_dict() for c in checks],
        "first_checks": [c.to_dict() for c in first],
        "kept_float": list(kept),
        "summary": summary,
    }
    rows = report.guard["rows"]
    where = f"{guard['eval']}, {guard['eval_samples']} sample(s), {rows} row(s) graded"
    report.notes.append(f"accuracy guard ({where}): {summary}")
    if "fp32_drift_note" in guard:
        report.notes.append(guard["fp32_drift_note"])
    report.notes.extend(  # each output's check and why it gets that one
        f"accuracy guard on {c.output!r}: {c.text()} ({c.reason})" for c in checks if c.reason
    )
    return report


def _value_of(checks: list[OutputCheck], output: str) -> float:
    return next(c.value for c in checks if c.output == output)
