"""Public entry points: :func:`convert` and :func:`inspect`.

They assemble the passes: inline functions, name nodes, fold BatchNormalization, infer
types, calibrate ranges (ONNX Runtime), paint, apply precision, remove redundant casts,
clean up, check.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec._config import ListChanges, resolve_log_dir, resolve_policy
from mixprec._constants import const_tensor
from mixprec._errors import MixprecError
from mixprec._feeds import DEFAULT_SYMBOLIC_DIM as DEFAULT_SYMBOLIC_DIM
from mixprec._feeds import make_inputs, resolve_input_shapes
from mixprec._fold import FoldBatchNormPass, FoldBatchNormResult, FoldCastsPass, FoldCastsResult
from mixprec._graphs import all_graphs, iter_nodes, opset_of
from mixprec._io import check_opset, load_model, save_model
from mixprec._paint import PaintPass, PaintResult
from mixprec._policy import OpClass, Policy
from mixprec._protos import weightless_proto
from mixprec._report import NodeReport, Report, concrete_shapes, count_macs
from mixprec._rewrite import (
    ApplyPrecisionPass,
    ApplyPrecisionResult,
    RemoveRedundantCastsPass,
    RemoveRedundantCastsResult,
)

__all__ = ["ConversionResult", "convert", "inspect"]

ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model


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


def _load(model: ModelLike) -> tuple[ir.Model, str]:
    """A private copy of ``model`` and the form it came in ("ir", "proto" or "path")."""
    if isinstance(model, ir.Model):
        return ir.from_proto(ir.to_proto(model)), "ir"
    if isinstance(model, onnx.ModelProto):
        check_opset(model)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return ir.from_proto(copy), "proto"
    if isinstance(model, str | os.PathLike):
        return load_model(model), "path"
    raise MixprecError(
        f"model must be a path, onnx.ModelProto or onnx_ir.Model, not {type(model).__name__}"
    )


def _annotated_values(model: ir.Model) -> set[str]:
    """Names of intermediate values that carry a type annotation (value_info)."""
    return {
        v.name
        for n in iter_nodes(model.graph)
        for v in n.outputs
        if v.name and v.type is not None and not v.is_graph_output()
    }


def _drop_added_annotations(model: ir.Model, keep: set[str]) -> None:
    """Forget the types/shapes of intermediates that the input model did not annotate.

    Shape inference annotated every value while converting; writing all of that as
    value_info would grow small models by a tenth and add nothing a runtime needs.
    Annotations the input had are kept (retyped where the value changed dtype).
    """
    for node in iter_nodes(model.graph):
        for value in node.outputs:
            if value.name not in keep and not value.is_graph_output():
                value.type = None
                value.shape = None
    graphs = all_graphs(model.graph)
    for graph in graphs:
        for value in graph.initializers.values():
            # The tensor itself carries dtype and dims; a value_info entry only repeats them.
            if not value.is_graph_input() and not value.is_graph_output():
                value.type = None
                value.shape = None


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
    quant_ops = {
        "QuantizeLinear",
        "DequantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeLinear",
    }
    has_low = any(
        v is not None and v.dtype in low
        for n in iter_nodes(model.graph)
        for v in [*n.inputs, *n.outputs]
    )
    if has_low:
        notes.append("the model already holds float16/bfloat16 tensors: those parts are left alone")
    quant = sorted({n.op_type for n in iter_nodes(model.graph) if n.op_type in quant_ops})
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


def _input_shapes(
    proto: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None
) -> tuple[dict[str, list[int]], list[str]]:
    """Concrete input shapes: the one rule of :func:`mixprec._feeds.resolve_input_shapes`."""
    return resolve_input_shapes(proto, shapes)


#: The first ai.onnx opset whose Conv, ConvTranspose, pooling and most activations admit
#: bfloat16.
BF16_OPSET = 22


def _needs_upgrade(model: ir.Model, policy: Policy) -> list[str]:
    """Op types that would admit the target dtype only at :data:`BF16_OPSET`."""
    import onnx.defs

    opset = opset_of(model, "")
    if policy.target != "bfloat16" or opset >= BF16_OPSET:
        return []
    wanted = set().union(*(policy.lists[c] for c in (OpClass.ALLOW, OpClass.INFER, OpClass.CLEAR)))
    needed = set()
    for node in iter_nodes(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in wanted:
            continue
        try:
            old = onnx.defs.get_schema(node.op_type, opset)
            new = onnx.defs.get_schema(node.op_type, BF16_OPSET)
        except onnx.defs.SchemaError:
            continue

        def admits(schema: onnx.defs.OpSchema) -> bool:
            return any("tensor(bfloat16)" in c.allowed_type_strs for c in schema.type_constraints)

        if not admits(old) and admits(new):
            needed.add(node.op_type)
    return sorted(needed)


def _upgrade_opset(model: ir.Model, ops: list[str], report: Report) -> ir.Model:
    from onnx import version_converter

    opset = opset_of(model, "")
    try:
        proto = version_converter.convert_version(ir.to_proto(model), BF16_OPSET)
    except Exception as exc:
        report.notes.append(
            f"could not raise opset {opset} -> {BF16_OPSET} for bfloat16 "
            f"({str(exc).splitlines()[0][:100]}): {', '.join(ops)} stay FP32"
        )
        return model
    report.notes.append(
        f"opset raised {opset} -> {BF16_OPSET}: bfloat16 {', '.join(ops[:8])}"
        f"{' ...' if len(ops) > 8 else ''} need it (upgrade_opset=False to keep {opset})"
    )
    return ir.from_proto(proto)


def _prepare(model: ir.Model, fold_batchnorm: bool, report: Report) -> ir.Model:
    if model.functions:
        n = len(model.functions)
        common.InlinePass()(model)
        report.notes.append(f"inlined {n} model-local function(s) before painting")
    common.NameFixPass()(model)
    if fold_batchnorm:
        folded = cast(FoldBatchNormResult, FoldBatchNormPass()(model))
        report.batchnorm_folded = folded.folded
        if folded.modified:
            common.RemoveUnusedNodesPass()(model)
    try:
        common.ShapeInferencePass(data_prop=True)(model)
    except Exception as exc:  # custom ops or odd models: go on with declared types
        report.notes.append(
            f"shape inference failed ({str(exc).splitlines()[0][:120]}); declared types used"
        )
    casts = cast(FoldCastsResult, FoldCastsPass()(model))
    if casts.modified:
        report.notes.append(
            f"folded {casts.folded} Cast(s) of constants and removed {casts.identities} "
            "Cast(s) to their input's own dtype"
        )
        common.RemoveUnusedNodesPass()(model)
    return model


def _calibrate(
    proto: onnx.ModelProto,
    calibration_data: Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]] | None,
    shapes: Mapping[str, Sequence[int]] | None,
    report: Report,
    shapes_out: dict[str, list[int]],
    external: Mapping[str, np.ndarray],
) -> dict[str, float]:
    # onnxruntime is imported only when calibrating
    from mixprec._calibrate import calibrate

    concrete, notes = _input_shapes(proto, shapes)
    report.input_shapes = concrete
    if calibration_data is not None:
        result = calibrate(proto, calibration_data, shapes_out=shapes_out, external=external)
        given = sorted({vi.name for vi in proto.graph.input} & set(result.shapes))
        report.input_shapes = {k: list(result.shapes[k]) for k in given}
        report.notes.append(
            f"calibrated on {result.samples} sample(s) of the given inputs ({', '.join(given)})"
        )
    else:
        feeds, more = make_inputs(proto, shapes=concrete, seed=0)
        report.notes.extend(notes + more)
        result = calibrate(proto, feeds, shapes_out=shapes_out, external=external)
        report.notes.append(
            f"calibrated on {result.samples} sample(s) of generated inputs "
            "(images-like floats in [0,1))"
        )
    return result.absmax()


def convert(
    model: ModelLike,
    target_dtype: str | None = None,
    *,
    allow_add: Sequence[str] | None = None,
    allow_remove: Sequence[str] | None = None,
    deny_add: Sequence[str] | None = None,
    deny_remove: Sequence[str] | None = None,
    infer_add: Sequence[str] | None = None,
    infer_remove: Sequence[str] | None = None,
    clear_add: Sequence[str] | None = None,
    clear_remove: Sequence[str] | None = None,
    exclude_nodes: Sequence[str] | None = None,
    keep_io_types: bool | Sequence[str] = True,
    force_all: bool | None = None,
    output_fp32_ops: Sequence[str] = (),
    calibrate: bool = True,
    calibration_data: Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    range_threshold: float | None = None,
    fold_batchnorm: bool = True,
    upgrade_opset: bool = True,
    clip_weights: bool = False,
    check: bool = True,
    log_dir: str | os.PathLike[str] | None = None,
    policy: Policy | None = None,
    progress: Callable[[str], None] | None = None,
) -> ConversionResult:
    """Convert an FP32 model to FP16/BF16 mixed precision.

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        target_dtype: "float16"/"fp16" or "bfloat16"/"bf16" (default: ``MIXPREC_DTYPE``,
            else float16).
        allow_add, ..., clear_remove: op types added to / removed from each list (an op
            added to a list leaves its old list). ``None``: use ``MIXPREC_*LIST_*``.
        exclude_nodes: node names or regular expressions kept in FP32.
        keep_io_types: keep graph inputs/outputs float32 (True), or only the named ones.
        force_all: convert every node the schema allows (unsafe).
        output_fp32_ops: op types that compute in low precision but hand float32 on.
        calibrate: run the FP32 model once in ONNX Runtime and keep nodes whose
            activations exceed ``range_threshold`` in FP32.
        calibration_data: inputs for that run: one feed dict, or a list or any iterable
            (generator) of them, streamed one sample at a time (else generated from the
            signature).
        shapes: concrete shapes for symbolic input dims, by input name.
        range_threshold: |x| limit for activations (default: a quarter of the target's max).
        fold_batchnorm: fold BatchNormalization into the preceding Conv/Gemm first.
        upgrade_opset: for bfloat16, raise the opset to 22 when ops in the lists admit
            bfloat16 only there (recorded in the report's notes).
        clip_weights: clip out-of-range weights instead of keeping their consumers FP32.
        check: run ``onnx.checker.check_model(full_check=True)`` on the result.
        log_dir: write the graph before/after and the paint buckets there.
        policy: a ready :class:`Policy` (then list arguments and env lists are ignored).
        progress: called with a short message at each step.

    Returns:
        A :class:`ConversionResult` with ``.model``, ``.model_proto``, ``.report``, ``.save()``.

    Example:
        >>> result = mixprec.convert("model.onnx", "fp16")      # doctest: +SKIP
        >>> result.save("model_fp16.onnx")                       # doctest: +SKIP
        >>> print(result.report.format_summary())                # doctest: +SKIP
    """
    say = progress or (lambda _msg: None)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    if policy is None:
        changes = ListChanges(
            add={
                OpClass.ALLOW: allow_add,
                OpClass.DENY: deny_add,
                OpClass.INFER: infer_add,
                OpClass.CLEAR: clear_add,
            },
            remove={
                OpClass.ALLOW: allow_remove,
                OpClass.DENY: deny_remove,
                OpClass.INFER: infer_remove,
                OpClass.CLEAR: clear_remove,
            },
        )
        policy = resolve_policy(
            target_dtype,
            changes,
            exclude_nodes=exclude_nodes,
            force_all=force_all,
            output_fp32_ops=output_fp32_ops,
        )
    log_path = resolve_log_dir(log_dir)
    keep: bool | frozenset[str] = (
        keep_io_types if isinstance(keep_io_types, bool) else frozenset(keep_io_types)
    )
    say("loading")
    work, kind = _load(model)
    report = Report(target=policy.target, policy=policy.to_dict())
    report.notes.extend(_notes_about_input(work))
    if log_path is not None:
        original_proto = ir.to_proto(work)
    report.casts_before = _count_casts(work)
    annotated = _annotated_values(work)
    report.param_bytes_before = _param_bytes(work)
    timings["load"] = time.perf_counter() - t0

    t = time.perf_counter()
    say("preparing (inline, fold BatchNormalization, shape inference)")
    if upgrade_opset:
        needed = _needs_upgrade(work, policy)
        if needed:
            work = _upgrade_opset(work, needed, report)
    _prepare(work, fold_batchnorm, report)
    timings["prepare"] = time.perf_counter() - t

    absmax: dict[str, float] = {}
    observed: dict[str, list[int]] = {}  # tensor shapes seen in the calibration run
    t = time.perf_counter()
    # Weights stay in ``work``: analysis reads only dims, ORT gets the arrays in memory.
    proto_for_macs, external = weightless_proto(work, with_arrays=calibrate)
    if calibrate:
        say("calibrating ranges with onnxruntime")
        absmax = _calibrate(proto_for_macs, calibration_data, shapes, report, observed, external)
        report.calibrated = True
    else:
        report.input_shapes, shape_notes = _input_shapes(proto_for_macs, shapes)
        report.notes.extend(shape_notes)
    del external  # the calibration run's copies of the weights
    timings["calibrate"] = time.perf_counter() - t

    t = time.perf_counter()
    say("painting")
    shaped, inferred = concrete_shapes(proto_for_macs, report.input_shapes)
    shapes_by_name: dict[str, Sequence[int | None]] = {**inferred, **observed}
    painted = cast(
        PaintResult,
        PaintPass(
            policy,
            absmax=absmax,
            range_threshold=range_threshold,
            keep_io_types=keep,
            shapes=shapes_by_name,
        )(work),
    )
    macs = count_macs(shaped, shapes_by_name)
    report.nodes = [
        NodeReport(
            name=node.name or "",
            op_type=node.op_type,
            precision=d.precision.value,
            op_class=d.op_class.value,
            step=d.step,
            reason=d.reason,
            macs=macs.get(node.name or "", 0),
        )
        for node, d in painted.decisions.items()
    ]
    timings["paint"] = time.perf_counter() - t

    t = time.perf_counter()
    say("inserting casts")
    applied = cast(
        ApplyPrecisionResult,
        ApplyPrecisionPass(
            policy,
            painted.decisions,
            painted.slots,
            keep_io_types=keep,
            clip_weights=clip_weights,
        )(work),
    )
    cleaned = cast(RemoveRedundantCastsResult, RemoveRedundantCastsPass()(work))
    common.RemoveUnusedNodesPass()(work)
    report.casts_inserted = applied.casts_inserted
    report.casts_removed = cleaned.removed
    report.weights = {k: int(v) for k, v in vars(applied.weights).items()}
    report.casts_after = _count_casts(work)
    _drop_added_annotations(work, annotated)
    report.param_bytes_after = _param_bytes(work)
    if applied.retargeted_casts:
        report.notes.append(
            f"{len(applied.retargeted_casts)} Cast(to=float) node(s) inside low-precision "
            "regions retargeted to the low dtype"
        )
    timings["rewrite"] = time.perf_counter() - t

    if check:
        t = time.perf_counter()
        say("checking the result")
        _check(work)
        timings["check"] = time.perf_counter() - t
    report.timings = timings
    if log_path is not None:
        from mixprec._logdir import write_log_dir

        write_log_dir(Path(log_path), original_proto, work, report)
    return ConversionResult(work, report, kind)


def _check(model: ir.Model) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a copy without large weight
    payloads (they become typed graph inputs): the same checks on structure, types and
    shapes, without serializing the weights.
    """
    from mixprec._protos import _light_copy

    light = _light_copy(weightless_proto(model, with_arrays=False)[0])
    try:
        onnx.checker.check_model(light, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise MixprecError(
            f"internal error: the converted model fails onnx.checker: {first}"
        ) from None


def inspect(model: ModelLike, target_dtype: str | None = None, **kwargs: Any) -> Report:
    """Paint without writing a model: the report of what :func:`convert` would do.

    Accepts the same arguments as :func:`convert`.
    """
    kwargs.setdefault("check", False)
    return convert(model, target_dtype, **kwargs).report
