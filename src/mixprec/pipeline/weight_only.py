"""Weight-only INT4/INT8, composed: prepare -> select -> quantize and apply -> cleanup ->
check (ONNX checker) -> the model loads and runs in ONNX Runtime -> the output check.

The stages are the shared :class:`~mixprec.pipeline.stages.Pipeline`'s with the weight
passes swapped in: ``annotate`` is :class:`~mixprec.weights.select.SelectWeightsPass`,
``apply`` is :class:`~mixprec.weights.apply.QuantizeWeightsPass`. RTN reads no data, so
``calibrate`` does not run; a data-aware method's statistics pass goes there.

**The guard hook.** After quantizing, :func:`run_weights` hands the model to a
:data:`WeightsGuard`: ``guard(model, report, context) -> (model, report)``. The guards
live in :mod:`mixprec.repair`: each output against FP32
(:func:`mixprec.repair.weights_guard.output_check`), or a language model's next-token guard
(:mod:`mixprec.repair.language_guard`), which repairs through ``context.requantize(config)``
(e.g. a ``layers`` map with the worst layers at 8 bits).

**Models with external data** keep their weights memory-mapped; **streamed** ones (over
2 GB of external data) are also run in pieces by the checks: :mod:`mixprec.pipeline.streamed`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.core.policy import default_policy
from mixprec.inputs.feeds import calibration_feeds, feeds_for, iter_calibration_npz, make_inputs
from mixprec.io.external import release_mapped_pages
from mixprec.passes.cleanup import annotated_values
from mixprec.pipeline.convert import CalibrationData, notes_about_input, param_bytes
from mixprec.pipeline.report import NodeReport, Report
from mixprec.pipeline.stages import Pipeline, Stage
from mixprec.pipeline.streamed import (
    ModelRuns,
    Source,
    streamed_note,
    streams,
    work_copy,
)
from mixprec.weights.apply import QuantizeWeightsPass, QuantizeWeightsResult
from mixprec.weights.config import WeightsConfig
from mixprec.weights.methods import WeightMethod, resolve_method
from mixprec.weights.mixed_bits import plan_layers
from mixprec.weights.select import SelectWeightsPass, weight_decision
from mixprec.weights.stats import WeightsData

__all__ = [
    "CHECK_SAMPLES",
    "GuardContext",
    "WeightsGuard",
    "WeightsPipeline",
    "WeightsReport",
    "let_go",
    "quantize_weights_once",
    "run_weights",
]

Say = Callable[[str], None]
#: At most this many samples are run for the output check.
CHECK_SAMPLES = 4
#: Output IR versions are lowered to this (or to what the opsets need, if more): ONNX
#: Runtime 1.31 refuses IR 14, which onnx 1.23 writes by default.
_LOADABLE_IR = 10


class WeightsPipeline(Pipeline):
    """The staged pipeline with the weight-only select and apply stages."""

    messages: ClassVar[Mapping[str, str]] = {
        "annotate": "choosing the weights to quantize",
        "apply": "quantizing the weights (MatMulNBits, GatherBlockQuantized)",
    }

    def __init__(self, config: WeightsConfig, method: WeightMethod, **kwargs: Any) -> None:
        base = ConvertConfig(
            policy=default_policy("fp16"),
            calibrate=False,
            shapes=config.shapes,
            fold_batchnorm=False,
            upgrade_opset=False,
            check=config.check,
            log_dir=config.log_dir,
        )
        super().__init__(base, **kwargs)
        self.weights = config
        self.method = method

    def build(self, name: str, model: ir.Model) -> Stage:
        if name == "annotate":
            return Stage(name, SelectWeightsPass(self.weights))
        if name == "apply":
            apply = QuantizeWeightsPass(self.weights, self.method)
            return Stage(name, apply, common.RemoveUnusedNodesPass())
        return super().build(name, model)


@dataclasses.dataclass
class WeightsReport(Report):
    """The report of a weight-only run (its summary reads differently from fp16/INT8)."""

    def format_summary(self, *, max_fp32: int = 25) -> str:
        q = self.quantization or {}
        weighted = [n for n in self.nodes if n.op_class != "none"]  # not activations
        rows = _count_rows(weighted)
        rows += [
            ("blocks", f"{q.get('block_size')} weights, {q.get('scheme')}, {q.get('method')}"),
            ("accuracy_level", "; ".join(_levels(q))),
            ("parameter bytes", _bytes_row(self.param_bytes_before, self.param_bytes_after)),
        ]
        if self.timings:
            rows.append(("time", f"{sum(self.timings.values()):.2f} s"))
        width = max(len(k) for k, _ in rows)
        lines = [f"mixprec: {self.target} (MatMulNBits / GatherBlockQuantized), activations float"]
        lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
        kept = [n for n in weighted if n.precision == "fp32"]
        if kept:
            lines.append(f"kept float ({len(kept)} nodes), by reason:")
            by_reason = Counter(n.reason for n in kept)
            for reason, k in by_reason.most_common(max_fp32):
                names = [n.name or n.op_type for n in kept if n.reason == reason]
                more = f", +{len(names) - 3}" if len(names) > 3 else ""
                lines.append(f"  {k:4d}  {reason}: {', '.join(names[:3])}{more}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _levels(quantization: Mapping[str, object]) -> list[str]:
    levels = quantization.get("levels")
    if not isinstance(levels, Mapping):
        return []
    return [f"{why} for {', '.join(k for k, w in levels.items() if w == why)}"
            for why in dict.fromkeys(levels.values())]  # fmt: skip


def _count_rows(nodes: list[NodeReport]) -> list[tuple[str, str]]:
    rows = []
    for op, label in (("MatMul", "MatMul weights"), ("Gather", "embedding tables")):
        counts = Counter(n.precision for n in nodes if n.op_type == op)
        if counts:
            text = ", ".join(f"{k} {_LABELS.get(p, p)}" for p, k in sorted(counts.items()))
            shared = sum(1 for n in nodes if n.op_type == op and _SHARED in n.reason)
            rows.append(
                (label, text + (f" ({shared} sharing the lm_head's codes)" if shared else ""))
            )
    return rows or [("MatMul weights", "none")]


#: What a tied embedding's reason says (:func:`mixprec.weights.select`).
_SHARED = "shares the lm_head's"
_LABELS = {"fp32": "float"}


def _bytes_row(before: int, after: int) -> str:
    ratio = f" ({after / before:.2f}x)" if before else ""
    return f"{before / 1e6:.2f} MB -> {after / 1e6:.2f} MB{ratio}"


def quantize_weights_once(
    source: Source,
    config: WeightsConfig,
    method: WeightMethod,
    progress: Say | None,
    data: WeightsData | None = None,
) -> tuple[ir.Model, WeightsReport]:
    """One weight-only quantization of ``source`` (the input as loaded, external data
    read or mapped), without checks. The work model shares ``source``'s weight bytes (no
    copy): the passes replace tensors, never write into them, so ``source`` stays as given.
    ``data``: the calibration samples a data-aware method and the sensitivity ranking
    read (their statistics are collected once and kept in it for a requantization)."""
    work = work_copy(source)
    target = f"{config.precision} weights"  # not "int8": that is INT8 with activations
    report = WeightsReport(target=target, policy={"weights": config_dict(config)})
    report.notes.extend(notes_about_input(work))
    report.param_bytes_before = param_bytes(work)
    pipeline = WeightsPipeline(config, method, progress=progress)
    pipeline.keep_annotations = annotated_values(work)
    work = pipeline.run(work, until="prepare")
    # no calibrate stage: the layer statistics need the select pass's decisions first
    work = pipeline.run(work, start="annotate", until="annotate")
    clock = time.perf_counter()
    # The layer statistics (X^T X of every MatMul input) are collected for a data-aware
    # method only: for RTN's mixed bits they cost more than the quantization itself (on
    # SmolLM2-135M, 32 windows of 256 tokens: over 10 minutes on 2 cores), and the ranking
    # falls back to the weights' own error.
    notes, mixed = plan_layers(work, config, method, data if method.needs_data else None)
    planned = time.perf_counter() - clock
    report.notes.extend(notes)
    work = pipeline.run(work, start="apply")
    report.timings = dict(pipeline.timings)
    report.timings["statistics and sensitivity"] = planned
    applied = pipeline.stages["apply"].result(QuantizeWeightsResult)
    report.nodes = _node_reports(work)
    if applied is None or not applied.quantized:
        raise MixprecError(_nothing_to_do(report.nodes))
    report.quantization = _quantization(config, method, applied)
    if applied.fallbacks:
        ran = len(applied.methods) - len(applied.fallbacks)
        why = Counter(applied.fallbacks.values()).most_common()
        report.notes.append(
            f"weight method {method.name} ran on {ran} of {len(applied.methods)} layers; "
            + "; ".join(f"{k}x {reason}" for reason, k in why)
        )
    if mixed:
        report.quantization["mixed"] = mixed
    report.param_bytes_after = param_bytes(work)
    note = _loadable_ir_version(work)
    if note:
        report.notes.append(note)
    let_go(work)
    return work, report


def let_go(model: Source) -> None:
    """Free what a quantization left behind before the next session runs: the pages it
    read of the memory-mapped FP32 weights (read again from the file if needed), and the
    graphs it dropped (``onnx_ir`` graphs are reference cycles, freed only by the cycle
    collector, with the arrays they hold: statistics, replaced tensors)."""
    if isinstance(model, ir.Model):
        release_mapped_pages(model)
    gc.collect()


def _nothing_to_do(rows: list[NodeReport]) -> str:
    """Why no weight was quantized, in one line."""
    kept = [r for r in rows if r.op_class != "none"]
    if not kept:
        return (
            "no MatMul with a constant 2-D float32 weight and no embedding table to quantize: "
            "weight-only quantization has nothing to do (nothing written)"
        )
    reasons = Counter(r.reason for r in kept).most_common(2)
    why = "; ".join(f"{k}x {reason}" for reason, k in reasons)
    return f"every weight stays float ({why}): nothing to quantize (nothing written)"


def _node_reports(model: ir.Model) -> list[NodeReport]:
    rows = []
    for node in model.graph:
        d = weight_decision(node)
        if d is None:
            continue
        op = {"MatMulNBits": "MatMul", "GatherBlockQuantized": "Gather"}.get(node.op_type)
        precision = d.precision if d.quantized else "fp32"
        rows.append(
            NodeReport(node.name or "", op or node.op_type, precision, d.role, "weights", d.reason)
        )
    return rows


def _quantization(
    config: WeightsConfig, method: WeightMethod, applied: QuantizeWeightsResult
) -> dict[str, object]:
    return {
        "kind": "weights",
        "bits": config.bits,
        "block_size": config.block_size,
        "scheme": "symmetric" if config.symmetric else "asymmetric",
        "method": _method_used(method, applied),
        "methods": applied.methods,
        "fallbacks": applied.fallbacks,
        "levels": {f"int{bits}": why for bits, why in sorted(applied.levels.items())},
        "quantized": applied.quantized,
        "left_float": applied.left_float,
        "float_weight_bytes": applied.float_bytes,
        "packed_bytes": applied.packed_bytes,
        "shared_tables": applied.shared_tables,
    }


def _method_used(method: WeightMethod, applied: QuantizeWeightsResult) -> str:
    """The method the codes came from: the one asked for, or, where some layers fell
    back (a data-aware method on layers without statistics), what each share used."""
    if not applied.fallbacks:
        return method.name
    counts = Counter(applied.methods.values())
    if len(counts) == 1:
        used = next(iter(counts))
        return f"{used} ({method.name} asked; no layer has input statistics)"
    total = len(applied.methods)
    return ", ".join(f"{name} on {k} of {total} layers" for name, k in counts.most_common())


def config_dict(config: WeightsConfig) -> dict[str, object]:
    """The config as the report's policy shows it (plain JSON values)."""
    data = dataclasses.asdict(config)
    data["layers"] = {k: [v.precision, v.reason] for k, v in config.layers.items()}
    data["shapes"] = {k: list(v) for k, v in config.shapes.items()}
    data["log_dir"] = str(config.log_dir) if config.log_dir else None
    return data


