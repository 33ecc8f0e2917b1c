"""Validation: run a converted model and its FP32 original on the same inputs, compare."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, iter_nodes
from mixprec.core.metrics import DEFAULT_RTOL, OutputComparison, compare_outputs
from mixprec.core.ops import DEFAULT_ATOL, DTYPE_ATTRS, parse_dtype
from mixprec.core.output_kinds import classify_outputs
from mixprec.core.registry import node_info
from mixprec.inputs.feeds import feeds_for
from mixprec.runtime.emulate import emulate_low_precision
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import check_plan, engine_for, run_model

__all__ = ["ValidationReport", "detect_low_dtype", "lowered_to", "validate_models"]

logger = logging.getLogger(__name__)

_HOW = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO", "emulated": "FP32 emulation"}
# What ran a model, as ValidationReport.kind names it (another engine: its name).
_KIND = {"ort": "onnxruntime", "openvino": "openvino"}
# Relative tolerance used when the converted model has no low-precision tensor at all.
_NO_LOW_RTOL = 1e-4
# Integer attributes that name an output element type.


def _elem_types_of(tp: ir.TypeProtocol | None) -> set[ir.DataType]:
    if isinstance(tp, ir.TensorType):
        return {tp.dtype}
    if isinstance(tp, ir.SequenceType | ir.OptionalType):
        return _elem_types_of(tp.elem_type)
    return set()


def detect_low_dtype(model: onnx.ModelProto | ir.Model) -> str:
    """``"int8"`` if the model quantizes (QuantizeLinear/DequantizeLinear, integer ops),
    else ``"bfloat16"`` if it has any bfloat16 tensor, else ``"float16"`` if it has any
    float16 tensor, else ``"none"``."""
    m = model if isinstance(model, ir.Model) else ir.from_proto(model)
    if any(node_info(n).quantized for n in iter_nodes(m.graph)):
        return "int8"
    found: set[int] = set()
    for graph in all_graphs(m.graph):
        values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
        values += [v for node in graph for v in node.outputs]
        for value in values:
            found.update(_elem_types_of(value.type))
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR:
                    found.add(attr.as_tensor().dtype)
                elif attr.type == ir.AttributeType.INT and attr.name in DTYPE_ATTRS:
                    found.add(attr.as_int())
    if ir.DataType.BFLOAT16 in found:
        return "bfloat16"
    if ir.DataType.FLOAT16 in found:
        return "float16"
    return "none"


@dataclass(frozen=True)
class ValidationReport:
    """Result of :func:`validate_models`.

    Attributes:
        kind: ``"onnxruntime"`` or ``"openvino"`` (the converted model ran as is in that
            engine) or ``"emulated"`` (its FP32 emulation from
            :class:`EmulateLowPrecisionPass` ran in ONNX Runtime).
        low_dtype: ``"float16"``, ``"bfloat16"`` or ``"none"``.
        rtol: Relative L2 tolerance used.
        atol: Absolute tolerance used.
        outputs: One comparison per reference output.
        fallback_reason: Why ``auto`` mode fell back to emulation, or empty.
        input_shapes: The shape of every input array the models were run with.
        notes: How the inputs were made (symbolic dims resolved, value heuristics).
        runtime: What ran the converted model: ``runtime``, ``label``, ``version``,
            ``precision``, ``threads`` and ``cpu`` (the FP32 reference always runs in
            ONNX Runtime).
        checks: Each output read as rows of answers (:func:`mixprec.validate` fills them
            from :mod:`mixprec.guard.checks`: argmax rows, detections, embedding rows,
            the worst channel), as dicts with ``output``, ``kind``, ``value``,
            ``limit``, ``passed``, ``rows``, ``reason`` and ``text``; every one must pass.
        arrays: The FP32 and the converted outputs it compared (not in ``to_dict``).
    """

    kind: str
    low_dtype: str
    rtol: float
    atol: float
    outputs: tuple[OutputComparison, ...]
    fallback_reason: str = ""
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    runtime: dict[str, object] = field(default_factory=dict)
    checks: tuple[Mapping[str, object], ...] = ()
    arrays: tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def passed(self) -> bool:
        """Whether every output passed, and every reading of its rows."""
        return all(o.passed for o in self.outputs) and all(c["passed"] for c in self.checks)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the report."""
        return {
            "kind": self.kind,
            "low_dtype": self.low_dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
            "fallback_reason": self.fallback_reason,
            "outputs": [o.to_dict() for o in self.outputs],
            "input_shapes": {k: list(v) for k, v in self.input_shapes.items()},
            "notes": list(self.notes),
            "runtime": dict(self.runtime),
            "checks": [dict(c) for c in self.checks],
        }

    def format_table(self) -> str:
        """A readable, aligned text table of the comparisons and the verdict."""
        header = ("output", "max abs err", "rel L2", "top-1", "ok")
        rows = [header]
        for o in self.outputs:
            top1 = "-" if o.top1_agreement is None else f"{100.0 * o.top1_agreement:.1f}%"
            ok = "yes" if o.passed else "NO"
            rows.append((o.name, f"{o.max_abs_error:.3g}", f"{o.rel_l2_error:.3g}", top1, ok))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for o in self.outputs:
            if o.note:
                lines.append(f"note: {o.name}: {o.note}")
        for c in self.checks:  # how each output was read, as rows of answers
            ok = "ok" if c["passed"] else "NO"
            lines.append(f"{ok:>3} {c['output']}: {c['text']}")
            lines.append(f"      read as {c['reason']}")
        how = _HOW.get(self.kind, self.kind)
        if self.kind != "emulated" and self.runtime:
            how = f"{self.runtime.get('label', how)} {self.runtime.get('version', '')}".strip()
            how += f" ({self.runtime.get('precision')})"
        verdict = "PASSED" if self.passed else "FAILED"
        what = "float32" if self.low_dtype == "none" else self.low_dtype  # no low tensor
        lines.append(
            f"{verdict}: {what} model checked with {how}, rtol {self.rtol:g}, atol {self.atol:g}"
        )
        if self.input_shapes:
            shown = ", ".join(f"{k} {list(v)}" for k, v in self.input_shapes.items())
            lines.append(f"inputs: {shown}")
        lines.extend(f"note: {n}" for n in self.notes)
        if self.fallback_reason:
            lines.append(f"fallback: {self.fallback_reason}")
        return "\n".join(lines)


