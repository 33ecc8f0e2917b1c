"""The driver of ``mixprec optimize``: build each candidate, check it, time it, choose.

1. The held-out samples (:func:`~mixprec.checks.guard_samples.split_for_guard`: ``eval_data``,
   else a seeded random half of the calibration samples, at most 64 or enough for 300
   rows) and the input's outputs on them in ONNX Runtime: every candidate is held to
   those, by the checks (:func:`~mixprec.checks.outputs.check_outputs`: each
   output's kind and the INT8 default budgets) or the user's metric. The INT8
   candidates' own guard ran on the same split; they are checked again here so that the
   table is uniform. A candidate that fits nothing to the data (the input in a runtime,
   under any precision hint) is checked on up to 64 calibration samples besides: no
   sample is in-sample for it, and more rows can confirm what it keeps.
2. Each candidate in order: skipped where it cannot run here (with why), built, checked,
   and, when accurate, timed beside the input (:mod:`mixprec.optimize.timing`, pruned
   once clearly slower than the best so far). One candidate's model is alive at a time
   besides the input and the accurate ones timed so far.
3. :func:`~mixprec.optimize.choice.choose` picks the winner from the table; where a
   later candidate, faster in the median, tied with the earlier one, the two are first
   timed beside each other (:meth:`~mixprec.optimize.timing.Timer.head_to_head`).

With ``device="cuda"``/``"tensorrt"`` the candidates and the baseline they are timed
beside are those of :mod:`mixprec.optimize.device` (the input, fp16 and bf16 on that
provider); the reference they are checked against stays the input in ONNX Runtime's CPU
provider.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import Samples, samples_of
from mixprec.checks.outputs import UserMetric, least_confirmed
from mixprec.core.errors import MixprecError
from mixprec.core.ops import parse_dtype
from mixprec.core.output_kinds import OutputKind
from mixprec.inputs.feeds import feeds_for, make_inputs, resolve_input_shapes
from mixprec.io.runtime_fields import RUNTIME_KEY, fp32_nodes, runtime_fields_of
from mixprec.optimize.candidates import (
    BASELINE,
    Candidate,
    select_candidates,
    skip_reason,
)
from mixprec.optimize.checked import GENERATED, HeldOut, held_out, tolerance
from mixprec.optimize.choice import GAIN, HeadToHead, Row, accuracy_text, choose, contender
from mixprec.optimize.device import (
    LOW_BUILDS,
    baseline_of,
    check_device,
    converted,
    device_candidates,
)
from mixprec.optimize.kept import KeptModels
from mixprec.optimize.metadata import stamp, unstamped
from mixprec.optimize.result import OptimizeResult, TimedAt
from mixprec.optimize.served import agreed_shapes, folded_ifs, written_static
from mixprec.optimize.timing import Timer, minimum_seconds
from mixprec.pipeline.marks import bf16_marked
from mixprec.pipeline.quantize import resolve_qconfig
from mixprec.repair.int8_guard import guarded_quantize
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import engine_for, runtime_hints
from mixprec.runtime.timing import MAJORITY
from mixprec.runtime.timing import session as timing_session
from mixprec.runtime.transformer_fusions import transformer_fused

__all__ = ["optimize_model"]

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]


#: Samples generated where no data is given (half held out to check the candidates).
GENERATED_SAMPLES = 8
NEEDS_DATA = "INT8 needs representative data: give --calibration-data"


@dataclass(frozen=True)
class _Job:
    """What every candidate is built from: the input, its samples, threads, progress."""

    source: onnx.ModelProto
    calibration: Samples
    eval_data: Samples | None
    threads: int
    metric: UserMetric | None
    say: Say
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    device: str = "cpu"
    #: The user's readings of outputs (``--output-kind``), and whether passes the held-out
    #: rows cannot confirm count (``--accept-unconfirmed``).
    kinds: dict[str, OutputKind] = dataclasses.field(default_factory=dict)
    accept_unconfirmed: bool = False
    #: No data was given: the samples are generated, INT8 is not tried, and every
    #: candidate is held to convert's tolerance for its precision.
    generated: bool = False
    #: What OpenVINO's candidates start from where it differs from ``source``: its Ifs
    #: folded at the one shape every sample has (:func:`folded_ifs`).
    ov_source: onnx.ModelProto | None = None


def _built(job: _Job, candidate: Candidate) -> tuple[onnx.ModelProto | None, str]:
    """The candidate's model and a note on how it was built (None: nothing to try, and
    the note says why)."""
    source = job.source
    if candidate.runtime == "openvino" and job.ov_source is not None:
        source = job.ov_source
    if candidate.build == "input":
        return source, ""
    if callable(candidate.build):
        return candidate.build(source), ""
    if candidate.build == "ort-fusions":
        return transformer_fused(source)
    if isinstance(candidate.build, str) and candidate.build in LOW_BUILDS:
        built = converted(source, candidate.build, job.calibration)
        return built, f"mixprec.convert to {parse_dtype(candidate.build)}, its default lists"
    if candidate.build == "bf16-marks":
        proto, report = bf16_marked(source, job.calibration)
        kept = len(fp32_nodes(proto) or [])
        return proto, f"{kept} of {len(report.nodes)} nodes marked to stay FP32"
    if candidate.build != "int8":
        raise MixprecError(f"candidate {candidate.name!r}: unknown build {candidate.build!r}")
    options = candidate.options(job.threads)
    # an unconfirmed INT8 pass comes back as INT8: optimize judges confirmation itself,
    # on its own held-out rows (:class:`Row`), and its table says so
    # the speed plan keeps the fastest placement not slower than the input (speed
    # "compete"): optimize's own loop then judges it against the others by its intervals
    fields: dict[str, Any] = {"runtime": options, "accept_unconfirmed": True, "speed": "compete"}
    if job.shapes:  # the speed plan times its placements at the serving shape too
        fields["latency_shapes"] = {k: tuple(v) for k, v in job.shapes.items()}
    if job.metric is not None:
        fields.update(metric=job.metric.score, metric_budget=job.metric.budget)
    if job.kinds:  # the guard inside reads the outputs as the candidates are checked
        fields["output_kinds"] = job.kinds
    config = resolve_qconfig(None, fields)
    work, report = guarded_quantize(source, config, job.calibration, job.eval_data, job.say)
    summary = str((report.guard or {}).get("summary", ""))
    if not report.unchanged:
        return ir.to_proto(work), summary
    speed = (report.quantization or {}).get("speed") or {}
    if isinstance(speed, dict) and speed.get("chosen") == "fp32":
        why = no_faster_placement(options)
    else:
        why = summary or "the accuracy guard kept every node float"
    return None, f"no node runs in INT8: {why}"


def no_faster_placement(options: RuntimeOptions) -> str:
    """Why the speed plan left every node float, naming what it timed against: the input
    in the runtime, under the candidate's precision hint where it has one."""
    against = "FP32"
    if options.precision not in (None, "f32"):
        against = f"the input under the {options.precision} hint"
    return f"the speed plan found no INT8 placement faster than {against} in {options.name}"


