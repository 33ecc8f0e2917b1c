"""The INT8 accuracy guard around :func:`mixprec.quantize` (on by default).

1. Hold out samples (``eval_data``, else a seeded random half of the calibration
   samples, at most 64 or enough for 300 rows, when there are at least five; fewer:
   every sample both calibrates and checks, with a warning). Ranges never see the
   held-out samples. The samples stream from their source at each pass
   (:mod:`mixprec.checks.samples`): only the held-out samples' FP32 outputs and labels
   are kept.
2. Quantize as asked (speed plan included) and hold each output to its check
   (:mod:`mixprec.checks.outputs`: top-1 on class scores, cosine on embeddings, rel L2
   elsewhere, each with the reason for its kind; or the user's metric, given the
   samples' labels) against the user's FP32 model run in the deployment's runtime too
   (its drift from ONNX Runtime's CPU provider reported where that runtime is another).
3. On a miss, the tuner's search (:func:`mixprec.tune`, target int8, the guard's checks
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

import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.outputs import (
    GuardBudget,
    OutputCheck,
    UserMetric,
    check_outputs,
    guard_metric,
    least_confirmed,
    missed,
    output_kinds,
    search_and_grade,
    shown,
)
from mixprec.checks.samples import Samples, split_for_guard
from mixprec.checks.user_metric import Labels
from mixprec.checks.validate import detect_low_dtype
from mixprec.core.errors import MixprecError
from mixprec.core.output_kinds import OutputKind
from mixprec.core.readings import with_user_kinds
from mixprec.inputs.feeds import feeds_for
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.speed import decide, time_paired
from mixprec.int8.speed import session as timing_session
from mixprec.io.external import clone_model
from mixprec.io.models import load_input
from mixprec.pipeline.convert import CalibrationData
from mixprec.pipeline.quantize import Reuse, latency_feeds, run_quantize
from mixprec.pipeline.report import Report
from mixprec.runtime.emulate import emulate_low_precision
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import check_plan, engine_for
from mixprec.tune.options import tune_from_options

__all__ = ["EvalData", "guarded_quantize", "quantize_once"]

logger = logging.getLogger(__name__)
EvalData = CalibrationData | str | os.PathLike[str]
Say = Callable[[str], None]


def quantize_once(
    source: onnx.ModelProto,
    config: QuantizeConfig,
    data: Any,
    progress: Say | None,
    reuse: Reuse | None = None,
) -> tuple[ir.Model, Report]:
    """One quantization of ``source`` (the input as loaded, weights inline); a result
    with no INT8 node is the input unchanged. ``reuse``: see :class:`Reuse`."""
    work, report = run_quantize(
        _copy(source), config, calibration_data=data, progress=progress, reuse=reuse
    )
    if config.fallback == "fp32" and not any(n.precision == "int8" for n in report.nodes):
        # Nothing runs in INT8: the input as given, never the prepared copy (prepare's
        # rewrites may move ORT off a faster path, e.g. Casts before a Pad).
        work = _copy(source)
        report.unchanged = True
        report.notes.append("no node runs in INT8: the input model is written unchanged")
    return work, report


def _copy(source: onnx.ModelProto) -> ir.Model:
    """A private copy of the loaded input (no external data left to read)."""
    return load_input(source)[0]


def _outputs(
    model: ir.Model, samples: Iterable[dict[str, Any]], runtime: RuntimeOptions | None = None
) -> list[dict[str, Any]]:
    """The model's outputs in the deployment's engine (``runtime``; None: ONNX Runtime's
    CPU provider). A bf16 fallback runs as its FP32 emulation (every bf16
    tensor rounded) where that engine cannot compute bf16: ONNX Runtime's CPU provider
    cannot load it, and OpenVINO computes it in f32 on a CPU without bf16."""
    proto = ir.to_proto(model)
    options = runtime or RuntimeOptions()
    plan = check_plan(detect_low_dtype(proto), options, "auto")
    if not plan.emulated:
        try:
            session = engine_for(options).session(proto, options)
            return [session.run(feeds_for(model, s)) for s in samples]
        except RuntimeLoadError:
            if not engine_for(options).refuses_bf16():
                raise
            # ORT refuses the bf16 islands of --fallback bf16 (no bf16 kernels): emulate
    ort = RuntimeOptions(threads=options.threads)
    session = engine_for(ort).session(emulate_low_precision(proto), ort)
    return [session.run(feeds_for(model, s)) for s in samples]


#: What the guard holds of the held-out samples: the samples (streamed), their FP32
#: outputs and their labels.
Held = tuple[Samples, list[dict[str, Any]], Labels | None]


def _checked(
    work: ir.Model,
    held: Held,
    config: QuantizeConfig,
    how: tuple[dict[str, OutputKind], GuardBudget],
) -> list[OutputCheck]:
    """The guard's checks of ``work`` on the samples of ``held``; a model the runtime
    refuses to run (a placement that changed a value-dependent length inside the graph)
    misses every check with the runtime's reason, and the repair goes on as for any
    miss."""
    kinds, budget = how
    samples, reference, labels = held
    user = _user_metric(config)
    try:
        got = _outputs(work, samples, config.runtime)
        return check_outputs(reference, got, kinds, budget, user, labels)
    except RuntimeRunError as e:
        if user is not None:
            return [OutputCheck(user.name, "metric", math.nan, user.budget, False, str(e))]
        return missed(reference, kinds, budget, str(e))


def _reference(model: ir.Model, samples: Samples, runtime: RuntimeOptions) -> Held:
    """The held-out samples' FP32 outputs in the deployment's engine (``runtime``: the
    INT8 model is checked there, so the FP32 model is too) and their labels (their arrays
    that are not model inputs; None when none has any), in one pass over them. The FP32
    model failing there is one error line: no INT8 model could be judged against it."""
    inputs = {v.name for v in model.graph.inputs}
    found: list[dict[str, Any]] = []

    def tee(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for sample in items:
            found.append({k: v for k, v in sample.items() if k not in inputs})
            yield sample

    try:
        outputs = _outputs(model, tee(samples), runtime)
    except (RuntimeLoadError, RuntimeRunError) as e:
        raise MixprecError(
            f"the accuracy guard cannot run the FP32 model in {runtime.name} on the held-out "
            f"samples, so nothing can be checked against it: {e}"
        ) from None
    return samples, outputs, found if any(found) else None


def _drift(
    model: ir.Model,
    held: Held,
    runtime: RuntimeOptions,
    how: tuple[dict[str, OutputKind], GuardBudget],
) -> list[OutputCheck] | None:
    """How far the FP32 model's own outputs in the deployment's engine are from ONNX
    Runtime's CPU provider's on the held-out samples, by the guard's checks (None when
    the deployment is that provider): the reference the INT8 model is held to moved by
    this much before any quantization."""
    if runtime == RuntimeOptions(threads=runtime.threads):
        return None
    samples, reference, _ = held
    kinds, budget = how
    cpu = _outputs(model, samples, RuntimeOptions(threads=runtime.threads))
    return check_outputs(cpu, reference, kinds, budget)


def _part(held: Held, positions: list[int]) -> Held:
    """The held-out samples at ``positions``, with their FP32 outputs and labels."""
    samples, reference, labels = held
    picked = [labels[k] for k in positions] if labels is not None else None
    return samples.only(positions), _pick(reference, positions), picked


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
    original = _copy(source)
    split = split_for_guard(calibration_data, eval_data, original)
    calib = split.calibration
    budget = GuardBudget.of(config.guard_drop, config.guard_rel_l2, config.guard_cosine)
    kinds = with_user_kinds(output_kinds(original), config.output_kinds)
    clock = time.perf_counter()
    held = _reference(original, split.held, config.runtime)
    drift = _drift(original, held, config.runtime, (kinds, budget))
    del original  # the work copies are made from ``source``: one model's weights less
    count = len(held[1])
    spent = {"guard": time.perf_counter() - clock}
    reuse = Reuse()  # the repaired quantization takes the calibration and placement from here
    work, report = quantize_once(source, config, calib, progress, reuse)
    say(f"checking the INT8 model on {count} held-out sample(s)")
    clock = time.perf_counter()
    first = _checked(work, held, config, (kinds, budget))
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
    say(f"INT8 misses the budget ({_worst(first).text()}): searching for nodes to keep float")
    job = _Job(source, config, calib, held, (kinds, budget), reuse, progress)
    work, report, final, names = _repaired(job, guard)
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
    work, report = quantize_once(source, _input_unchanged(config), calib, None)
    if timed is not None and report.quantization is not None:
        report.quantization["speed"] = timed
    report.notes.append(
        f"INT8 passed but {weakest.to_confirm()}: a pass the held-out rows cannot confirm is "
        "none, so the input is written unchanged (--accept-unconfirmed / accept_unconfirmed "
        "takes the INT8 model; more held-out samples, --eval-data, can confirm it)"
    )
    return work, report


@dataclasses.dataclass(frozen=True)
class _Job:
    """One guarded quantization, as the repair sees it: the input as loaded, the
    options, the calibration samples, the held-out samples (with their FP32 outputs and
    labels), how outputs are checked (kinds, budget) and the first run's :class:`Reuse`."""

    source: onnx.ModelProto
    config: QuantizeConfig
    calib: Samples | None
    held: Held
    how: tuple[dict[str, OutputKind], GuardBudget]
    reuse: Reuse
    progress: Say | None


