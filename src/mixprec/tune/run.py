"""The tuner's driver: one loaded model, one target, one budget -> a :class:`TuneResult`.

Prepare and calibrate run once on the data (or not at all: the INT8 guard's repair hands
over the first quantization's calibrated model); the FP32 outputs are the reference; the
calibrated model annotated with the default policy names the candidates; the
:class:`~mixprec.tune.search.Search` picks the nodes that go back to float; the chosen
model is finished (cleanup, check) and reported through the pipeline's public report
functions. :func:`mixprec.tune` (in :mod:`mixprec.api.tune`) loads the model and writes
the log dir around it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.user_metric import Candidate, Labels
from mixprec.core.errors import MixprecError
from mixprec.core.output_kinds import classify_outputs
from mixprec.inputs.feeds import (
    calibration_feeds,
    feeds_for,
    guessed_dims,
    iter_calibration_npz,
    make_inputs,
    resolve_input_shapes,
)
from mixprec.pipeline.convert import report_stages
from mixprec.pipeline.quantize import fill_report
from mixprec.pipeline.report import Report
from mixprec.runtime.engine import RuntimeOptions, runtime_names
from mixprec.runtime.engines import engine_for, run_model
from mixprec.runtime.fit import fit_shapes
from mixprec.tune.metrics import Metric, resolve_budget, resolve_metric, score_budget
from mixprec.tune.result import TuneResult
from mixprec.tune.search import Search
from mixprec.tune.sensitivity import NodeSensitivity, measure_sensitivity, rank
from mixprec.tune.targets import FloatTarget, Int8Target

__all__ = ["SENSITIVITY_SAMPLES", "TuneRequest", "candidate_runtime", "tune_model"]

logger = logging.getLogger(__name__)

#: Samples the instrumented run uses (errors are pooled over them).
SENSITIVITY_SAMPLES = 2
#: The give-back refinement (heavy float nodes handed back one at a time) stops once the
#: tuning has taken this many times an estimated plain conversion...
REFINE_TIME_FACTOR = 6.0
#: ... but they always get this many seconds.
REFINE_MIN_SECONDS = 5.0

Data = Mapping[str, Any] | Iterable[Mapping[str, Any]] | str | os.PathLike[str] | None


@dataclass(frozen=True)
class TuneRequest:
    """What one tuning run is asked: the target, the data, the metric and its budget, and
    the runtime its candidates run in (``runtime`` None: ONNX Runtime's CPU provider, or
    the engine a float target's mode names, e.g. "openvino"; given, the FP32 reference
    runs there too)."""

    target: FloatTarget | Int8Target
    data: Data
    metric: str | Callable[..., float] = "rel-l2"
    budget: float | str | None = None
    metric_budget: float | None = None
    calibration_data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None
    max_evaluations: int | None = None
    threads: int = 2
    shapes: Any = None
    runtime: RuntimeOptions | None = None


def candidate_runtime(request: TuneRequest) -> RuntimeOptions:
    """Where the candidates of ``request`` run (see :class:`TuneRequest`)."""
    if request.runtime is not None:
        return request.runtime
    mode = getattr(request.target, "mode", None)
    name = mode if mode in runtime_names() else RuntimeOptions().name
    return RuntimeOptions(name=name, threads=request.threads)


def _reference_runtime(request: TuneRequest) -> RuntimeOptions:
    """Where the FP32 reference runs: the request's runtime, else ONNX Runtime's CPU
    provider, with basic graph optimizations."""
    chosen = request.runtime or RuntimeOptions(threads=request.threads)
    return dataclasses.replace(chosen, optimization="basic")


def load_samples(data: Data, model: ir.Model, shapes: Any) -> list[dict[str, np.ndarray]]:
    """The tuning data as a list of feed dicts (it is run many times); None generates
    one sample from the signature, with a warning."""
    if data is None:
        logger.warning(
            "tune: no data given: one generated sample; budgets measured on it say little "
            "about real inputs"
        )
        return [_generated_sample(model, shapes)]
    if isinstance(data, str | os.PathLike):
        return list(iter_calibration_npz(data, model, labels=True))
    found = calibration_feeds(data)
    samples = list(found) if found is not None else []
    if not samples:
        raise MixprecError("tune needs data: at least one sample (a dict of input arrays)")
    return samples


def _generated_sample(model: ir.Model, shapes: Any) -> dict[str, np.ndarray]:
    """One generated sample the model runs on (the calibration's rule: the first guess,
    then what the runtime's refusals teach, :func:`~mixprec.runtime.fit.fit_shapes`)."""
    first, _ = resolve_input_shapes(model, shapes)
    proto = ir.to_proto(model)
    basic = RuntimeOptions(optimization="basic")

    def attempt(tried: dict[str, list[int]]) -> dict[str, np.ndarray]:
        feeds, _ = make_inputs(model, shapes=tried, seed=0)
        run_model(proto, feeds, basic)  # raises RuntimeRunError when refused
        return feeds

    feeds, _, notes = fit_shapes(first, guessed_dims(model, shapes), attempt)
    for note in notes:
        logger.info("tune: %s", note)
    return feeds


def _reference(
    fp32: onnx.ModelProto,
    samples: list[dict[str, np.ndarray]],
    metric: Metric,
    options: RuntimeOptions,
) -> tuple[list[dict[str, np.ndarray]], float | None]:
    """The FP32 model's outputs on every sample, and a callable metric's FP32 score."""
    session = engine_for(options).session(fp32, options)
    reference = [session.run(s) for s in samples]
    score = None
    if metric.user is not None:
        score = float(metric.user(Candidate(fp32, session, samples)))
    return reference, score


def _search(
    request: TuneRequest,
    calibrated: ir.Model,
    samples: list[dict[str, np.ndarray]],
    say: Callable[[str], None],
    labels: Labels | None = None,
) -> tuple[Search, int]:
    """The search over the candidates of ``calibrated`` annotated with the default policy,
    its budget resolved against the FP32 reference (the user's own score: its lowest
    accepted value, given the samples' ``labels``); and the candidate count."""
    target, threads = request.target, request.threads
    metric = resolve_metric(request.metric, request.metric_budget, classify_outputs(calibrated))
    fp32 = ir.to_proto(calibrated)
    reference, reference_score = _reference(fp32, samples, metric, _reference_runtime(request))
    # annotated in place (tune_model's ``work`` is a private copy): not a protobuf copy
    # of the weights kept beside it through the search (MiniLM: 90 MB at its peak)
    del fp32
    base = target.pipeline((), check=False).run(calibrated, start="annotate", until="annotate")
    candidates = target.candidates(base)

    def measure() -> list[NodeSensitivity]:
        say(f"measuring the sensitivity of {len(candidates)} candidate node(s)")
        # The annotated model still computes in FP32 (bf16: at the raised opset, where
        # Cast takes bfloat16).
        rounder = target.rounder(base)
        some = samples[:SENSITIVITY_SAMPLES]
        return rank(
            measure_sensitivity(
                base, candidates, rounder, some, threads=threads, runtime=request.runtime
            )
        )

    search = Search(
        target, base, list(candidates), measure, metric, samples, reference, None,
        request.max_evaluations, threads, candidate_runtime(request),
    )  # fmt: skip
    if metric.score is not None and request.metric_budget is not None:
        if request.budget is not None:
            raise MixprecError("give budget= (a built-in metric) or metric_budget=, not both")
        search.budget = score_budget(metric, request.metric_budget)
        search.labels = labels
    else:
        search.budget = resolve_budget(metric, request.budget, target.name, reference_score)
    return search, len(candidates)


def tune_model(
    work: ir.Model,
    input_kind: str,
    request: TuneRequest,
    progress: Callable[[str], None] | None = None,
    started: float | None = None,
    calibrated_seconds: float | None = None,
) -> TuneResult:
    """Tune ``work`` (a private copy, changed in place) as ``request`` asks; ``started``
    is when the call began (``time.perf_counter()``), for the time budget and the result's
    seconds. ``calibrated_seconds``: ``work`` is already prepared and calibrated with the
    target's options on the request's calibration data (the guard's repair hands the first
    quantization's), taking that long; it is not calibrated again."""
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter() if started is None else started
    samples = load_samples(request.data, work, request.shapes)
    if calibrated_seconds is None:
        say(f"preparing and calibrating on {len(samples)} sample(s)")
        data = request.calibration_data if request.calibration_data is not None else samples
        pipeline = request.target.pipeline((), data, check=False)
        calibrated = pipeline.run(work, until="calibrate")
        plain = sum(pipeline.timings.values())
    else:
        calibrated, plain = work, calibrated_seconds
    inputs = {v.name for v in calibrated.graph.inputs}
    labels = [{k: v for k, v in s.items() if k not in inputs} for s in samples]
    samples = [feeds_for(calibrated, s) for s in samples]  # cast once to the input dtypes
    search, n = _search(request, calibrated, samples, say, labels)
    say(f"searching over {n} candidate(s)")
    subset = max(1, len(samples) // 4) if len(samples) >= 4 else 0
    # The give-back refinement stops once tuning has taken REFINE_TIME_FACTOR times a
    # plain conversion (estimated: prepare + calibrate, plus 30% for the other stages).
    # Never under REFINE_MIN_SECONDS: on a tiny model the estimate is a few hundredths of
    # a second, and the result would then depend on the machine's load.
    # a reused calibration counts in the estimate, not in the result's seconds
    start = t0 - (calibrated_seconds or 0.0)
    elapsed = time.perf_counter() - start
    search.deadline = start + max(REFINE_MIN_SECONDS, REFINE_TIME_FACTOR * 1.3 * elapsed)
    best = search.run(subset)
    say("finishing the chosen model")
    t = time.perf_counter()
    moved = best if best is not None else tuple(search.order)
    final, share = search.build(moved, finish=True)
    plain += time.perf_counter() - t
    result = _result(final, input_kind, search, best, n, share)
    result.plain_seconds = plain
    result.seconds = time.perf_counter() - t0
    return result


def _result(
    final: ir.Model,
    input_kind: str,
    search: Search,
    best: tuple[str, ...] | None,
    n: int,
    share: float,
) -> TuneResult:
    """The result of a finished search: the chosen model, its report, the path taken."""
    target = search.target
    report = Report(target=target.name)
    if target.int8:
        fill_report(report, search.last_pipeline, final)
    else:
        report_stages(report, search.last_pipeline.stages, final)
    step = next((st for names, st in search.passing if names == best), None)
    if best is None:
        step = search.full.get(n)
    result = TuneResult(
        final,
        report,
        input_kind,
        target=target.name,
        metric=search.metric.name,
        budget=search.budget,
        achieved=step.value if step is not None else None,
        passed=best is not None,
        kept_float=[s for s in search.ranked if s.name not in search.last_low],
        ranking=search.ranked,
        candidates=n,
        evaluations=dict(search.counts),
        path=list(search.path),
        low_mac_share=share,
        samples=len(search.samples),
    )
    result.message = _message(result, n, best, search)
    report.notes.append(f"tune: {result.message}")
    return result


def _message(result: TuneResult, n: int, best: tuple[str, ...] | None, search: Search) -> str:
    text = result.budget.text if result.budget else "the budget"
    if best == ():
        return f"every candidate stays {result.target}: the all-low model meets {text}"
    if best is not None:
        followed = len(result.kept_float) - len(best)
        more = f" (+{followed} that painting then kept float)" if followed > 0 else ""
        return f"{len(best)} of {n} candidate node(s) moved back to float{more} to meet {text}"
    all_float = search.full.get(n)
    if all_float is not None and not all_float.passed:
        return (
            f"not met: even the all-float model misses {text} "
            f"({result.metric} {all_float.value:.6g}); returned the all-float model"
        )
    return (
        f"not met: stopped after max_evaluations={search.max_evaluations} evaluations "
        f"without a model shown to meet {text}; returned the all-float model, not evaluated"
    )
