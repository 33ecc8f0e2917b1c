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
import os
import platform
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.calibrate.measure import MACS, CalibratePass, CountMacsPass, node_macs
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.core.policy import default_policy
from mixprec.int8.dynamic import QuantizeDynamicPass, QuantizeDynamicResult
from mixprec.int8.params import METHODS
from mixprec.int8.plan import AnnotateInt8Pass, int8_decision
from mixprec.int8.qdq import QuantizeQDQPass, QuantizeQDQResult
from mixprec.passes.opset import upgrade_to
from mixprec.pipeline.fallback import FALLBACKS, paint_fallback
from mixprec.pipeline.report import NodeReport, Report
from mixprec.pipeline.stages import Pipeline, Stage

__all__ = ["QuantizeConfig", "int8_node_reports", "integer_kernel_share", "quantize"]

logger = logging.getLogger(__name__)

_ACTIVATIONS = ("auto", "u8", "s8")
#: Per-channel DequantizeLinear (``axis``) needs this ai.onnx opset.
PER_CHANNEL_OPSET = 13
MODES = ("static", "dynamic", "auto")
#: mode="auto" goes dynamic when weighted MatMul/Gemm hold at least this MAC share.
DYNAMIC_MAC_SHARE = 0.8
#: ONNX Runtime kernels that run a Conv/MatMul/Gemm in integers.
INTEGER_KERNELS = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QGemm",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "QLinearConvTranspose",
    }
)
FLOAT_KERNELS = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "MatMul",
        "Gemm",
        "FusedConv",
        "FusedMatMul",
        "FusedGemm",
        "NchwcConv",
    }
)