def _row(
    job: _Job, held: HeldOut, candidate: Candidate, timer: Timer, bar: float | None
) -> tuple[Row, onnx.ModelProto | None]:
    """The candidate's row (and its model where it may win)."""
    options = candidate.options(job.threads)
    hints = runtime_hints(options)
    why = skip_reason(candidate)
    if why is None and job.generated and candidate.build == "int8":
        why = NEEDS_DATA
    if why is not None:
        return Row(candidate.name, candidate.runtime, hints, "skipped", note=why), None
    job.say(f"{candidate.name}: building")
    try:
        proto, note = _built(job, candidate)
        if proto is None:
            return Row(candidate.name, candidate.runtime, hints, "skipped", note=note), None
        job.say(f"{candidate.name}: checking on {len(held.feeds)} sample(s) ({held.how})")
        checks = held.check(proto, options, tolerance(candidate, job.generated))
    except MixprecError as e:  # the runtime cannot load or run it: a failed candidate
        return Row(candidate.name, candidate.runtime, hints, "failed", note=str(e)), None
    # FP32 in any runtime only rounds differently: its passes need no confirming rows
    confirm = not candidate.fp32
    row = Row(
        candidate.name, candidate.runtime, hints, checks=checks, note=note,
        confirm=confirm, accepted=job.accept_unconfirmed,
    )  # fmt: skip
    if not row.accurate:
        return dataclasses.replace(row, status="inaccurate"), None
    baseline = baseline_of(job.device)
    if candidate.name == baseline:
        return dataclasses.replace(row, status="baseline"), proto
    job.say(f"{candidate.name}: timing against {baseline}")
    try:
        timing = timer.time(timing_session(proto, options), bar)
    except MixprecError as e:  # RuntimeLoadError / RuntimeRunError in a timing session
        return dataclasses.replace(row, status="failed", note=str(e)), None
    if timing is None:
        left = "not timed: the time budget ran out"
        return dataclasses.replace(row, status="not timed", note=left), None
    return dataclasses.replace(row, timing=timing), proto