def validate_models(
    original: onnx.ModelProto,
    converted: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    rtol: float | None = None,
    atol: float = DEFAULT_ATOL,
    mode: str = "auto",
    threads: int = 2,
    notes: Sequence[str] = (),
    runtime: RuntimeOptions | None = None,
) -> ValidationReport:
    """Runs both models on the same inputs and compares their outputs.

    The FP32 ``original`` runs in ONNX Runtime; ``converted`` runs in the engine
    ``runtime`` names (default: see :func:`~mixprec.runtime.engines.check_plan`, which
    sends a bf16 model to OpenVINO where this CPU computes bf16). Modes: ``"ort"`` runs
    the converted model as is in that engine; ``"emulated"`` runs
    :func:`emulate_low_precision` of it in ONNX Runtime; ``"auto"`` runs it as is and
    emulates when the engine cannot load or run it (a bf16 model in ONNX Runtime) or
    would compute its bf16 layers in f32 (OpenVINO on a CPU without bf16). A model
    OpenVINO cannot read is checked in ONNX Runtime instead, with OpenVINO's reason in
    ``fallback_reason``. Feeds are cast to each model's declared input dtypes.

    Args:
        original: The FP32 reference model.
        converted: The mixed-precision model.
        feeds: Input arrays by name (for the original model).
        rtol: Relative L2 tolerance; default :data:`DEFAULT_RTOL` for the detected low
            dtype (1e-4 when the converted model has none).
        atol: Absolute tolerance, for outputs near zero.
        mode: ``"auto"``, ``"ort"`` or ``"emulated"``.
        threads: Intra-op thread count (when ``runtime`` is None).
        notes: How ``feeds`` were made, carried into the report.
        runtime: The engine that runs the converted model.

    Returns:
        The report; ``report.passed`` tells whether every output is within tolerance.

    Raises:
        MixprecError: An unknown mode, the original model cannot run, or (mode ``"ort"``
            or after emulation) the converted model cannot run.
    """
    if mode not in ("auto", "ort", "emulated"):
        raise MixprecError(f"unknown validation mode {mode!r}; use auto, ort or emulated")
    low_dtype = detect_low_dtype(converted)
    lowered = lowered_to(low_dtype, runtime)
    tol = rtol if rtol is not None else DEFAULT_RTOL.get(lowered, _NO_LOW_RTOL)
    basic = RuntimeOptions(threads=threads, optimization="basic")
    reference = run_model(original, feeds_for(original, feeds), basic)
    if runtime is None and threads != 2:
        runtime = RuntimeOptions(threads=threads)
    plan = check_plan(low_dtype, runtime, mode)
    result: dict[str, np.ndarray] | None = None
    kind, fallback, described = "emulated", plan.why, dict[str, object]()
    if not plan.emulated:
        result, kind, fallback, described = _run_as_is(converted, feeds, plan.options, mode)
    if result is None:
        kind = "emulated"
        emulated = emulate_low_precision(converted)
        # unoptimized: fusions would swallow the Cast round trips that carry the emulation
        plain = RuntimeOptions(threads=plan.options.threads, optimization="off")
        result = run_model(emulated, feeds_for(emulated, feeds), plain)
        described = {**engine_for(plain).describe(plan.options), "precision": "FP32 emulation"}
        if fallback and plan.emulated:
            fallback = f"{fallback}; emulated the {low_dtype} model in float32 instead"
    kinds = classify_outputs(ir.from_proto(original))  # top-1 on class scores only
    comparisons = compare_outputs(reference, result, rtol=tol, atol=atol, kinds=kinds)
    shapes = {k: [int(d) for d in np.shape(v)] for k, v in feeds_for(original, feeds).items()}
    said = described.get("notes")  # what the engine ran otherwise than asked
    if isinstance(said, list):
        notes = (*notes, *said)
    return ValidationReport(
        kind, low_dtype, tol, atol, tuple(comparisons), fallback, shapes, tuple(notes), described,
        arrays=(reference, result),
    )  # fmt: skip