def _repaired(
    job: _Job, guard: dict[str, Any]
) -> tuple[ir.Model, Report, list[OutputCheck], tuple[str, ...]]:
    """The repair of a first quantization that missed: the tuner's search on part of the
    held-out samples, requantized and graded on the rest; then the tuner's own model, a
    search on every held-out sample (when the first ranked nothing) and the widening,
    each only while the graded samples still miss. ``guard`` gets what was done."""
    search, grade = search_and_grade(list(range(len(job.held[1]))))
    guard.update(search_samples=len(search), graded_samples=len(grade))
    graded = _part(job.held, grade)
    tuned = _repair(job, _part(job.held, search))
    names, work, report, final = _requantized(job, tuned, graded)
    reuse = job.reuse
    if reuse.calibrated is not None:
        timed = f" and timed only the placement chosen first ({reuse.placement!r})"
        report.notes.append(
            "the repaired quantization reused the first one's calibration (its time is in "
            f"'first quantize'){timed if reuse.placement is not None else ''}"
        )
    if not all(c.passed for c in final) and tuned.passed:
        work, report = _tuner_or_input(
            job.source, job.config, tuned, (job.calib, job.held[0]), job.progress
        )
        final = _checked(work, graded, job.config, job.how)
    if not all(c.passed for c in final) and not tuned.ranking:
        # the all-INT8 model met the search samples, so the tuner ranked nothing: search
        # again on every held-out sample (the graded ones then also chose the nodes)
        say = job.progress or (lambda _msg: None)
        say("INT8 misses on the graded samples only: searching again on every held-out one")
        tuned = _repair(job, job.held)
        names, work, report, final = _requantized(job, tuned, graded)
        guard["searched_on_every_held_out_sample"] = True
    if not all(c.passed for c in final):
        work, report, final, names = _widened(job, tuned, names, graded)
        guard["widened"] = len(names) - len(tuned.kept_float)
    return work, report, final, names