def _baseline_first(chosen: Sequence[Candidate], device: str) -> list[tuple[Candidate, bool]]:
    """The candidates with whether the caller listed them: the input in ONNX Runtime (on
    ``device``) is always in the table (the reference), listed or not."""
    listed = [(c, True) for c in chosen]
    first = device_candidates(device)[0]
    if all(c.name != first.name for c in chosen):
        listed.insert(0, (first, False))
    return listed


def optimize_model(
    source: onnx.ModelProto,
    calibration_data: Any,
    eval_data: Any = None,
    *,
    candidates: Sequence[str | Candidate] | None = None,
    runtime: str = "auto",
    threads: int = 2,
    metric: UserMetric | None = None,
    time_budget: float | None = None,
    progress: Say | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    device: str = "cpu",
    output_kinds: Mapping[str, OutputKind] | None = None,
    accept_unconfirmed: bool = False,
) -> OptimizeResult:
    """Tries the candidates on ``source`` (the input as loaded); the winner's model is
    the input itself when nothing beat it. Arguments as :func:`mixprec.optimize` takes
    them (``output_kinds`` checked: :func:`~mixprec.core.readings.user_kinds`)."""
    chosen = _checked_arguments(candidates, runtime, threads, time_budget, device)
    say = progress or (lambda _msg: None)
    earlier = runtime_fields_of(source)
    source = unstamped(source)  # the input runs in ONNX Runtime: an earlier stamp goes
    model = ir.from_proto(source)
    given = _serving_shapes(model, shapes)
    calibration = samples_of(calibration_data, model)
    generated = calibration is None
    if calibration is None:
        if metric is not None:
            raise MixprecError("metric needs samples to score: give calibration_data")
        calibration = samples_of(_generated(model, given), model)
        assert calibration is not None
    evals = samples_of(eval_data, model, "eval_data")
    kinds, accept = dict(output_kinds or {}), bool(accept_unconfirmed)
    job = _Job(source, calibration, evals, threads, metric, say, given, device, kinds, accept)
    job = dataclasses.replace(job, generated=generated)
    say("running the input in ONNX Runtime on the held-out samples")
    held, wide = held_out(
        source, model, (calibration, evals), threads=threads, metric=metric, kinds=kinds,
        generated=generated,
    )  # fmt: skip
    feeds = _timing_feeds(model, calibration.first(), given)
    static = agreed_shapes(feeds, [*calibration, *(evals or [])])
    ov_source, folded = folded_ifs(source, static)
    job = dataclasses.replace(job, ov_source=ov_source)
    base = device_candidates(device)[0]
    timed = [c for c in chosen if c.name != base.name and skip_reason(c) is None]
    timer = Timer(timing_session(source, base.options(threads)), feeds, time_budget, len(timed) + 1)
    _check_budget(time_budget, timer.run_seconds)
    control = timer.time(timing_session(source, base.options(threads)), None) if timed else None
    rows, models = _tried(job, (held, wide or held), _baseline_first(chosen, device), timer)
    duel = _head_to_head(rows, models, chosen, timer, job, base.name)
    winner, table = choose(rows, base.name, duel)
    notes = [_where(held, feeds, threads, base)]
    if duel is not None:
        notes.append(duel.text())
    if wide is not None:
        notes.append(
            f"the input in each runtime (it fits nothing to the data) checked on "
            f"{len(wide.feeds)} sample(s): the held-out ones and calibration ones"
        )
    if control is not None:
        notes.append(
            f"control: a second session of the input, timed as the candidates were, measured "
            f"{control.shown} (this run's noise floor)"
        )
    if earlier:
        notes.append(
            f"the input's own {RUNTIME_KEY}={earlier.get(RUNTIME_KEY)!r} (an earlier "
            "optimize's) is not carried over: the output's fields say how it runs"
        )
    won = next(c for c, _ in _baseline_first(chosen, device) if c.name == winner)
    options = won.options(threads)
    summary = _summary(winner, table, options, base.name) + _unconfirmed(table)
    if generated:
        summary += f"; {NEEDS_DATA}"
        notes.append(f"no data given: {GENERATED_SAMPLES} generated samples, {GENERATED}")
    at = TimedAt({k: [int(d) for d in np.shape(v)] for k, v in feeds.items()}, threads)
    unchanged = winner == BASELINE  # the input in ONNX Runtime's CPU provider: no fields
    model = source if winner in (BASELINE, base.name) else models[winner]
    models.close()
    if folded:
        notes.append(folded)
    if not unchanged and options.name == "openvino":  # where a plain compile gets the ratio
        model, fixed = written_static(model, at.shapes, held.feeds, bool(given))
        summary += f"; {folded}" if folded else fixed
    return OptimizeResult(
        model if unchanged else stamp(model, options), options, winner, table, summary,
        unchanged, notes=notes, control=control, timed_at=at, head_to_head=duel,
    )  # fmt: skip


