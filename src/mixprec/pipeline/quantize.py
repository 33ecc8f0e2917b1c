"""``mixprec.quantize``: post-training INT8 in QDQ form that ONNX Runtime runs as integer
kernels.

The same staged pipeline as :func:`mixprec.convert`, with the INT8 stages swapped in:
prepare (fold BatchNormalization, shapes) -> calibrate (MinMax, or a Histogram for
Entropy/Percentile) -> annotate (:class:`~mixprec.int8.plan.AnnotateInt8Pass`) -> apply
(:class:`~mixprec.int8.qdq.QuantizeQDQPass`) -> cleanup -> check. The report says, per
node, INT8 or float and why, and what share of the Conv/MatMul/Gemm MACs ONNX Runtime
really runs in integer kernels (read from its optimized graph).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.calibrate.measure import CalibratePass, CountMacsPass, calibration_of, node_macs
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import iter_nodes
from mixprec.core.layers import is_layer
from mixprec.core.ops import QDQ_OPS
from mixprec.inputs.feeds import feeds_for, make_inputs
from mixprec.int8.config import DYNAMIC_MAC_SHARE, PER_CHANNEL_OPSET, QuantizeConfig
from mixprec.int8.dynamic import QuantizeDynamicPass, QuantizeDynamicResult
from mixprec.int8.equalize import EqualizeLayersPass, EqualizeLayersResult
from mixprec.int8.layout import FakeQuantizeLayoutPass, FakeQuantizeLayoutResult
from mixprec.int8.plan import AnnotateInt8Pass, dynamic_candidate
from mixprec.int8.qdq import QuantizeQDQPass, QuantizeQDQResult
from mixprec.int8.rounding import SAMPLES as ROUNDING_SAMPLES
from mixprec.int8.rounding import LearnedRoundingPass, LearnedRoundingResult
from mixprec.int8.smooth import (
    AUTO_MAC_SHARE,
    SmoothQuantPass,
    SmoothQuantResult,
    head_of,
    smoothable_share,
)
from mixprec.int8.speed import (
    SPEED_MARGINS,
    Placement,
    candidate_placements,
    choose_placement,
)
from mixprec.io.external import clone_model
from mixprec.passes.opset import upgrade_to
from mixprec.pipeline.convert import (
    CalibrationData,
    count_casts,
    notes_about_input,
    param_bytes,
    report_stages,
)
from mixprec.pipeline.fallback import paint_fallback
from mixprec.pipeline.report import NodeReport, Report, node_row
from mixprec.pipeline.stages import Pipeline, Stage
from mixprec.runtime.engine import FAKE_QUANTIZE
from mixprec.runtime.engines import engine_for
from mixprec.runtime.kernels import integer_kernel_share

__all__ = [
    "QuantizePipeline",
    "Reuse",
    "choose_mode",
    "config_dict",
    "fill_report",
    "int8_node_reports",
    "latency_feeds",
    "plan_model",
    "resolve_qconfig",
    "run_quantize",
    "timed_placement",
]

logger = logging.getLogger(__name__)


class QuantizePipeline(Pipeline):
    """The staged pipeline with the INT8 annotate and apply stages."""

    def __init__(self, qconfig: QuantizeConfig, **kwargs: Any) -> None:
        super().__init__(qconfig.base(), **kwargs)
        self.qconfig = qconfig
        #: Why mode "auto" became static or dynamic (set when the annotate stage is built).
        self.mode_choice: str | None = None
        #: The samples learned rounding captures layer inputs from (kept at calibration).
        self.rounding_samples: list[Any] | None = None

    def build(self, name: str, model: ir.Model) -> Stage:
        if name == "annotate" and self.qconfig.mode == "auto":
            # The calibrated shapes give the MACs that decide (every user of the pipeline,
            # quantize, the plan, the tuner, resolves "auto" the same way).
            self.qconfig, self.mode_choice = choose_mode(model, self.qconfig)
        q = self.qconfig
        if name == "prepare" and q.equalizes:
            # After BatchNormalization folding, before calibration: ranges are measured on
            # the equalized model.
            prepare = super().build(name, model)
            return Stage(
                name, *prepare.passes, EqualizeLayersPass(), common.RemoveUnusedNodesPass()
            )
        if name == "calibrate":
            # Dynamic mode measures ranges at run time: given data only shows the shapes
            # (MAC counts, the speed plan's inputs).
            run = q.mode != "dynamic" or self.calibration_data is not None
            data, smooth = self._smoothing(q, model)
            if q.rounding == "learned" and q.mode != "dynamic" and data is not None:
                # the apply stage captures layer inputs from these (a stream is re-chained)
                self.rounding_samples, data = head_of(data, ROUNDING_SAMPLES)
            calibrate = CalibratePass(
                q.shapes,
                data,
                observer=self.config.observer,
                run=run,
                channel_means=q.bias_correction and q.mode != "dynamic",
            )
            return Stage(name, *smooth, calibrate)
        if name == "annotate":
            passes: list[ir.passes.PassBase] = []
            opset = model.opset_imports.get("", 1)
            if q.per_channel and q.mode != "dynamic" and opset < PER_CHANNEL_OPSET:
                passes.append(upgrade_to(PER_CHANNEL_OPSET))
            annotate = AnnotateInt8Pass(
                q.exclude_nodes,
                quantizer=q.quantizer(),
                dynamic=q.mode == "dynamic",
                placement=q.placement,
            )
            return Stage(name, *passes, CountMacsPass(), annotate)
        if name == "apply" and q.mode == "dynamic":
            return Stage(name, QuantizeDynamicPass(), common.RemoveUnusedNodesPass())
        if name == "apply":
            return Stage(
                name,
                *self._rounding(q),
                QuantizeQDQPass(bias_correction=q.bias_correction),
                *([FakeQuantizeLayoutPass()] if _fake_quantize(q) else []),
                common.RemoveUnusedNodesPass(),
            )
        return super().build(name, model)

    def _rounding(self, q: QuantizeConfig) -> list[ir.passes.PassBase]:
        """Learned rounding before the QDQ apply, on the samples kept at calibration (or,
        for a pipeline started after it, the first samples of a list)."""
        if q.rounding != "learned":
            return []
        samples = self.rounding_samples
        if samples is None and isinstance(self.calibration_data, Mapping | Sequence):
            samples = head_of(self.calibration_data, ROUNDING_SAMPLES)[0]
        return [LearnedRoundingPass(samples or [])]

    def _smoothing(
        self, q: QuantizeConfig, model: ir.Model
    ) -> tuple[Any, list[ir.passes.PassBase]]:
        """SmoothQuant before the range calibration (it changes the ranges), on the first
        samples of the calibration data; returns the data the calibration then reads."""
        data = self.calibration_data
        if q.smooth is None or data is None:
            return data, []
        alpha = None if q.smooth == "auto" else float(q.smooth)
        least = AUTO_MAC_SHARE if alpha is None else 0.0
        head, data = head_of(data, 1)
        if head and smoothable_share(model, head[0], q.exclude_nodes) >= least:
            head, data = head_of(data)  # only now hold the first samples (a CNN never does)
        smooth = SmoothQuantPass(
            head,
            alpha=alpha,
            per_channel=q.per_channel,
            exclude_nodes=q.exclude_nodes,
            min_mac_share=least,
        )
        return data, [smooth, common.RemoveUnusedNodesPass()]


def _fake_quantize(config: QuantizeConfig) -> bool:
    """Whether the runtime reads Q/DQ pairs as FakeQuantize (:mod:`mixprec.int8.layout`)."""
    return engine_for(config.runtime).qdq_layout == FAKE_QUANTIZE


def resolve_qconfig(config: QuantizeConfig | None, options: dict[str, Any]) -> QuantizeConfig:
    """The INT8 config of a call: ``config`` with ``options`` replaced, or one made of them."""
    try:
        return dataclasses.replace(config, **options) if config else QuantizeConfig(**options)
    except TypeError as exc:
        raise MixprecError(f"quantize: {exc}") from None


def _data_notes(config: QuantizeConfig, calibration_data: CalibrationData | None) -> list[str]:
    """What the report says about the calibration data (and logs when there is none)."""
    if config.mode == "dynamic":
        if calibration_data is None:
            return []
        return [
            "dynamic mode: activation ranges are measured at run time; the calibration "
            "data only gave the shapes (MAC counts, the speed plan's inputs)"
        ]
    if calibration_data is not None:
        return []
    message = (
        "no calibration data: scales come from one synthetic sample and say nothing "
        "about accuracy on real inputs; give calibration_data / --calibration-data"
    )
    logger.warning(message)
    return [message]


@dataclasses.dataclass
class Reuse:
    """What a later quantization of the same input and data (the guard's repaired one:
    more nodes kept float) takes from the first instead of measuring it again: the
    calibrated model (prepared, smoothed, ranges measured) with its stages, and the
    placement the speed plan chose, the only one timed again: its label, and what it
    kept float beyond the user's exclusions (``chosen``: the repair adds exclusions of its
    own). A learned rounding run calibrates anew (its layer inputs are captured while
    calibrating)."""

    calibrated: ir.Model | None = None  # graphs copied, tensors shared (no weight copied)
    stages: dict[str, Stage] = dataclasses.field(default_factory=dict)
    placement: str | None = None
    chosen: Placement | None = None
    #: The other placements the plan found faster, best first (the guard's fallback).
    alternates: list[tuple[str, Placement]] = dataclasses.field(default_factory=list)


def run_quantize(
    work: ir.Model,
    config: QuantizeConfig,
    *,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
    reuse: Reuse | None = None,
) -> tuple[ir.Model, Report]:
    """INT8 on a loaded model (a private copy, changed in place): calibrate, resolve mode
    "auto", time the placements (``speed="auto"``), annotate, apply, check, and paint the
    fallback; returns the model and the report. ``reuse``: filled by a first run, read by
    the next (:class:`Reuse`)."""
    say = progress or (lambda _msg: None)
    report = Report(target="int8", policy={"quantize": config_dict(config)})
    report.notes.extend(notes_about_input(work))
    report.notes.extend(_data_notes(config, calibration_data))
    original = ir.to_proto(work)  # the speed plan times placements against the user's model
    pipeline = QuantizePipeline(config, calibration_data=calibration_data, progress=progress)
    work = _calibrated(work, pipeline, reuse)
    if config.mode == "auto":
        config, pipeline.mode_choice = choose_mode(work, config)
        pipeline.qconfig = config  # resolved once here: the speed plan times this mode
        report.notes.append(pipeline.mode_choice)
    speed: dict[str, object] | None = None
    extra: dict[str, float] = {}
    if config.speed != "off":
        say("timing candidate INT8 placements")
        t = time.perf_counter()
        only = None
        if reuse is not None and reuse.placement is not None and reuse.chosen is not None:
            only = (reuse.placement, reuse.chosen)
        chosen, speed, alternates = timed_placement(work, config, original, only=only)
        extra["speed"] = time.perf_counter() - t
        if reuse is not None and reuse.placement is None:
            user = len(config.exclude_nodes)
            reuse.placement = str(speed["chosen"])
            reuse.chosen = Placement(chosen.exclude[user:], chosen.ops)
            reuse.alternates = [
                (label, Placement(p.exclude[user:], p.ops)) for label, p in alternates
            ]
        pipeline.qconfig = dataclasses.replace(
            config, exclude_nodes=chosen.exclude, placement=chosen.ops
        )
    work = pipeline.run(work, start="annotate", until="annotate")
    planned = set(work.graph)
    work = pipeline.run(work, start="apply")
    fill_report(report, pipeline, work)
    if pipeline.mode_choice is not None and report.quantization is not None:
        report.quantization["mode_choice"] = pipeline.mode_choice
    if config.fallback != "fp32":
        say(f"painting the float nodes {config.fallback}")
        t = time.perf_counter()
        work, low = paint_fallback(work, config.fallback, planned, check=config.check)
        extra["fallback"] = time.perf_counter() - t
        _mark_fallback(report, config.fallback, low)
    report.timings = {**pipeline.timings, **extra}
    if speed is not None and report.quantization is not None:
        report.quantization["speed"] = speed
        report.notes.append(str(speed["summary"]))
    return work, report


def _calibrated(work: ir.Model, pipeline: QuantizePipeline, reuse: Reuse | None) -> ir.Model:
    """``work`` prepared and calibrated: measured here (and kept in ``reuse``), or a copy
    of what ``reuse`` kept from the first run."""
    q = pipeline.qconfig
    if reuse is None or q.rounding == "learned":
        return pipeline.run(work, until="calibrate")
    if reuse.calibrated is not None:
        pipeline.stages.update(reuse.stages)
        return clone_model(reuse.calibrated)
    work = pipeline.run(work, until="calibrate")
    # the passes after this replace tensors, never write into them, and the fp16/bf16
    # painter releases no bytes of a model marked as sharing them: sharing is safe
    reuse.calibrated = clone_model(work)
    reuse.stages = {k: v for k, v in pipeline.stages.items() if k in ("prepare", "calibrate")}
    return work


def choose_mode(model: ir.Model, config: QuantizeConfig) -> tuple[QuantizeConfig, str]:
    """mode="auto": dynamic for MatMul-dominated models (see :class:`QuantizeConfig`)."""
    by_name = node_macs(model)
    matmul = total = 0
    for node in model.graph:
        macs = by_name.get(node.name or "", 0)
        if is_layer(node):
            total += macs
            if dynamic_candidate(node) is None:
                matmul += macs
    share = matmul / total if total else 0.0
    mode = "dynamic" if total and share >= DYNAMIC_MAC_SHARE else "static"
    why = (
        f"mode auto: {mode} (MatMul/Gemm with constant weights hold {share:.0%} of the "
        f"Conv/MatMul/Gemm MACs; dynamic from {DYNAMIC_MAC_SHARE:.0%})"
    )
    return dataclasses.replace(config, mode=mode), why


def timed_placement(
    model: ir.Model,
    config: QuantizeConfig,
    original: onnx.ModelProto,
    *,
    only: tuple[str, Placement] | None = None,
) -> tuple[Placement, dict[str, object], list[tuple[str, Placement]]]:
    """The fastest INT8 placement on this CPU (:mod:`mixprec.int8.speed`) against the
    user's ``original`` model, timed at ``config.latency_shapes``, else ``config.shapes``,
    else the calibration's input shapes; ``only``: time that placement alone, without a
    profile (the label an earlier plan chose and what it kept float beyond the user's
    exclusions, which are taken as they are now; "fp32" times them all). Returns
    :func:`~mixprec.int8.speed.choose_placement`'s placement, measurements and the other
    placements found faster."""
    base = ir.to_proto(model)

    def build(placement: Placement) -> onnx.ModelProto:
        copy = ir.from_proto(base)
        copy.meta.update(model.meta)
        trial = dataclasses.replace(  # rounding changes no latency: nearest is enough here
            config,
            exclude_nodes=placement.exclude,
            placement=placement.ops,
            check=False,
            rounding="nearest",
        )
        return ir.to_proto(QuantizePipeline(trial).run(copy, start="annotate", until="apply"))

    feeds = latency_feeds(model, config, calibration_of(model).input_shapes)
    user = tuple(config.exclude_nodes)
    margin = SPEED_MARGINS[config.speed]
    if only is not None and only[0] != "fp32":
        label, extra = only
        placement = Placement(user + extra.exclude, extra.ops)
        return choose_placement(
            original, {label: placement}, build, feeds, config.runtime, False, margin
        )
    ops = "weighted" if _fake_quantize(config) else "chains"  # layer inputs only for OpenVINO
    placements = candidate_placements(model, user, ops)
    return choose_placement(original, placements, build, feeds, config.runtime, margin=margin)


def latency_feeds(
    model: ir.Model, config: QuantizeConfig, shapes: Mapping[str, Any]
) -> dict[str, Any]:
    """The inputs placements are timed on (the speed plan, the guard's repair): generated
    at ``config.latency_shapes``, else ``config.shapes``, else ``shapes`` (the data's)."""
    shapes = {
        **{k: list(v) for k, v in shapes.items()},
        **{k: list(v) for k, v in config.shapes.items()},
        **{k: list(v) for k, v in config.latency_shapes.items()},
    }
    feeds, _ = make_inputs(model, shapes=shapes, seed=0)
    return feeds_for(model, feeds)


def config_dict(config: QuantizeConfig) -> dict[str, object]:
    """The config as the report's policy shows it (plain JSON values)."""
    data = dataclasses.asdict(config)
    data["shapes"] = {k: list(v) for k, v in config.shapes.items()}
    data["latency_shapes"] = {k: list(v) for k, v in config.latency_shapes.items()}
    data["log_dir"] = str(config.log_dir) if config.log_dir else None
    data["reduce_range"] = config.reduce_range
    if config.metric is not None:  # the user's function, by name
        data["metric"] = getattr(config.metric, "__qualname__", repr(config.metric))
    return data


def _mark_fallback(report: Report, target: str, low: Mapping[str, str]) -> None:
    """Report rows of the float nodes the fallback painted low."""
    report.nodes = [
        dataclasses.replace(
            n, precision="low", step=target, reason=f"{target} fallback: {low[n.name]}"
        )
        if n.precision == "fp32" and n.name in low
        else n
        for n in report.nodes
    ]
    if report.quantization is not None:
        report.quantization["fallback"] = {"dtype": target, "nodes": len(low)}
    report.notes.append(f"{len(low)} node(s) left out of INT8 run in {target} (fallback)")


def plan_model(
    work: ir.Model,
    config: QuantizeConfig,
    *,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[ir.Model, Report]:
    """The INT8 plan without converting: ``work`` calibrated and annotated (every node the
    plan allows: no speed search) and its report rows, each node INT8 or float with the
    reason."""
    config = dataclasses.replace(config, speed="off")
    report = Report(target="int8", policy={"quantize": config_dict(config)})
    report.notes.extend(notes_about_input(work))
    pipeline = QuantizePipeline(config, calibration_data=calibration_data, progress=progress)
    work = pipeline.run(work, until="annotate")
    report.timings = dict(pipeline.timings)
    report.calibrated = pipeline.qconfig.mode != "dynamic" or calibration_data is not None
    if pipeline.mode_choice is not None:
        report.notes.append(pipeline.mode_choice)
    report.nodes = int8_node_reports(work)
    report.casts_before = count_casts(work)
    report.param_bytes_before = param_bytes(work)
    return work, report


def int8_node_reports(model: ir.Model) -> list[NodeReport]:
    """The report rows of the INT8 decisions recorded on the nodes, subgraphs included
    (a layer in an If branch is a row that says why it stays float)."""
    rows = (node_row(n, paint=False) for n in iter_nodes(model.graph) if n.op_type not in QDQ_OPS)
    return [row for row in rows if row is not None]


def fill_report(report: Report, pipeline: QuantizePipeline, model: ir.Model) -> None:
    """Fill the report of an INT8 run from its stages: the node rows, what was quantized,
    and the share of MACs ONNX Runtime runs in integer kernels."""
    report_stages(report, pipeline.stages, model)
    report.nodes = int8_node_reports(model)
    report.calibrated = pipeline.qconfig.mode != "dynamic"
    applied = pipeline.stages["apply"].result(QuantizeQDQResult)
    dynamic = pipeline.stages["apply"].result(QuantizeDynamicResult)
    prepare = pipeline.stages.get("prepare")
    equalized = prepare.result(EqualizeLayersResult) if prepare is not None else None
    if applied is not None:
        report.quantization = {
            "mode": "static",
            "tensors": applied.tensors,
            "weights_quantized": applied.weights,
            "biases_int32": applied.biases,
            "biases_corrected": applied.corrected_biases,
            "float_biases": applied.float_biases,
            "left_float": applied.left_float,
        }
    elif dynamic is not None:
        report.quantization = {
            "mode": "dynamic",
            "tensors": dynamic.tensors,
            "weights_quantized": dynamic.weights,
            "left_float": dynamic.left_float,
        }
    if equalized is not None and report.quantization is not None:
        report.quantization["equalize"] = equalized.summary()
        report.notes.append(equalized.note())
    rounded = pipeline.stages["apply"].result(LearnedRoundingResult)
    if rounded is not None and report.quantization is not None:
        report.quantization["rounding"] = rounded.summary()
        report.notes.append(rounded.note())
    elif dynamic is not None and pipeline.qconfig.rounding == "learned":
        report.notes.append("learned rounding is for static INT8: dynamic weights round to nearest")
    calibrated = pipeline.stages.get("calibrate")
    smoothed = calibrated.result(SmoothQuantResult) if calibrated is not None else None
    if smoothed is not None and report.quantization is not None:
        if smoothed.inputs or smoothed.skipped:
            report.quantization["smooth"] = smoothed.to_dict()
        if smoothed.inputs:
            report.notes.append(smoothed.summary())
    laid = pipeline.stages["apply"].result(FakeQuantizeLayoutResult)
    if laid is not None and report.quantization is not None:
        report.quantization["layout"] = laid.summary()
        report.notes.append(laid.note())
        return  # ONNX Runtime's integer kernels are not what this layout serves
    # The share is over every Conv/MatMul/Gemm MAC of the model, INT8-planned or not.
    macs = {n.name: n.macs for n in report.nodes if n.macs}
    try:
        share, kinds = integer_kernel_share(
            ir.to_proto(model), macs, dynamic.outputs if dynamic is not None else None
        )
    except Exception as exc:  # the check stage already passed: report, do not fail
        report.notes.append(f"could not read ONNX Runtime's optimized graph: {exc}")
        return
    if report.quantization is not None:
        report.quantization["integer_kernel_mac_share"] = share
        report.quantization["ort_kernels"] = kinds
