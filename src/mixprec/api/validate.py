"""``mixprec.validate``: compare a converted model with its FP32 original in ONNX Runtime."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.feeds import guessed_dims, make_inputs, resolve_input_shapes
from mixprec.io.models import ModelLike, load_input, load_model
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import options_from_metadata, runtime_options
from mixprec.runtime.fit import fit_shapes
from mixprec.runtime.validation import ValidationReport, validate_models

__all__ = ["validate"]


def _proto(model: ModelLike, base_dir: str | os.PathLike[str] | None) -> onnx.ModelProto:
    """The model as a proto with every external tensor read from its own folder (checked)."""
    if isinstance(model, str | os.PathLike):
        try:
            return ir.to_proto(load_model(model))  # read from the file's own folder
        except ir.serde.SerdeError as e:  # e.g. a node name that is not UTF-8
            cause: BaseException = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
            reason = f"{type(cause).__name__}: {cause}".splitlines()[0]
            raise MixprecError(f"{model}: cannot be run as it is ({reason})") from e
    if not isinstance(model, str | os.PathLike | onnx.ModelProto | ir.Model):
        raise MixprecError(f"expected a path or a model, not {type(model).__name__}")
    return ir.to_proto(load_input(model, base_dir)[0])


def validate(
    original: ModelLike,
    converted: ModelLike,
    *,
    inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    rtol: float | None = None,
    atol: float = 1e-3,
    mode: str = "auto",
    seed: int = 0,
    base_dir: str | os.PathLike[str] | None = None,
    runtime: RuntimeOptions | str | None = None,
    threads: int = 2,
) -> ValidationReport:
    """Run both models on the same inputs and compare every output.

    Args:
        original: the FP32 model.
        converted: the mixed-precision model.
        inputs: feeds by input name, or a list of them (every sample is compared; the
            report is the worst sample's, failing if any fails); generated from the
            signature when omitted.
        shapes: concrete shapes for symbolic input dims (else the rule of
            :func:`mixprec.io.feeds.resolve_input_shapes`: 1 for a symbolic first dim, 64
            for others, as ``convert`` does).
        rtol: max relative L2 error per output (default: 1e-2 fp16, 8e-2 bf16).
        atol: max abs error accepted instead where the reference is near zero.
        mode: "ort" runs the converted model as is, "emulated" runs an FP32 model that
            rounds every low-precision tensor through the low dtype (for runtimes without
            bf16 kernels), "auto" tries "ort" and falls back to "emulated".
        seed: seed of the generated inputs.
        base_dir: the folder in-memory models' external data is read from (as for
            :func:`~mixprec.convert`); a model given by path is read from its own folder.
        runtime: the engine that runs the converted model: "ort", "openvino" or a
            :class:`~mixprec.RuntimeOptions` (threads, inference precision, performance
            hint). Default: the runtime the converted model's ``metadata_props`` name
            (``mixprec.runtime`` and ``mixprec.runtime_hints``, as ``mixprec optimize``
            writes them); without them ONNX Runtime, except a bf16 model, which OpenVINO
            runs with real bf16 kernels where this CPU has them (else it is emulated).
            The FP32 original always runs in ONNX Runtime.
        threads: intra-op threads, where ``runtime`` is a name or None.

    Returns:
        A ``ValidationReport`` (``.passed``, ``.outputs``, ``.kind``, ``.format_table()``).

    Example:
        >>> report = mixprec.validate("m.onnx", "m_fp16.onnx")      # doctest: +SKIP
        >>> report.passed                                            # doctest: +SKIP
        True
    """
    _check_arguments(mode, rtol, atol, seed)
    samples = _samples(inputs)
    ref_model = _proto(original, base_dir)
    new_model = _proto(converted, base_dir)
    if runtime is None:  # the runtime the converted model says it runs in, if any
        options = options_from_metadata(new_model, threads)
    else:
        options = runtime_options(runtime, threads)
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
                runtime=options,
            )
            for feeds in samples
        ]
        worst = max(range(len(reports)), key=lambda k: _badness(reports[k]))
        note = f"validated on the given inputs ({len(samples)} sample(s); sample {worst} shown)"
        return dataclasses.replace(reports[worst], notes=(note, *reports[worst].notes))

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
            runtime=options,
        )

    # The same first guess as calibration, learning from ONNX Runtime's refusals.
    first, guess_notes = resolve_input_shapes(ref_model, shapes)
    report, _, fit_notes = fit_shapes(first, guessed_dims(ref_model, shapes), attempt)
    return dataclasses.replace(report, notes=(*guess_notes, *report.notes, *fit_notes))


def _check_arguments(mode: str, rtol: float | None, atol: float, seed: int) -> None:
    """One error line for a bad mode, tolerance or seed."""
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