def _generated(model: ir.Model, shapes: Mapping[str, list[int]]) -> list[Feeds]:
    """:data:`GENERATED_SAMPLES` seeded generated inputs (as convert makes them), at the
    serving ``shapes`` where given."""
    return [make_inputs(model, shapes=shapes, seed=k)[0] for k in range(GENERATED_SAMPLES)]


def _tried(
    job: _Job,
    checked: tuple[HeldOut, HeldOut],
    candidates: Sequence[tuple[Candidate, bool]],
    timer: Timer,
) -> tuple[list[Row], KeptModels]:
    """Every candidate's row, in order, and the models of the listed ones that may win;
    each timed one that would win sets the bar later ones are pruned against.
    ``checked``: the held-out samples, and those a candidate that fits nothing to the
    data (:attr:`Candidate.fits_nothing`) is checked on (:func:`held_out`)."""
    rows: list[Row] = []
    models = KeptModels(job.source)
    bar: float | None = None
    for candidate, listed in candidates:
        held = checked[1] if candidate.fits_nothing else checked[0]
        row, proto = _row(job, held, candidate, timer, bar)
        rows.append(dataclasses.replace(row, listed=listed))
        t = row.timing
        if proto is not None and listed:
            models.keep(row.name, proto)
        del proto  # a kept model waits on disk while the next candidate is built
        if t is not None and t.ratio <= 1.0 - GAIN and t.faster_share >= MAJORITY:
            bar = t.ratio if bar is None else min(bar, t.ratio)
    return rows, models


def _head_to_head(
    rows: Sequence[Row],
    models: Mapping[str, onnx.ModelProto],
    chosen: Sequence[Candidate],
    timer: Timer,
    job: _Job,
    base: str,
) -> HeadToHead | None:
    """Where a later candidate tied with the earlier one that would win
    (:func:`~mixprec.optimize.choice.contender`): the two timed beside each other; None
    where there is no such tie."""
    pair = contender(rows, base)
    if pair is None or not all(name in models for name in pair):
        return None
    earlier, later = (next(c for c in chosen if c.name == name) for name in pair)
    job.say(f"{later.name}: tied with {earlier.name}, timing the two head to head")
    try:
        timing = timer.head_to_head(
            timing_session(models[earlier.name], earlier.options(job.threads)),
            timing_session(models[later.name], later.options(job.threads)),
        )
    except MixprecError as e:  # the sessions ran before: a failure here is a real one
        job.say(f"head to head not timed: {e}")
        return None
    return HeadToHead(earlier.name, later.name, timing)


def _serving_shapes(
    model: ir.Model, shapes: Mapping[str, Sequence[int]] | None
) -> dict[str, list[int]]:
    """``shapes`` checked against the model's inputs (names, rank, fixed dims); one
    error line for a bad one, before any work."""
    if not shapes:
        return {}
    if not isinstance(shapes, Mapping):
        raise MixprecError(f"shapes must map input names to dims, not {type(shapes).__name__}")
    given = {str(k): [int(d) for d in v] for k, v in shapes.items()}
    resolve_input_shapes(model, given)  # raises on an unknown name or a clash
    return given


def _timing_feeds(
    model: ir.Model, first: Mapping[str, Any], shapes: Mapping[str, list[int]]
) -> Feeds:
    """What every candidate is timed on: the first calibration sample, or, with serving
    ``shapes``, inputs generated at them (the sample's shapes for the other inputs)."""
    feeds = feeds_for(model, first)
    if all(k in feeds and list(np.shape(feeds[k])) == v for k, v in shapes.items()):
        return feeds  # the sample is at the serving shape already
    at = {**{k: list(np.shape(v)) for k, v in feeds.items()}, **shapes}
    generated, _ = make_inputs(model, shapes=at, seed=0)
    return feeds_for(model, generated)


