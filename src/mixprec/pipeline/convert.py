"""The FP16/BF16 composition: the stages of :class:`~mixprec.pipeline.stages.Pipeline` run
on a loaded model, and the :class:`~mixprec.pipeline.report.Report` built from what they
recorded on it. :mod:`mixprec.api.convert` loads, calls :func:`run_convert` and saves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import calibration_of
from mixprec.core.config import ConvertConfig
from mixprec.core.constants import const_tensor
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, iter_nodes
from mixprec.core.ops import LOW_TYPES, is_onnx_domain
from mixprec.core.policy import normalize_dtype
from mixprec.core.registry import node_info
from mixprec.io.models import copy_model_file, save_model
from mixprec.io.runtime_fields import RUNTIME_FIELDS
from mixprec.passes.cleanup import annotated_values
from mixprec.passes.fold import FoldBatchNormResult, FoldCastsResult
from mixprec.passes.opset import UpgradeOpsetResult
from mixprec.passes.sanitize import SanitizeResult
from mixprec.passes.shapes import InferShapesResult, ReconcileDeclaredShapesResult
from mixprec.pipeline.report import Report, node_row
from mixprec.pipeline.stages import Pipeline, Stage
from mixprec.precision.paint import painted
from mixprec.precision.rewrite import ApplyPrecisionResult, RemoveRedundantCastsResult

__all__ = [
    "ConversionResult",
    "count_casts",
    "notes_about_input",
    "param_bytes",
    "report_stages",
    "resolve_config",
    "run_convert",
    "start_report",
]

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model
CalibrationData = Mapping[str, Any] | Iterable[Mapping[str, Any]]


@dataclass
class ConversionResult:
    """The converted model and the report.

    Attributes:
        model: the converted model as an ``onnx_ir.Model``.
        report: what was done and why.
        input_kind: "path", "proto" or "ir": the form the input was given in.
        source_file: the input's file when the result is that model unchanged and the
            file holds all of it (no external data): :meth:`save` copies its bytes.
    """

    model: ir.Model
    report: Report
    input_kind: str
    source_file: str | None = None

    @property
    def model_proto(self) -> onnx.ModelProto:
        """The converted model as an ``onnx.ModelProto``."""
        return ir.to_proto(self.model)

    @property
    def converted(self) -> onnx.ModelProto | ir.Model:
        """The converted model in the form the input was given in (a proto for paths)."""
        return self.model if self.input_kind == "ir" else self.model_proto

    def save(self, path: str | os.PathLike[str], *, external_data: bool = False) -> None:
        """Write the model atomically (temporary file, then rename); an unchanged input
        file is written byte for byte as it was given."""
        if self.source_file is not None and not external_data:
            copy_model_file(self.source_file, path)
        else:
            save_model(self.model, path, external_data=external_data)


def count_casts(model: ir.Model) -> int:
    """Cast nodes in every graph of ``model``."""
    return sum(1 for n in iter_nodes(model.graph) if n.op_type == "Cast")


def param_bytes(model: ir.Model) -> int:
    """Bytes of the initializers and Constant tensors in every graph of ``model``."""
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


def notes_about_input(model: ir.Model) -> list[str]:
    """What the report says about the input as given (parts left alone and why). An
    earlier ``mixprec optimize``'s runtime fields are dropped from ``model`` (they chose a
    runtime for the input's precisions, not for what this run writes)."""
    notes = []
    stale = {k: v for k, v in model.metadata_props.items() if k in RUNTIME_FIELDS}
    if stale:
        for key in stale:
            del model.metadata_props[key]
        fields = ", ".join(f"{k}={v}" for k, v in stale.items())
        notes.append(
            f"the input's runtime fields ({fields}) dropped: they chose the input's runtime"
        )
    has_low = any(
        v is not None and v.dtype in LOW_TYPES
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
            if not is_onnx_domain(n.domain)
        }
    )
    if custom:
        notes.append(f"custom-domain ops kept in their precision: {', '.join(custom[:10])}")
    return notes


def resolve_config(
    target_dtype: str | None, config: ConvertConfig | None, options: dict[str, Any]
) -> ConvertConfig:
    """The config of a call: ``config`` with ``options`` replaced, or one resolved from them."""
    if config is not None and not isinstance(config, ConvertConfig):
        raise TypeError(f"config must be a mixprec.ConvertConfig, not {type(config).__name__}")
    if config is None:
        return ConvertConfig.resolve(target_dtype, **options)
    if target_dtype is not None and normalize_dtype(target_dtype) != config.target:
        raise MixprecError(
            f"target_dtype {target_dtype!r} contradicts config (target {config.target})"
        )
    return config.replace(**options) if options else config


def start_report(work: ir.Model, target: str, policy: dict[str, Any]) -> Report:
    """A report for ``work`` as loaded: the notes about the input, its casts and bytes."""
    report = Report(target=target, policy=policy)
    report.notes.extend(notes_about_input(work))
    report.casts_before = count_casts(work)
    report.param_bytes_before = param_bytes(work)
    return report


def run_convert(
    work: ir.Model,
    config: ConvertConfig,
    *,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
    until: str = "check",
) -> tuple[ir.Model, Report]:
    """Run the stages through ``until`` on ``work`` (a private copy, changed in place) and
    build the report; returns the model (always use it) and the report."""
    report = start_report(work, config.target, config.policy.to_dict())
    pipeline = Pipeline(config, calibration_data=calibration_data, progress=progress)
    pipeline.keep_annotations = annotated_values(work)
    functions = len(work.functions)
    work = pipeline.run(work, until=until)
    report.timings = dict(pipeline.timings)
    if functions:
        report.notes.insert(0, f"inlined {functions} model-local function(s) before painting")
    report_stages(report, pipeline.stages, work)
    if "apply" in pipeline.stages:
        report.casts_after = count_casts(work)
        report.param_bytes_after = param_bytes(work)
    return work, report


def report_stages(report: Report, stages: Mapping[str, Stage], model: ir.Model) -> None:
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
        report.nodes = [row for node, _ in painted(model) if (row := node_row(node))]


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