def cpu_has_vnni() -> bool | None:
    """Whether this x86 CPU has VNNI (avx512_vnni or avx_vnni); None when unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return "avx512_vnni" in flags or "avx_vnni" in flags


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """The INT8 options, validated.

    Attributes:
        method: activation ranges: "minmax", "entropy" (KL threshold over a histogram) or
            "percentile" (99.999% of |x|).
        activations: "u8" (asymmetric uint8), "s8" (symmetric int8) or "auto": u8, with
            7-bit weights (reduce_range) on x86 CPUs without VNNI, where u8 x s8 products
            saturate in int16.
        per_channel: per-output-channel weight scales (raises the opset to 13 if needed).
        exclude_nodes: node names or regular expressions kept float.
        shapes: concrete shapes for symbolic input dims.
        fold_batchnorm: fold BatchNormalization into Conv/Gemm first.
        check: hold the result to the full ONNX checker.
        log_dir: folder for the graphs and the report.
        speed: "auto" times candidate placements on this machine (all INT8 nodes; without
            depthwise convolutions; only the large Conv/MatMul/Gemm) against the FP32 model
            and keeps the fastest, never one slower than FP32; "off" quantizes all.
        mode: "static" (calibrated Q/DQ pairs), "dynamic" (MatMul/Gemm weights INT8
            offline, activations quantized per call at run time; no calibration) or
            "auto": dynamic when MatMul/Gemm with constant weights hold >= 80% of the
            Conv/MatMul/Gemm MACs (transformers, whose activation outlier channels one
            static scale cannot hold), else static.
        bias_correction: fold the mean output shift of weight rounding into Conv/Gemm
            biases (static mode; the calibration also averages their inputs' channel means).
        fallback: precision of the nodes left out of INT8: "fp32", or "fp16"/"bf16" painted
            by the FP16/BF16 painter around the integer kernels (:mod:`mixprec.pipeline.fallback`).
    """

    method: str = "minmax"
    activations: str = "auto"
    per_channel: bool = True
    exclude_nodes: tuple[str, ...] = ()
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    fold_batchnorm: bool = True
    check: bool = True
    log_dir: Path | None = None
    speed: str = "auto"
    mode: str = "auto"
    fallback: str = "fp32"
    bias_correction: bool = False

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise MixprecError(
                f"fallback must be one of {', '.join(FALLBACKS)}, not {self.fallback!r}"
            )
        if self.mode not in MODES:
            raise MixprecError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.speed not in ("auto", "off"):
            raise MixprecError(f"speed must be 'auto' or 'off', not {self.speed!r}")
        if self.method not in METHODS:
            raise MixprecError(f"method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.activations not in _ACTIVATIONS:
            raise MixprecError(
                f"activations must be one of {', '.join(_ACTIVATIONS)}, not {self.activations!r}"
            )
        if isinstance(self.exclude_nodes, str):
            raise MixprecError("exclude_nodes must be a list of names or patterns")
        object.__setattr__(self, "exclude_nodes", tuple(self.exclude_nodes))

    @property
    def unsigned(self) -> bool:
        return self.activations != "s8"

    @property
    def reduce_range(self) -> bool:
        if self.activations != "auto":
            return False
        machine = platform.machine().lower()
        return machine in ("x86_64", "amd64") and cpu_has_vnni() is False

    def base(self) -> ConvertConfig:
        """The shared stages' configuration (prepare, calibrate, check)."""
        return ConvertConfig(
            policy=default_policy("fp16"),
            observer="minmax" if self.method == "minmax" else "histogram",
            shapes=self.shapes,
            fold_batchnorm=self.fold_batchnorm,
            check=self.check,
            upgrade_opset=False,
            log_dir=self.log_dir,
        )


class QuantizePipeline(Pipeline):
    """The staged pipeline with the INT8 annotate and apply stages."""

    def __init__(self, qconfig: QuantizeConfig, **kwargs: Any) -> None:
        super().__init__(qconfig.base(), **kwargs)
        self.qconfig = qconfig
        #: Why mode "auto" became static or dynamic (set when the annotate stage is built).
        self.mode_choice: str | None = None

    def build(self, name: str, model: ir.Model) -> Stage:
        if name == "annotate" and self.qconfig.mode == "auto":
            # The calibrated shapes give the MACs that decide (every user of the pipeline,
            # quantize, the plan, the tuner, resolves "auto" the same way).
            self.qconfig, self.mode_choice = _choose_mode(model, self.qconfig)
        q = self.qconfig
        if name == "calibrate":
            # Dynamic mode measures ranges at run time: given data only shows the shapes
            # (MAC counts, the speed plan's inputs).
            run = q.mode != "dynamic" or self.calibration_data is not None
            calibrate = CalibratePass(
                q.shapes,
                self.calibration_data,
                observer=self.config.observer,
                run=run,
                channel_means=q.bias_correction and q.mode != "dynamic",
            )
            return Stage(name, calibrate)
        if name == "annotate":
            passes: list[ir.passes.PassBase] = []
            opset = model.opset_imports.get("", 1)
            if q.per_channel and q.mode != "dynamic" and opset < PER_CHANNEL_OPSET:
                passes.append(upgrade_to(PER_CHANNEL_OPSET))
            annotate = AnnotateInt8Pass(q.exclude_nodes, dynamic=q.mode == "dynamic")
            return Stage(name, *passes, CountMacsPass(), annotate)
        if name == "apply" and q.mode == "dynamic":
            dynamic_pass = QuantizeDynamicPass(
                per_channel=q.per_channel, reduce_range=q.reduce_range
            )
            return Stage(name, dynamic_pass, common.RemoveUnusedNodesPass())
        if name == "apply":
            return Stage(
                name,
                QuantizeQDQPass(
                    q.method,
                    unsigned=q.unsigned,
                    per_channel=q.per_channel,
                    reduce_range=q.reduce_range,
                    bias_correction=q.bias_correction,
                ),
                common.RemoveUnusedNodesPass(),
            )
        return super().build(name, model)


def integer_kernel_share(
    proto: onnx.ModelProto, macs: Mapping[str, int], outputs: Mapping[str, str] | None = None
) -> tuple[float | None, dict[str, int]]:
    """Share of the given nodes' MACs that ONNX Runtime's CPU provider runs in integer
    kernels, read from its optimized graph, and the count of each compute kernel there.

    A fused integer kernel writes the output of the QuantizeLinear that followed the
    node (or the Relu/Clip it absorbed), so kernels are traced back by that name;
    ``outputs`` adds other output -> node pairs (a dynamic MatMul's fused kernel writes
    the original MatMul's output).
    """
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="mixprec-") as folder:
        path = os.path.join(folder, "optimized.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = path
        options.log_severity_level = 3
        ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(path, load_external_data=False)
    kinds = Counter(
        n.op_type for n in optimized.graph.node if n.op_type in INTEGER_KERNELS | FLOAT_KERNELS
    )
    producer = {out: node for node in proto.graph.node for out in node.output}
    # Q output -> the compute node it quantizes (nodes without counted MACs are left out)
    source: dict[str, str] = {k: v for k, v in (outputs or {}).items() if v in macs}
    for node in proto.graph.node:
        if node.op_type != "QuantizeLinear":
            continue
        before = producer.get(node.input[0])
        if before is not None and before.op_type in ("Relu", "Clip"):
            before = producer.get(before.input[0])
        if before is not None and before.name in macs:
            source[node.output[0]] = before.name
    # A fused kernel may also absorb the bias Add that follows (MatMulIntegerToFloat).
    readers = Counter(name for node in proto.graph.node for name in node.input)
    for node in proto.graph.node:
        fed = [name for name in node.input if name in source and readers[name] == 1]
        if node.op_type == "Add" and len(fed) == 1:
            source.setdefault(node.output[0], source[fed[0]])
    integer = sum(
        macs[source[out]]
        for n in optimized.graph.node
        if n.op_type in INTEGER_KERNELS
        for out in n.output
        if out in source
    )
    total = sum(macs.values())
    return (integer / total if total else None), dict(kinds)  # None: no counted MACs


CalibrationData = Mapping[str, Any] | Iterable[Mapping[str, Any]]


def quantize(
    model: Any,
    calibration_data: CalibrationData | None = None,
    *,
    config: QuantizeConfig | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Any:
    """Post-training INT8 quantization: static (calibrated Q/DQ pairs) or dynamic (MatMul
    weights INT8, activations quantized at run time), chosen by ``mode``.

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        calibration_data: a feed dict, a list of them, or any iterable/generator
            (streamed). None generates one synthetic sample and warns: scales from
            synthetic data say nothing about real accuracy.
        config: a ready :class:`QuantizeConfig`; ``options`` then replace its fields.
        progress: called with a short message at each stage.
        base_dir: the folder an in-memory model's external data is read from (as for
            :func:`~mixprec.convert`); a path's own folder otherwise.
        **options: the fields of :class:`QuantizeConfig` (``method``, ``mode``,
            ``activations``, ``per_channel``, ``fallback``, ``bias_correction``, ``speed``,
            ``exclude_nodes``, ``shapes``, ``fold_batchnorm``, ``check``, ``log_dir``).
            ``max_drop=X`` tunes instead (:func:`mixprec.tune`, target int8,
            ``calibration_data`` as its data): the accepted drop of ``metric`` (default
            "rel-l2": rel L2 <= X; "top1"/"cosine": >= 1 - X; a callable: its FP32 score
            - X); it returns the ``TuneResult``.

    Returns:
        A :class:`~mixprec.ConversionResult` (``.model``, ``.report``, ``.save()``).

    Example:
        >>> result = mixprec.quantize("model.onnx", batches, method="entropy")  # doctest: +SKIP
        >>> result.save("model_int8.onnx")                                      # doctest: +SKIP
    """
    from mixprec.pipeline.convert import ConversionResult, _notes_about_input, load_input

    if options.get("max_drop") is not None:
        if config is not None or base_dir is not None:
            raise MixprecError("max_drop= takes keyword options, not config= or base_dir=")
        return _tune_int8(model, calibration_data, progress, options)
    options.pop("max_drop", None)
    try:
        config = dataclasses.replace(config, **options) if config else QuantizeConfig(**options)
    except TypeError as exc:
        raise MixprecError(f"quantize: {exc}") from None
    say = progress or (lambda _msg: None)
    say("loading")
    work, kind = load_input(model, base_dir)
    report = Report(target="int8", policy={"quantize": _config_dict(config)})
    report.notes.extend(_notes_about_input(work))
    if config.mode == "dynamic":
        if calibration_data is not None:
            report.notes.append(
                "dynamic mode: activation ranges are measured at run time; the calibration "
                "data only gave the shapes (MAC counts, the speed plan's inputs)"
            )
    elif calibration_data is None:
        message = (
            "no calibration data: scales come from one synthetic sample and say nothing "
            "about accuracy on real inputs; give calibration_data / --calibration-data"
        )
        logger.warning(message)
        report.notes.append(message)
    pipeline = QuantizePipeline(config, calibration_data=calibration_data, progress=progress)
    work = pipeline.run(work, until="calibrate")
    if config.mode == "auto":
        config, mode_choice = _choose_mode(work, config)
        pipeline.qconfig = config  # resolved once here: the speed plan times this mode
        pipeline.mode_choice = mode_choice
        report.notes.append(mode_choice)
    speed: dict[str, object] | None = None
    if config.speed == "auto":
        say("timing candidate INT8 placements")
        excluded, speed = _timed_placement(work, config)
        pipeline.qconfig = dataclasses.replace(config, exclude_nodes=excluded)
    work = pipeline.run(work, start="annotate", until="annotate")
    planned = set(work.graph)
    work = pipeline.run(work, start="apply")
    report.timings = dict(pipeline.timings)
    _fill_report(report, pipeline, work)
    if pipeline.mode_choice is not None and report.quantization is not None:
        report.quantization["mode_choice"] = pipeline.mode_choice
    if config.fallback != "fp32":
        say(f"painting the float nodes {config.fallback}")
        work, low = paint_fallback(work, config.fallback, planned, check=config.check)
        _mark_fallback(report, config.fallback, low)
    if speed is not None and report.quantization is not None:
        report.quantization["speed"] = speed
        report.notes.append(str(speed["summary"]))
    return ConversionResult(work, report, kind)


def _choose_mode(model: ir.Model, config: QuantizeConfig) -> tuple[QuantizeConfig, str]:
    """mode="auto": dynamic for MatMul-dominated models (see :class:`QuantizeConfig`)."""
    from mixprec.int8.dynamic import dynamic_candidate

    by_name = node_macs(model)
    matmul = total = 0
    for node in model.graph:
        macs = by_name.get(node.name or "", 0)
        if node.op_type in ("Conv", "ConvTranspose", "MatMul", "Gemm"):
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


def _tune_int8(
    model: Any,
    data: CalibrationData | None,
    progress: Callable[[str], None] | None,
    options: dict[str, Any],
) -> Any:
    from mixprec.tune.search import tune

    drop = options.pop("max_drop")
    metric = options.pop("metric", "rel-l2")
    budget = 1.0 - drop if metric in ("top1", "cosine") else drop
    return tune(model, "int8", data, metric=metric, budget=budget, progress=progress, **options)


def _timed_placement(
    model: ir.Model, config: QuantizeConfig
) -> tuple[tuple[str, ...], dict[str, object]]:
    """The exclusions of the fastest INT8 placement on this CPU (:mod:`mixprec.int8.speed`),
    timed at the calibration's input shapes."""
    from mixprec.calibrate.measure import calibration_of
    from mixprec.int8.speed import candidate_placements, choose_placement
    from mixprec.io.feeds import feeds_for, make_inputs

    base = ir.to_proto(model)

    def build(excluded: tuple[str, ...]) -> onnx.ModelProto:
        copy = ir.from_proto(base)
        copy.meta.update(model.meta)
        trial = QuantizePipeline(dataclasses.replace(config, exclude_nodes=excluded, check=False))
        return ir.to_proto(trial.run(copy, start="annotate", until="apply"))

    feeds, _ = make_inputs(model, shapes=calibration_of(model).input_shapes, seed=0)
    placements = candidate_placements(model, tuple(config.exclude_nodes))
    return choose_placement(base, placements, build, feeds_for(model, feeds))


def _config_dict(config: QuantizeConfig) -> dict[str, object]:
    data = dataclasses.asdict(config)
    data["shapes"] = {k: list(v) for k, v in config.shapes.items()}
    data["log_dir"] = str(config.log_dir) if config.log_dir else None
    data["reduce_range"] = config.reduce_range
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


def plan_int8(
    model: Any,
    calibration_data: CalibrationData | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> tuple[ir.Model, Report]:
    """The INT8 plan without converting: the calibrated model annotated up to ``annotate``
    (every node the plan allows: no speed search) and its report rows, each node INT8 or
    float with the reason. ``options`` are :class:`QuantizeConfig` fields."""
    from mixprec.pipeline.convert import _notes_about_input, load_input

    try:
        config = QuantizeConfig(**{"speed": "off", **options})
    except TypeError as exc:
        raise MixprecError(f"quantize: {exc}") from None
    work, _ = load_input(model, base_dir)
    report = Report(target="int8", policy={"quantize": _config_dict(config)})
    report.notes.extend(_notes_about_input(work))
    pipeline = QuantizePipeline(config, calibration_data=calibration_data, progress=progress)
    work = pipeline.run(work, until="annotate")
    report.timings = dict(pipeline.timings)
    report.calibrated = pipeline.qconfig.mode != "dynamic" or calibration_data is not None
    if pipeline.mode_choice is not None:
        report.notes.append(pipeline.mode_choice)
    report.nodes = int8_node_reports(work)
    return work, report


def int8_node_reports(model: ir.Model) -> list[NodeReport]:
    """The report rows of the INT8 decisions recorded on the main graph's nodes."""
    return [
        NodeReport(
            name=node.name or "",
            op_type=node.op_type,
            precision="int8" if d.int8 else "fp32",
            op_class=d.role or "none",
            step="int8",
            reason=d.reason,
            macs=int(node.meta.get(MACS, 0)),
        )
        for node in model.graph
        if (d := int8_decision(node)) is not None and node.op_type not in _QDQ_OPS
    ]


def _fill_report(report: Report, pipeline: QuantizePipeline, model: ir.Model) -> None:
    from mixprec.pipeline.convert import _report_stages

    _report_stages(report, pipeline.stages, model)
    report.nodes = int8_node_reports(model)
    report.calibrated = pipeline.qconfig.mode != "dynamic"
    applied = pipeline.stages["apply"].result(QuantizeQDQResult)
    dynamic = pipeline.stages["apply"].result(QuantizeDynamicResult)
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


_QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