def _unconfirmed(table: Sequence[Row]) -> str:
    """What the last line adds where a candidate lost for a pass its rows cannot
    confirm: the first such, and the rows that would confirm it."""
    for row in table:
        if row.verdict == "inaccurate" and row.passed and row.unconfirmed:
            weakest = least_confirmed(row.unconfirmed)
            return (
                f"; {row.name} passed unconfirmed and was not taken: {weakest.to_confirm()} "
                "(--accept-unconfirmed takes it)"
            )
    return ""


def _summary(winner: str, table: Sequence[Row], options: RuntimeOptions, base: str) -> str:
    """The last line: who won, by how much, how accurate, and how it runs (``base``: the
    baseline, the input in ONNX Runtime on the device asked for)."""
    row = next(r for r in table if r.name == winner)
    hints = runtime_hints(options)
    how = f"mixprec.runtime={options.name}"
    if hints:
        how += f", mixprec.runtime_hints={json.dumps(hints, sort_keys=True)}"
    if winner == base:
        written = "written unchanged" if base == BASELINE else f"written with {how}"
        where = "in ONNX Runtime" if base == BASELINE else f"on {options.provider}"
        if not row.accurate:  # the user's metric, whose budget the FP32 model misses
            return (
                f"the input itself misses the budget ({accuracy_text(row.checks)}): no "
                f"candidate can meet it; the input is {written}"
            )
        if row.listed:
            return f"no candidate beats the input {where} ({base}): the input is {written}"
        return f"no candidate is accurate and timed: the input is {written}"
    versus = "ORT FP32" if base == BASELINE else base
    return (
        f"{winner} wins: {row.ratio or 1.0:.2f}x {versus}, {accuracy_text(row.checks)}; "
        f"written with {how}"
    )


def _checked_arguments(
    candidates: Sequence[str | Candidate] | None,
    runtime: str,
    threads: int,
    time_budget: float | None,
    device: str,
) -> tuple[Candidate, ...]:
    """The candidates to try; one error line for a bad argument, before any work."""
    if not isinstance(device, str):
        raise MixprecError(f"device must be a name (cpu, cuda, tensorrt), not {device!r}")
    pool = device_candidates(device)  # raises on an unknown device
    if runtime not in ("auto", "ort") and device != "cpu":
        raise MixprecError(
            f"device {device!r} runs in ONNX Runtime (its {device} provider), not in {runtime}"
        )
    chosen = select_candidates(candidates, runtime, pool)
    elsewhere = [c.name for c in chosen if device != "cpu" and c.provider != device]
    if elsewhere:
        raise MixprecError(
            f"candidate {elsewhere[0]!r} does not run on the device asked for ({device}): "
            f"give it provider={device!r}"
        )
    check_device(device)  # a device the user names must be here
    if runtime != "auto":
        engine_for(runtime)  # a runtime the user names must be here
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise MixprecError(f"threads must be an int >= 0 (0: all cores), not {threads!r}")
    if time_budget is not None:
        if isinstance(time_budget, bool) or not isinstance(time_budget, int | float):
            raise MixprecError(f"time_budget must be a number of seconds, not {time_budget!r}")
        _check_budget(time_budget, 0.0)
    return chosen


def _check_budget(time_budget: float | None, run_seconds: float) -> None:
    """A time budget must time at least one candidate (:func:`minimum_seconds`)."""
    if time_budget is None:
        return
    least = minimum_seconds(run_seconds)
    if not math.isfinite(time_budget) or time_budget < least:
        raise MixprecError(
            f"time budget {time_budget:g} s is too small to time any candidate on this model: "
            f"give at least {math.ceil(least * 10) / 10:g} s"
        )


def _where(held: HeldOut, feeds: Feeds, threads: int, base: Candidate) -> str:
    shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in feeds.items())
    how = "the user's metric" if held.metric is not None else "the guard's checks"
    beside, bound = "beside it", ""
    if base.provider is not None:
        beside = f"beside the input on {base.provider} ({base.name})"
        bound = ", the feeds bound on the device (copies not timed)"
    return (
        f"each candidate checked on {len(held.feeds)} sample(s) ({held.how}) against the "
        f"input in ONNX Runtime by {how}, and timed {beside} at {shapes} with {threads} "
        f"thread(s){bound}"
    )