def _loadable_ir_version(model: ir.Model) -> str | None:
    """Lower an IR version above what the opsets need to :data:`_LOADABLE_IR` (ONNX
    Runtime 1.31 refuses 14); the note saying so, or None."""
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    needed = onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    target = max(_LOADABLE_IR, needed)
    if model.ir_version <= target:
        return None
    old, model.ir_version = model.ir_version, target
    return (
        f"ir_version {old} lowered to {target}, all its opsets need (ONNX Runtime 1.31 reads <= 13)"
    )


# --- the check samples and the guard hook ----------------------------------------------------


@dataclasses.dataclass
class GuardContext:
    """What a :data:`WeightsGuard` gets beside the model.

    Attributes:
        source: the user's FP32 model as loaded (a proto, or the memory-mapped model of
            a streamed run).
        samples: the check samples (at most :data:`CHECK_SAMPLES`).
        where: where they came from, for the report ("eval data", ...).
        config: the options of the run.
        requantize: quantize ``source`` again with another config (a repair).
        runs: runs the FP32 model and candidates (in pieces when streamed).
        rank_samples: calibration samples (at most :data:`CHECK_SAMPLES`) a repair ranks
            layers on, never the check samples it is graded on (None: no calibration
            data; a ranking then reads no samples).
    """

    source: Source
    samples: list[dict[str, np.ndarray]]
    where: str
    config: WeightsConfig
    requantize: Callable[[WeightsConfig], tuple[ir.Model, WeightsReport]]
    runs: ModelRuns
    rank_samples: list[dict[str, np.ndarray]] | None = None