def _requantized(
    job: _Job, tuned: Any, graded: Held
) -> tuple[tuple[str, ...], ir.Model, Report, list[OutputCheck]]:
    """The input quantized again with the nodes the tuner kept float (``tuned``), checked
    on the ``graded`` samples: those nodes, the model, its report and the checks."""
    names = tuple(s.name for s in tuned.kept_float)
    config = _excluding(job.config, names)
    work, report = quantize_once(job.source, config, job.calib, job.progress, job.reuse)
    return names, work, report, _checked(work, graded, job.config, job.how)


def _input_unchanged(config: QuantizeConfig) -> QuantizeConfig:
    """``config`` keeping every node float with an FP32 fallback, untimed: a quantization
    with it writes the input unchanged (:func:`quantize_once`)."""
    return dataclasses.replace(config, exclude_nodes=(".*",), speed="off", fallback="fp32")


def _user_metric(config: QuantizeConfig) -> UserMetric | None:
    """The user's own metric (``--metric``), if any, named after its function."""
    if config.metric is None or config.metric_budget is None:
        return None
    name = getattr(config.metric, "__name__", "metric")
    return UserMetric(config.metric, float(config.metric_budget), name)


def _pick(items: list[Any], indices: list[int]) -> list[Any]:
    return [items[k] for k in indices]