def lowered_to(low_dtype: str, runtime: RuntimeOptions | None) -> str:
    """The dtype whose tolerance applies: the model's lowest, or, for an FP32 model, the
    one its engine's precision hint lowers FP32 layers to (OpenVINO's ``bf16`` hint: the
    marked pair of ``bf16-lists-openvino`` ran 1.2e-3 off FP32 on an avx512_bf16 CPU,
    over FP32's 1e-3)."""
    if low_dtype == "none" and runtime is not None and runtime.precision not in (None, "f32"):
        return parse_dtype(runtime.precision, ("float16", "bfloat16"))
    return low_dtype


def _run_as_is(
    converted: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    options: RuntimeOptions,
    mode: str,
) -> tuple[dict[str, np.ndarray] | None, str, str, dict[str, object]]:
    """Runs ``converted`` as is: (outputs or None to emulate, kind, fallback, described).

    A model another engine (OpenVINO) cannot load goes to the default engine, ONNX
    Runtime's CPU provider (then emulation), with its reason.
    """
    engine = engine_for(options)
    low = detect_low_dtype(converted)
    default = RuntimeOptions(threads=options.threads)
    fallback = ""
    try:
        session = engine.session(converted, options)
        outputs = session.run(feeds_for(converted, feeds))
        described = engine.describe(options)
        if session.notes:
            described["notes"] = list(session.notes)
        return outputs, _KIND.get(engine.name, engine.name), "", described
    except (RuntimeLoadError, RuntimeRunError) as e:
        if mode == "ort" and options == default:
            raise
        fallback = str(e)
        logger.info("validation: %s", e)
    if options != default:
        found, kind, more, described = _run_as_is(converted, feeds, default, "auto")
        if found is not None:
            return found, kind, f"{fallback}; checked in onnxruntime instead", described
        return None, "emulated", f"{fallback}; {more}", described
    return None, "emulated", f"{fallback}; emulated the {low} model in float32 instead", {}