#: ``guard(model, report, context) -> (model, report)``: checks (and may repair) the
#: quantized model; sets ``report.guard`` (``passed``, ``summary``).
WeightsGuard = Callable[[ir.Model, WeightsReport, GuardContext], tuple[ir.Model, WeightsReport]]


def check_samples(
    model: ir.Model,
    calibration_data: CalibrationData | None,
    eval_data: CalibrationData | str | os.PathLike[str] | None,
    shapes: Mapping[str, tuple[int, ...]],
) -> tuple[list[dict[str, np.ndarray]], str]:
    """The samples the output check runs on, and where they came from: ``eval_data``,
    else the calibration samples (RTN reads none of them), else one generated input."""
    found: Iterator[dict[str, np.ndarray]] | None
    if isinstance(eval_data, str | os.PathLike):
        found, where = iter_calibration_npz(eval_data, model), "eval samples"
    elif eval_data is not None:
        found, where = calibration_feeds(eval_data), "eval samples"
    else:
        found, where = calibration_feeds(calibration_data), "calibration samples"
    samples = [dict(s) for s in itertools.islice(found or (), CHECK_SAMPLES)]
    if samples:
        return samples, where
    feeds, _ = make_inputs(model, shapes={k: list(v) for k, v in shapes.items()}, seed=0)
    return [feeds], "generated input (give calibration or eval data for a real check)"