def _repair(job: _Job, search: Held) -> Any:
    """The tuner's search for the nodes to keep float on the held-out samples ``search``
    (with their FP32 outputs and labels), the guard's checks as its metric, calibrating
    on the job's samples; it starts from the first quantization's calibrated model where
    the job's reuse holds one (the calibration the requantization uses too: with
    ``eval_data`` alone, the one synthetic sample)."""
    config, reuse = job.config, job.reuse
    samples, reference, labels = search
    budget = GuardBudget.of(config.guard_drop, config.guard_rel_l2, config.guard_cosine)
    options = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.name not in ("guard", "log_dir")
    }
    metric = guard_metric(reference, job.how[0], budget, _user_metric(config), labels)
    calibrated = None
    if reuse.calibrated is not None:  # (a learned rounding run keeps none: it calibrates)
        seconds = sum(sum(stage.seconds.values()) for stage in reuse.stages.values())
        calibrated = (clone_model(reuse.calibrated), seconds)
    return tune_from_options(  # searched in the engine the gate runs in
        job.source, "int8", samples, calibration_data=job.calib, metric=metric, budget=1.0,
        progress=job.progress, options=options, calibrated=calibrated,
        runtime=config.runtime,
    )  # fmt: skip


def _excluding(config: QuantizeConfig, names: Iterable[str]) -> QuantizeConfig:
    """``config`` with the nodes ``names`` kept float as well."""
    exact = tuple(f"^{re.escape(n)}$" for n in names)
    return dataclasses.replace(config, exclude_nodes=config.exclude_nodes + exact)


def _widened(
    job: _Job, tuned: Any, names: tuple[str, ...], graded: Held
) -> tuple[ir.Model, Report, list[OutputCheck], tuple[str, ...]]:
    """The repair missed on the graded samples: keep more nodes float, in the tuner's
    ranking (most harmful first), a quarter of the rest at a time, until the graded
    samples pass. The graded samples only pick where to stop; the last step is the input
    unchanged (every node float, FP32 fallback), which passes any budget the FP32 model
    meets."""
    config = job.config
    say = job.progress or (lambda _msg: None)
    rest = [s.name for s in tuned.ranking if s.name not in set(names)]
    step = max(1, math.ceil(len(rest) / 4))
    counts = [*range(step, len(rest), step), len(rest)]
    for count in counts:
        wider = names + tuple(rest[:count])
        last = count == counts[-1]  # every candidate float: the input unchanged
        what = "every node (the input unchanged)" if last else f"{len(wider)} node(s)"
        say(f"the repair missed on the graded samples: keeping {what} float")
        wide = _input_unchanged(config) if last else _excluding(config, wider)
        work, report = quantize_once(job.source, wide, job.calib, job.progress, job.reuse)
        checks = _checked(work, graded, config, job.how)
        if all(c.passed for c in checks) or last:
            break
    why = f"the repair ({len(names)} node(s) float) "
    why += "met the budget on the search samples " if tuned.passed else "missed the budget "
    if last:
        why += "but no placement in the tuner's ranking met it on the graded ones: the input "
        why += "is written unchanged"
    else:
        why += f"but not on the graded ones: {len(wider) - len(names)} more kept float, in "
        why += "the tuner's ranking, until they passed (the graded samples chose only where "
        why += "to stop)"
    report.notes.append(why)
    return work, report, checks, wider


def _tuner_or_input(
    source: onnx.ModelProto,
    config: QuantizeConfig,
    tuned: Any,
    data: tuple[Samples | None, Samples],
    progress: Say | None,
) -> tuple[ir.Model, Report]:
    """The speed plan's placement without the sensitive nodes missed the budget: the
    tuner's model (every other node INT8) when it is clearly faster than the input on
    this CPU (``speed="auto"``; :func:`mixprec.int8.speed.decide`), else the input
    unchanged. ``data`` is (calibration, held-out) samples."""
    calib, held = data
    if config.speed == "off":
        tuned.report.notes.append("the requantized model missed the budget: the tuner's is kept")
        return tuned.model, tuned.report
    original = _copy(source)
    sessions = {
        "fp32": timing_session(source, config.runtime),
        "tuned": timing_session(tuned.model_proto, config.runtime),
    }
    shapes = {k: list(np.shape(v)) for k, v in feeds_for(original, held.first()).items()}
    feeds = latency_feeds(original, config, shapes)  # the speed plan's inputs
    decision = decide(time_paired(sessions, feeds), ["tuned"])
    if decision.chosen == "tuned":
        tuned.report.notes.append(
            "the speed plan's placement without the sensitive nodes missed the budget; "
            f"the tuner's is kept: {decision.why}"
        )
        return tuned.model, tuned.report
    work, report = quantize_once(source, _input_unchanged(config), calib, progress)
    report.notes.append(
        f"the tuner's accurate placement is not faster than the input ({decision.why}): "
        "the model stays float"
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
