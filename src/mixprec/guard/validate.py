"""``mixprec.validate``'s comparison: a converted model against its FP32 original, on
the given samples (the worst one reported) or on inputs generated from the signature
(the calibration's first guess, learning from the runtime's refusals)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.guard.checks import check_outputs, output_kinds, row_budget
from mixprec.inputs.feeds import guessed_dims, make_inputs, resolve_input_shapes
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.fit import fit_shapes
from mixprec.runtime.validation import ValidationReport, lowered_to, validate_models

__all__ = ["check_arguments", "validate_protos"]


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
    :func:`~mixprec.runtime.validation.validate_models`; the FP32 original in ONNX
    Runtime), ``threads`` intra-op threads."""
    rtol, atol = tolerances
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
            )
            for feeds in samples
        ]
        checks = _row_checks(ref_model, reports, rtol, atol, runtime)
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
        )

    # The same first guess as calibration, learning from ONNX Runtime's refusals.
    first, guess_notes = resolve_input_shapes(ref_model, shapes)
    report, _, fit_notes = fit_shapes(first, guessed_dims(ref_model, shapes), attempt)
    checks = _row_checks(ref_model, [report], rtol, atol, runtime)
    notes = (*guess_notes, *report.notes, *fit_notes)
    return dataclasses.replace(report, notes=notes, checks=checks)


def _row_checks(
    ref_model: onnx.ModelProto,
    reports: Sequence[ValidationReport],
    rtol: float | None,
    atol: float,
    runtime: RuntimeOptions | None,
) -> tuple[dict[str, object], ...]:
    """Each output read as rows over every sample (:func:`~mixprec.guard.checks.check_outputs`:
    argmax rows, decisions, detections, embedding rows, the worst channel), held to the
    bounds of the dtype the model was lowered to; the whole-tensor rel L2 stays in the
    report's comparisons. An output of another shape is the comparisons' miss, not
    read again."""
    pairs = [r.arrays for r in reports if r.arrays is not None]
    if not pairs or not reports:
        return ()
    target = lowered_to(reports[0].low_dtype, runtime)
    budget = row_budget(target, reports[0].rtol if rtol is None else rtol, atol)
    reference = [{k: v for k, v in ref.items() if k in got} for ref, got in pairs]
    outputs = [got for _, got in pairs]
    if any(
        np.shape(r[k]) != np.shape(g[k]) for r, g in zip(reference, outputs, strict=True) for k in r
    ):
        return ()
    kinds = {k: v for k, v in output_kinds(ir.from_proto(ref_model)).items() if k in reference[0]}
    checks = check_outputs(reference, outputs, kinds, budget)
    return tuple({**c.to_dict(), "text": c.measured()} for c in checks if c.kind != "rel-l2")


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