def run_weights(
    source: Source,
    config: WeightsConfig,
    *,
    calibration_data: CalibrationData | None = None,
    eval_data: CalibrationData | str | os.PathLike[str] | None = None,
    progress: Say | None = None,
    guard: WeightsGuard,
) -> tuple[ir.Model, WeightsReport]:
    """Weight-only quantization of ``source`` (the input as loaded; an ``onnx_ir`` model
    keeps its weights memory-mapped, and is streamed when :func:`streams` says so: module
    doc): quantize, check that ONNX Runtime loads and runs the
    result, then ``guard`` (``config.guard=False``: only the load-and-run check). A
    model that ONNX Runtime cannot load or run raises one line (:class:`MixprecError`)."""
    say = progress or (lambda _msg: None)
    streamed = isinstance(source, ir.Model) and streams(source, config)
    data = _weights_data(calibration_data, config, streamed)  # a generator is read once, here
    graph = source if isinstance(source, ir.Model) else ir.from_proto(source)
    samples, where = check_samples(graph, data.samples if data else None, eval_data, config.shapes)
    del graph
    method, why = resolve_method(config.method, has_data=data is not None)
    runs = ModelRuns(source, config, streamed)
    model, report = quantize_weights_once(source, config, method, progress, data)
    # the run's notes go on the report returned last (a repair returns its own)
    notes = [why, *([streamed_note(source)] if isinstance(source, ir.Model) and streamed else [])]
    clock = time.perf_counter()
    if config.guard:
        say(f"checking the outputs against FP32 on {len(samples)} sample(s)")
        again = functools.partial(_again, source, method, progress, data)
        ranking = [dict(s) for s in data.samples[:CHECK_SAMPLES]] if data else None
        context = GuardContext(source, samples, where, config, again, runs, ranking)
        # handed over, not kept here: a streamed guard lets the first model go while it
        # tries others
        handed = [model]
        del model
        model, report = guard(handed.pop(), report, context)
        report.notes.extend(notes)
    else:
        runs.quantized(model, [feeds_for(model, samples[0])])
        report.notes.extend(notes)
        report.notes.append("output check off (guard=False / --no-guard): loaded and run once")
    report.timings["output check"] = time.perf_counter() - clock
    return model, report


def _again(
    source: Source,
    method: WeightMethod,
    progress: Say | None,
    data: WeightsData | None,
    config: WeightsConfig,
) -> tuple[ir.Model, WeightsReport]:
    return quantize_weights_once(source, config, method, progress, data)


#: At most this many calibration samples are read for the layer statistics.
STATS_SAMPLES = 32


def _weights_data(
    calibration_data: CalibrationData | None, config: WeightsConfig, streamed: bool
) -> WeightsData | None:
    """The first :data:`STATS_SAMPLES` calibration samples, as a list (None: none given);
    ``streamed``: their layer statistics are tapped from the model run in pieces."""
    found = calibration_feeds(calibration_data)
    samples = [dict(s) for s in itertools.islice(found or (), STATS_SAMPLES)]
    if not samples:
        return None
    return WeightsData(samples, threads=config.runtime.threads, streamed=streamed)
