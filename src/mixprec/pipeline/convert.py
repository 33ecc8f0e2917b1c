"""Public entry points: :func:`convert` and :func:`inspect`.

They resolve a :class:`~mixprec.core.config.ConvertConfig`, run the stages of
:class:`~mixprec.pipeline.stages.Pipeline` on a private copy of the model, and build the
:class:`~mixprec.pipeline.report.Report` from what the stages recorded on the model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import MACS, calibration_of
from mixprec.core.config import ConvertConfig
from mixprec.core.constants import const_tensor
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, iter_nodes
from mixprec.core.registry import node_info
from mixprec.io.external import folder_of, model_from_proto, real_folder
from mixprec.io.models import check_opset, load_model, save_model
from mixprec.io.sanitize import SanitizeResult
from mixprec.passes.cleanup import annotated_values
from mixprec.passes.fold import FoldBatchNormResult, FoldCastsResult
from mixprec.passes.opset import UpgradeOpsetResult
from mixprec.passes.shapes import InferShapesResult, ReconcileDeclaredShapesResult
from mixprec.pipeline.report import NodeReport, Report
from mixprec.pipeline.stages import Pipeline, Stage
from mixprec.precision.paint import painted
from mixprec.precision.rewrite import ApplyPrecisionResult, RemoveRedundantCastsResult

__all__ = ["ConversionResult", "convert", "inspect"]

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model
CalibrationData = Mapping[str, Any] | Iterable[Mapping[str, Any]]


@dataclass
class ConversionResult:
    """The converted model and the report.

    Attributes:
        model: the converted model as an ``onnx_ir.Model``.
        report: what was done and why.
        input_kind: "path", "proto" or "ir": the form the input was given in.
    """

    model: ir.Model
    report: Report
    input_kind: str

    @property
    def model_proto(self) -> onnx.ModelProto:
        """The converted model as an ``onnx.ModelProto``."""
        return ir.to_proto(self.model)

    @property
    def converted(self) -> onnx.ModelProto | ir.Model:
        """The converted model in the form the input was given in (a proto for paths)."""
        return self.model if self.input_kind == "ir" else self.model_proto

    def save(self, path: str | os.PathLike[str], *, external_data: bool = False) -> None:
        """Write the model atomically (temporary file, then rename)."""
        save_model(self.model, path, external_data=external_data)


def load_input(
    model: ModelLike, base_dir: str | os.PathLike[str] | None = None
) -> tuple[ir.Model, str]:
    """A private copy of ``model`` and the form it came in ("ir", "proto" or "path").

    External data is read (and checked) here, through :mod:`mixprec.io.external`: from the
    real folder of a model file; for an in-memory model from ``base_dir``, or the folder
    its ``onnx_ir`` tensors were loaded from. The copy holds no external tensor.
    """
    if isinstance(model, ir.Model):
        folder = folder_of(model, base_dir)
        return model_from_proto(ir.to_proto(model), where="model", folder=folder), "ir"
    if isinstance(model, onnx.ModelProto):
        check_opset(model)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return model_from_proto(copy, where="model", folder=base_dir), "proto"
    if isinstance(model, str | os.PathLike):
        loaded = load_model(model)
        if base_dir is not None:
            own = os.path.dirname(os.path.realpath(model))
            if real_folder(base_dir) != own:
                raise MixprecError(
                    f"{os.fspath(model)}: base_dir={os.fspath(base_dir)} is not the folder of "
                    f"the model file ({own}), where its external data is read from"
                )
        return loaded, "path"
    raise MixprecError(
        f"model must be a path, onnx.ModelProto or onnx_ir.Model, not {type(model).__name__}"
    )


def _count_casts(model: ir.Model) -> int:
    return sum(1 for n in iter_nodes(model.graph) if n.op_type == "Cast")


def _param_bytes(model: ir.Model) -> int:
    total = 0
    graphs = all_graphs(model.graph)
    for graph in graphs:
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
        for node in graph:
            if node.op_type == "Constant":
                tensor = const_tensor(node.outputs[0])
                if tensor is not None:
                    total += tensor.nbytes
    return total


def _notes_about_input(model: ir.Model) -> list[str]:
    notes = []
    low = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
    has_low = any(
        v is not None and v.dtype in low
        for n in iter_nodes(model.graph)
        for v in [*n.inputs, *n.outputs]
    )
    if has_low:
        notes.append("the model already holds float16/bfloat16 tensors: those parts are left alone")
    quant = sorted({n.op_type for n in iter_nodes(model.graph) if node_info(n).quantized})
    if quant:
        notes.append(f"the model holds quantized ops ({', '.join(quant)}): left alone")
    custom = sorted(
        {
            f"{n.domain}::{n.op_type}"
            for n in iter_nodes(model.graph)
            if n.domain not in ("", "ai.onnx")
        }
    )
    if custom:
        notes.append(f"custom-domain ops kept in their precision: {', '.join(custom[:10])}")
    return notes


def _resolve_config(
    target_dtype: str | None, config: ConvertConfig | None, options: dict[str, Any]
) -> ConvertConfig:
    if config is not None and not isinstance(config, ConvertConfig):
        raise TypeError(f"config must be a mixprec.ConvertConfig, not {type(config).__name__}")
    if config is None:
        return ConvertConfig.resolve(target_dtype, **options)
    if target_dtype is not None:
        from mixprec.core.policy import normalize_dtype

        if normalize_dtype(target_dtype) != config.target:
            raise MixprecError(
                f"target_dtype {target_dtype!r} contradicts config (target {config.target})"
            )
    return config.replace(**options) if options else config


def _run(
    model: ModelLike,
    target_dtype: str | None,
    config: ConvertConfig | None,
    calibration_data: CalibrationData | None,
    progress: Callable[[str], None] | None,
    options: dict[str, Any],
    until: str,
    base_dir: str | os.PathLike[str] | None = None,
) -> ConversionResult:
    config = _resolve_config(target_dtype, config, options)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable, not {type(progress).__name__}")
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    say("loading")
    work, kind = load_input(model, base_dir)
    report = Report(target=config.target, policy=config.policy.to_dict())
    report.notes.extend(_notes_about_input(work))
    original_proto = ir.to_proto(work) if config.log_dir is not None else None
    report.casts_before = _count_casts(work)
    report.param_bytes_before = _param_bytes(work)
    pipeline = Pipeline(config, calibration_data=calibration_data, progress=progress)
    pipeline.keep_annotations = annotated_values(work)
    functions = len(work.functions)
    load_s = time.perf_counter() - t0
    work = pipeline.run(work, until=until)
    report.timings = {"load": load_s, **pipeline.timings}
    if functions:
        report.notes.insert(0, f"inlined {functions} model-local function(s) before painting")
    _report_stages(report, pipeline.stages, work)
    if "apply" in pipeline.stages:
        report.casts_after = _count_casts(work)
        report.param_bytes_after = _param_bytes(work)
    if original_proto is not None and config.log_dir is not None:
        from mixprec.report.logdir import write_log_dir

        write_log_dir(config.log_dir, original_proto, work, report)
    return ConversionResult(work, report, kind)


def _report_stages(report: Report, stages: Mapping[str, Stage], model: ir.Model) -> None:
    """Fill the report from what each stage that ran recorded (results and meta)."""
    for name, stage in stages.items():
        for result in stage.results:
            _report_result(report, name, result)
    if "calibrate" in stages:
        calibration = calibration_of(model)
        report.input_shapes = calibration.input_shapes
        report.calibrated = calibration.samples > 0
        report.notes.extend(calibration.notes)
    if "annotate" in stages:
        report.nodes = [
            NodeReport(
                name=node.name or "",
                op_type=node.op_type,
                precision=d.precision.value,
                op_class=d.op_class.value,
                step=d.step,
                reason=d.reason,
                macs=int(node.meta.get(MACS, 0)),
            )
            for node, d in painted(model)
        ]


def _report_result(report: Report, stage: str, result: ir.passes.PassResult) -> None:
    if isinstance(result, SanitizeResult):
        report.notes.extend(result.notes)
    elif isinstance(result, FoldBatchNormResult):
        report.batchnorm_folded = result.folded
    elif isinstance(result, FoldCastsResult) and result.modified:
        report.notes.append(
            f"folded {result.folded} Cast(s) of constants and removed {result.identities} "
            "Cast(s) to their input's own dtype"
        )
    elif isinstance(result, InferShapesResult):
        when = "in the input model" if stage == "prepare" else "after the opset upgrade"
        report.notes.extend(f"shape {fix.describe()} ({when})" for fix in result.fixes)
        if result.failure:
            report.notes.append(f"shape inference failed ({result.failure}); declared types used")
    elif isinstance(result, ReconcileDeclaredShapesResult):
        report.notes.extend(
            f"shape {fix.describe()} (found by the final check)" for fix in result.fixes
        )
    elif isinstance(result, UpgradeOpsetResult) and result.note:
        report.notes.append(result.note)
    elif isinstance(result, ApplyPrecisionResult):
        report.casts_inserted = result.casts_inserted
        report.weights = {k: int(v) for k, v in vars(result.weights).items()}
        if result.retargeted_casts:
            report.notes.append(
                f"{len(result.retargeted_casts)} Cast(to=float) node(s) inside low-precision "
                "regions retargeted to the low dtype"
            )
    elif isinstance(result, RemoveRedundantCastsResult):
        report.casts_removed = result.removed


def convert(
    model: ModelLike,
    target_dtype: str | None = None,
    *,
    config: ConvertConfig | None = None,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> ConversionResult:
    """Convert an FP32 model to FP16/BF16 mixed precision.

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16" (default: ``MIXPREC_DTYPE``,
            else float16).
        config: a ready :class:`ConvertConfig`; ``options`` then replace its fields.
        calibration_data: inputs for the FP32 reference run: one feed dict, a list of
            them, or any iterable/generator (streamed); None generates one sample.
        progress: called with a short message at each stage.
        base_dir: the folder of the ``.onnx`` file of an in-memory model (proto or
            ``onnx_ir``) whose tensors keep their data in external files; they are read
            from there and nowhere else (never the current directory). A model given by
            path reads them from its file's real folder (``base_dir`` may only repeat
            it); an ``onnx_ir`` model from ``ir.load(path)`` carries its folder.
        **options: the fields of :class:`ConvertConfig` (``keep_io_types``, ``calibrate``,
            ``observer``, ``shapes``, ``range_threshold``, ``fold_batchnorm``,
            ``upgrade_opset``, ``clip_weights``, ``check``, ``log_dir``, ``policy``), and
            the policy options ``allow_add``, ``allow_remove``, ..., ``clear_remove``
            (op types added to / removed from each list; None: use ``MIXPREC_*LIST_*``),
            ``exclude_nodes`` (names or regular expressions kept FP32), ``force_all``
            and ``output_fp32_ops`` (compute low, hand float32 on). ``max_error=X``
            tunes instead (:func:`mixprec.tune` with ``calibration_data`` as its data,
            ``metric`` default "rel-l2", budget X) and returns its ``TuneResult``.

    Returns:
        A :class:`ConversionResult` with ``.model``, ``.model_proto``, ``.report``, ``.save()``.

    Raises:
        MixprecError: bad input or options (names the stage when it came from one).
        InternalError: a fault in mixprec (names the stage and pass).

    Example:
        >>> result = mixprec.convert("model.onnx", "fp16")      # doctest: +SKIP
        >>> result.save("model_fp16.onnx")                       # doctest: +SKIP
        >>> print(result.report.format_summary())                # doctest: +SKIP
    """
    if options.get("max_error") is not None:
        if config is not None or base_dir is not None:
            raise MixprecError("max_error= takes keyword options, not config= or base_dir=")
        from mixprec.tune.search import tune

        budget = options.pop("max_error")
        metric = options.pop("metric", "rel-l2")
        return tune(
            model,
            target_dtype,
            calibration_data,
            metric=metric,
            budget=budget,
            progress=progress,
            **options,
        )
    options.pop("max_error", None)
    return _run(model, target_dtype, config, calibration_data, progress, options, "check", base_dir)


def inspect(
    model: ModelLike,
    target_dtype: str | None = None,
    *,
    config: ConvertConfig | None = None,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Report:
    """Paint without rewriting: the report of the decisions :func:`convert` would apply.

    Runs the stages up to ``annotate`` and stops; accepts the same arguments as
    :func:`convert`.
    """
    options.pop("check", None)
    return _run(
        model, target_dtype, config, calibration_data, progress, options, "annotate", base_dir
    ).report
