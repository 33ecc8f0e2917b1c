"""bf16 in OpenVINO without Converts: mixprec's bf16 decisions as OpenVINO precision marks.

The stages run through ``annotate`` (the model prepared and painted for bf16, nothing
rewritten); the FP32 model that comes out carries, in its ``metadata_props``, the names of
the nodes the painting kept FP32 (:data:`~mixprec.io.runtime_fields.FP32_NODES_KEY`).
OpenVINO runs it with ``INFERENCE_PRECISION_HINT=bf16`` and those nodes marked to keep
their precision (:mod:`mixprec.runtime.ov_marks`): its own lowering, without a Convert at
every FP32 island, but with mixprec's reasons for where FP32 stays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import is_constant_node
from mixprec.io.runtime_fields import with_fp32_nodes
from mixprec.pipeline.convert import CalibrationData, run_convert
from mixprec.pipeline.report import Report
from mixprec.precision.paint import Precision, decision_of

__all__ = ["bf16_marked", "kept_fp32"]


def kept_fp32(model: ir.Model) -> list[str]:
    """Names of the main graph's painted nodes kept FP32 that read or write a float32
    tensor (what OpenVINO's bf16 hint would otherwise lower), in graph order; Constant
    nodes are data, not computation, and are left out. Nodes inside If/Loop/Scan bodies
    are not listed: OpenVINO holds those bodies as models of their own."""
    names = []
    for node in model.graph:
        decision = decision_of(node)
        if decision is None or decision.precision is not Precision.FP32 or not node.name:
            continue
        if is_constant_node(node):
            continue
        values = [v for v in (*node.inputs, *node.outputs) if v is not None]
        if any(v.dtype == ir.DataType.FLOAT for v in values):
            names.append(node.name)
    return names


def bf16_marked(
    model: onnx.ModelProto,
    calibration_data: CalibrationData | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> tuple[onnx.ModelProto, Report]:
    """The FP32 model as the bf16 stages prepared it (the same network: opset upgraded
    where bf16 needs it, names repaired), listing the nodes the bf16 painting keeps FP32;
    and the painting's report.

    Args:
        model: the FP32 model (not mutated).
        calibration_data: inputs for the ranges the painting reads (as
            :func:`mixprec.convert` takes them); None generates one sample.
        progress: called with a short message at each stage.
        **options: :class:`~mixprec.core.config.ConvertConfig` fields and policy options
            (``exclude_nodes``, ``deny_add``, ...), as :func:`mixprec.convert` takes them.

    Example:
        >>> proto, report = bf16_marked(onnx.load("m.onnx"), samples)  # doctest: +SKIP
        >>> write_marked_ir(proto, "m_bf16.xml")                        # doctest: +SKIP

    Raises:
        MixprecError: an option asks for another target than bf16, or the stages refuse
            the model (one line).
    """
    config = ConvertConfig.resolve("bfloat16", **options)
    if config.target != "bfloat16":
        raise MixprecError(f"OpenVINO precision marks are a bf16 form, not {config.target}")
    work, report = run_convert(
        ir.from_proto(model),
        config,
        calibration_data=calibration_data,
        progress=progress,
        until="annotate",
    )
    # nodes the opset upgrade added (a Softmax's reshapes) get names: a mark needs one
    work = common.NameFixPass()(work).model
    names = kept_fp32(work)
    return with_fp32_nodes(ir.to_proto(work), names), report
