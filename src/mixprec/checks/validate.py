"""Validation: a converted model against its FP32 original, run on the same inputs.

:func:`validate_models` runs both once (the converted model in the engine it will run
in, or emulated) and compares every output; :func:`validate_protos` is
:func:`mixprec.validate` on loaded models: every given sample compared (the worst one
reported) or inputs generated from the signature (the calibration's first guess, learning
from the runtime's refusals), each output also read as rows of answers.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.checks.outputs import OutputCheck, closeness_checks, row_budget, row_readings
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, iter_nodes
from mixprec.core.metrics import DEFAULT_RTOL, OutputComparison, compare_outputs
from mixprec.core.ops import DEFAULT_ATOL, DTYPE_ATTRS, parse_dtype
from mixprec.core.output_kinds import OutputKind, classify_outputs
from mixprec.core.registry import node_info
from mixprec.inputs.feeds import feeds_for, guessed_dims, make_inputs, resolve_input_shapes
from mixprec.passes.emulate import emulate_low_precision
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import check_plan, engine_for, run_model
from mixprec.runtime.fit import fit_shapes

__all__ = [
    "ValidationReport",
    "check_arguments",
    "detect_low_dtype",
    "lowered_to",
    "validate_models",
    "validate_protos",
]

logger = logging.getLogger(__name__)

_HOW = {"onnxruntime": "ONNX Runtime", "openvino": "OpenVINO", "emulated": "FP32 emulation"}
# What ran a model, as ValidationReport.kind names it (another engine: its name).
_KIND = {"ort": "onnxruntime", "openvino": "openvino"}
# Relative tolerance used when the converted model has no low-precision tensor at all.
_NO_LOW_RTOL = 1e-4


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
        checks: The verdict, in the one schema of "is it still the same model?"
            (:class:`~mixprec.checks.outputs.OutputCheck`, as the guards, optimize and
            the torch check hold theirs): each output's ``rel-l2`` check over the
            samples (:func:`~mixprec.checks.outputs.closeness_checks`, from
            ``outputs``), then each output read as rows of answers
            (:func:`mixprec.validate` adds those: argmax rows, detections, embedding
            rows, the worst channel); every one must pass.
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
    checks: tuple[OutputCheck, ...] = ()
    arrays: tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]] | None = field(
        default=None, compare=False, repr=False
    )

    @property
    def passed(self) -> bool:
        """Whether every check passed: each output's rel L2 and every reading of its rows."""
        return bool(self.checks) and all(c.passed for c in self.checks)

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
            "checks": [{**c.to_dict(), "text": c.measured()} for c in self.checks],
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
        for c in self.checks:  # how each output was read as rows (its rel L2: the table)
            if c.kind != "rel-l2":
                lines.append(f"{'ok' if c.passed else 'NO':>3} {c.output}: {c.measured()}")
                lines.append(f"      read as {c.reason}")
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
    kinds: Mapping[str, OutputKind] | None = None,
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
        kinds: The original's output kinds (:func:`~mixprec.core.output_kinds.classify_outputs`;
            None: read from it here), given by a caller that validates many samples.

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
    if kinds is None:  # top-1 on class scores only
        kinds = classify_outputs(ir.from_proto(original))
    comparisons = compare_outputs(reference, result, rtol=tol, atol=atol, kinds=kinds)
    shapes = {k: [int(d) for d in np.shape(v)] for k, v in feeds_for(original, feeds).items()}
    said = described.get("notes")  # what the engine ran otherwise than asked
    if isinstance(said, list):
        notes = (*notes, *said)
    return ValidationReport(
        kind, low_dtype, tol, atol, tuple(comparisons), fallback, shapes, tuple(notes), described,
        tuple(closeness_checks([comparisons], tol, atol)), arrays=(reference, result),
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


def validate_protos(
    ref_model: onnx.ModelProto,
    new_model: onnx.ModelProto,
    samples: list[Mapping[str, np.ndarray]] | None,
    *,
    shapes: Mapping[str, Sequence[int]] | None,
    tolerances: tuple[float | None, float],
    mode: str,
    seed: int,
    runtime: RuntimeOptions | None,
    threads: int,
) -> ValidationReport:
    """:func:`mixprec.validate` on loaded models: ``samples`` (feed dicts, as
    :func:`check_arguments` returns them; None: generated), ``tolerances`` (rtol, atol),
    the converted model run in ``runtime`` (None: the default choice of
    :func:`~mixprec.checks.validate.validate_models`; the FP32 original in ONNX
    Runtime), ``threads`` intra-op threads."""
    rtol, atol = tolerances
    kinds = classify_outputs(ir.from_proto(ref_model))  # read once, for every sample
    if samples is not None:
        reports = [
            validate_models(
                ref_model,
                new_model,
                dict(feeds),
                rtol=rtol,
                atol=atol,
                mode=mode,
                threads=threads,
                runtime=runtime,
                kinds=kinds,
            )
            for feeds in samples
        ]
        checks = _checks(reports, kinds, rtol, atol, runtime)
        worst = max(range(len(reports)), key=lambda k: _badness(reports[k]))
        note = f"validated on the given inputs ({len(samples)} sample(s); sample {worst} shown)"
        notes = (note, *reports[worst].notes)
        return dataclasses.replace(reports[worst], notes=notes, checks=checks)

    def attempt(tried: dict[str, list[int]]) -> ValidationReport:
        feeds, notes = make_inputs(ref_model, shapes=tried, seed=seed)
        return validate_models(
            ref_model,
            new_model,
            feeds,
            rtol=rtol,
            atol=atol,
            mode=mode,
            threads=threads,
            notes=notes,
            runtime=runtime,
            kinds=kinds,
        )

    # The same first guess as calibration, learning from ONNX Runtime's refusals.
    first, guess_notes = resolve_input_shapes(ref_model, shapes)
    report, _, fit_notes = fit_shapes(first, guessed_dims(ref_model, shapes), attempt)
    checks = _checks([report], kinds, rtol, atol, runtime)
    notes = (*guess_notes, *report.notes, *fit_notes)
    return dataclasses.replace(report, notes=notes, checks=checks)


def _checks(
    reports: Sequence[ValidationReport],
    kinds: Mapping[str, OutputKind],
    rtol: float | None,
    atol: float,
    runtime: RuntimeOptions | None,
) -> tuple[OutputCheck, ...]:
    """Each output's rel L2 over every sample, then each output read as rows over every
    sample (:func:`~mixprec.checks.outputs.row_readings`: argmax rows, decisions,
    detections, embedding rows, the worst channel), held to the bounds of the dtype the
    model was lowered to."""
    closeness = closeness_checks([r.outputs for r in reports], reports[0].rtol, atol)
    pairs = [r.arrays for r in reports if r.arrays is not None]
    if not pairs:
        return tuple(closeness)
    target = lowered_to(reports[0].low_dtype, runtime)
    budget = row_budget(target, reports[0].rtol if rtol is None else rtol, atol)
    reference = [{k: v for k, v in ref.items() if k in got} for ref, got in pairs]
    outputs = [got for _, got in pairs]
    read = {k: v for k, v in kinds.items() if k in reference[0]}
    return (*closeness, *row_readings(reference, outputs, read, budget))


def check_arguments(
    mode: str, rtol: float | None, atol: float, seed: int, inputs: object
) -> list[Mapping[str, np.ndarray]] | None:
    """One error line for a bad mode, tolerance, seed or inputs; the inputs as a list of
    feed dicts (None: generate)."""
    if mode not in ("auto", "ort", "emulated"):
        raise MixprecError(f"unknown validation mode {mode!r}: use auto, ort or emulated")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is None and name == "rtol":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MixprecError(f"{name} must be a number, not {type(value).__name__}")
        if not math.isfinite(value) or value <= 0:
            raise MixprecError(f"{name} must be a finite number > 0, got {value!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MixprecError(f"seed must be an int, not {type(seed).__name__}")
    return _samples(inputs)


def _samples(inputs: object) -> list[Mapping[str, np.ndarray]] | None:
    """``inputs`` as a list of feed dicts (None: generate)."""
    if inputs is None:
        return None
    if isinstance(inputs, Mapping):
        return [inputs]
    if isinstance(inputs, Sequence) and inputs and all(isinstance(i, Mapping) for i in inputs):
        return list(inputs)
    raise MixprecError(
        "inputs must be a dict of arrays by input name or a non-empty list of them, "
        f"not {type(inputs).__name__}"
    )


def _badness(report: ValidationReport) -> tuple[bool, float]:
    """Sort key of the worst sample: a failure first, then the largest rel L2 error."""
    worst = max((o.rel_l2_error for o in report.outputs), default=0.0)
    return (not report.passed, worst if math.isfinite(worst) else math.inf)
