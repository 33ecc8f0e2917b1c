"""The INT8 guard's repair (step 3 of :mod:`.int8_guard`'s module doc): the tuner's
search for the nodes to keep float on part of the held-out samples, the input quantized
again without them and graded on the rest, then the tuner's own model (when it is
clearly faster than the input), a search on every held-out sample and the widening,
each only while the graded samples still miss."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import Samples
from mixprec.checks.outputs import (
    GuardBudget,
    OutputCheck,
    guard_metric,
    search_and_grade,
)
from mixprec.core.output_kinds import OutputKind
from mixprec.inputs.feeds import feeds_for
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.speed import SPEED_MARGINS, decide
from mixprec.io.external import clone_model
from mixprec.pipeline.quantize import Reuse, latency_feeds
from mixprec.pipeline.report import Report
from mixprec.repair.int8_runs import (
    Held,
    Say,
    checked,
    copy_input,
    input_unchanged,
    part,
    quantize_once,
    user_metric,
)
from mixprec.runtime.timing import session as timing_session
from mixprec.runtime.timing import time_paired
from mixprec.tune.moves import climb
from mixprec.tune.options import tune_from_options

__all__ = ["Job", "other_placement", "repaired"]


@dataclasses.dataclass(frozen=True)
class Job:
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


def repaired(
    job: Job, guard: dict[str, Any]
) -> tuple[ir.Model, Report, list[OutputCheck], tuple[str, ...]]:
    """The repair of a first quantization that missed: the tuner's search on part of the
    held-out samples, requantized and graded on the rest; then the tuner's own model, a
    search on every held-out sample (when the first ranked nothing) and the widening,
    each only while the graded samples still miss. ``guard`` gets what was done."""
    search, grade = search_and_grade(list(range(len(job.held[1]))))
    guard.update(search_samples=len(search), graded_samples=len(grade))
    graded = part(job.held, grade)
    tuned = _repair(job, part(job.held, search))
    names, work, report, final = _requantized(job, tuned, graded)
    reuse = job.reuse
    if reuse.calibrated is not None:
        timed = f" and timed only the placement chosen first ({reuse.placement!r})"
        report.notes.append(
            "the repaired quantization reused the first one's calibration (its time is in "
            f"'first quantize'){timed if reuse.placement is not None else ''}"
        )
    if not all(c.passed for c in final) and tuned.passed:
        work, report = tuner_or_input(
            job.source, job.config, tuned, (job.calib, job.held[0]), job.progress
        )
        final = checked(work, graded, job.config, job.how)
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


def other_placement(
    job: Job, guard: dict[str, Any]
) -> tuple[ir.Model, Report, list[OutputCheck]] | None:
    """Before any search: the next placement the speed plan also found clearly faster
    than FP32 (best first; MTCNN O-Net in OpenVINO: 'all' at 0.48x flipped 4 of 384 faces,
    Conv/MatMul/Gemm with >= 1% of the MACs at 0.46x flipped 1), quantized again, timed
    again alone, and checked on every held-out sample; the first that is still faster
    and passes, with rows that confirm it (or ``accept_unconfirmed``), is the result.
    None when none does. ``guard["placement_fallback"]`` says what was tried."""
    tried: list[dict[str, Any]] = []
    for label, placement in job.reuse.alternates:
        reuse = dataclasses.replace(job.reuse, placement=label, chosen=placement, alternates=[])
        work, report = quantize_once(job.source, job.config, job.calib, job.progress, reuse)
        if not any(n.precision == "int8" for n in report.nodes):
            tried.append({"placement": label, "result": "no longer faster when timed again"})
            continue
        checks = checked(work, job.held, job.config, job.how)
        passed = all(c.passed for c in checks)
        sure = job.config.accept_unconfirmed or all(c.confirmed for c in checks)
        worst = min(checks, key=lambda c: c.slack())
        result = "passed" if sure else "passed, unconfirmed"
        tried.append({"placement": label, "result": result if passed else worst.text()})
        if passed and sure:
            guard["placement_fallback"] = tried
            guard["placement_taken"] = label
            guard["placement_first"] = job.reuse.placement
            return work, report, checks
    if tried:
        guard["placement_fallback"] = tried
    return None


def _requantized(
    job: Job, tuned: Any, graded: Held
) -> tuple[tuple[str, ...], ir.Model, Report, list[OutputCheck]]:
    """The input quantized again with the nodes the tuner kept float (``tuned``), checked
    on the ``graded`` samples: those nodes, the model, its report and the checks."""
    names = tuple(s.name for s in tuned.kept_float)
    config = _excluding(job.config, names)
    work, report = quantize_once(job.source, config, job.calib, job.progress, job.reuse)
    return names, work, report, checked(work, graded, job.config, job.how)


def _repair(job: Job, search: Held) -> Any:
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
    metric = guard_metric(reference, job.how[0], budget, user_metric(config), labels)
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


class _Widening:
    """The guard's last repair (:class:`mixprec.tune.moves.Moves`): the nodes of the
    tuner's ranking not yet float (``names`` are), most harmful first, go to float a
    quarter of them at a time, each step quantized again and checked on the ``graded``
    samples; the last step is the input unchanged (every node float, FP32 fallback),
    which passes any budget the FP32 model meets. ``last`` holds the step graded last."""

    def __init__(self, job: Job, tuned: Any, names: tuple[str, ...], graded: Held) -> None:
        self.job, self.names, self.graded = job, names, graded
        self.moves = [s.move() for s in tuned.ranking if s.name not in set(names)]
        self.last: tuple[ir.Model, Report, list[OutputCheck], tuple[str, ...]] | None = None

    def counts(self) -> list[int]:
        step = max(1, math.ceil(len(self.moves) / 4))
        return [*range(step, len(self.moves), step), len(self.moves)]

    def grade(self, k: int) -> bool:
        job, config = self.job, self.job.config
        wider = self.names + tuple(m.name for m in self.moves[:k])
        every = k == len(self.moves)  # every candidate float: the input unchanged
        what = "every node (the input unchanged)" if every else f"{len(wider)} node(s)"
        (job.progress or (lambda _msg: None))(
            f"the repair missed on the graded samples: keeping {what} float"
        )
        wide = input_unchanged(config) if every else _excluding(config, wider)
        work, report = quantize_once(job.source, wide, job.calib, job.progress, job.reuse)
        checks = checked(work, self.graded, config, job.how)
        self.last = (work, report, checks, wider)
        return all(c.passed for c in checks) or every


def _widened(
    job: Job, tuned: Any, names: tuple[str, ...], graded: Held
) -> tuple[ir.Model, Report, list[OutputCheck], tuple[str, ...]]:
    """The repair missed on the graded samples: keep more nodes float
    (:class:`_Widening`) until the graded samples pass. The graded samples only pick
    where to stop."""
    widening = _Widening(job, tuned, names, graded)
    climb(widening, widening.counts(), lambda lo, hi: None)  # growing steps, no narrowing
    assert widening.last is not None  # the last count always passes
    work, report, checks, wider = widening.last
    why = f"the repair ({len(names)} node(s) float) "
    why += "met the budget on the search samples " if tuned.passed else "missed the budget "
    if len(wider) - len(names) == len(widening.moves):
        why += "but no placement in the tuner's ranking met it on the graded ones: the input "
        why += "is written unchanged"
    else:
        why += f"but not on the graded ones: {len(wider) - len(names)} more kept float, in "
        why += "the tuner's ranking, until they passed (the graded samples chose only where "
        why += "to stop)"
    report.notes.append(why)
    return work, report, checks, wider


def tuner_or_input(
    source: onnx.ModelProto,
    config: QuantizeConfig,
    tuned: Any,
    data: tuple[Samples | None, Samples],
    progress: Say | None,
) -> tuple[ir.Model, Report]:
    """The speed plan's placement without the sensitive nodes missed the budget: the
    tuner's model (every other node INT8) when it is clearly faster than the input on
    this CPU (by ``config.speed``'s margin; :func:`mixprec.int8.speed.decide`), else the input
    unchanged. ``data`` is (calibration, held-out) samples."""
    calib, held = data
    if config.speed == "off":
        tuned.report.notes.append("the requantized model missed the budget: the tuner's is kept")
        return tuned.model, tuned.report
    original = copy_input(source)
    sessions = {
        "fp32": timing_session(source, config.runtime),
        "tuned": timing_session(tuned.model_proto, config.runtime),
    }
    shapes = {k: list(np.shape(v)) for k, v in feeds_for(original, held.first()).items()}
    feeds = latency_feeds(original, config, shapes)  # the speed plan's inputs
    decision = decide(time_paired(sessions, feeds), ["tuned"], margin=SPEED_MARGINS[config.speed])
    if decision.chosen == "tuned":
        tuned.report.notes.append(
            "the speed plan's placement without the sensitive nodes missed the budget; "
            f"the tuner's is kept: {decision.why}"
        )
        return tuned.model, tuned.report
    work, report = quantize_once(source, input_unchanged(config), calib, progress)
    report.notes.append(
        f"the tuner's accurate placement is not faster than the input ({decision.why}): "
        "the model stays float"
    )
    return work, report
