"""``mixprec.validate``: compare a converted model with its FP32 original in ONNX Runtime."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from mixprec.checks.validate import ValidationReport, check_arguments, validate_protos
from mixprec.core.ops import DEFAULT_ATOL
from mixprec.io.models import ModelLike, runnable_proto
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import options_from_metadata, runtime_options
from mixprec.runtime.ov_marks import resolved_runtime_model

__all__ = ["validate"]


def validate(
    original: ModelLike,
    converted: ModelLike,
    *,
    inputs: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    rtol: float | None = None,
    atol: float = DEFAULT_ATOL,
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
            :func:`mixprec.inputs.feeds.resolve_input_shapes`: 1 for a symbolic first dim, 64
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
            writes them; an OpenVINO IR that ``mixprec.runtime_model`` names beside a
            converted model given by path is what OpenVINO runs); without them ONNX
            Runtime, except a bf16 model, which OpenVINO runs with real bf16 kernels
            where this CPU has them (else it is emulated). The FP32 original always runs
            in ONNX Runtime.
        threads: intra-op threads, where ``runtime`` is a name or None.

    Returns:
        A ``ValidationReport`` (``.passed``, ``.outputs``, ``.kind``, ``.format_table()``).

    Example:
        >>> report = mixprec.validate("m.onnx", "m_fp16.onnx")      # doctest: +SKIP
        >>> report.passed                                            # doctest: +SKIP
        True
    """
    samples = check_arguments(mode, rtol, atol, seed, inputs)
    ref_model = runnable_proto(original, base_dir)
    new_model = runnable_proto(converted, base_dir)
    if isinstance(converted, str | os.PathLike):  # an OpenVINO IR it names, beside it
        new_model = resolved_runtime_model(new_model, Path(os.fspath(converted)).resolve().parent)
    if runtime is None:  # the runtime the converted model says it runs in, if any
        options = options_from_metadata(new_model, threads)
    else:
        options = runtime_options(runtime, threads)
    return validate_protos(
        ref_model, new_model, samples, shapes=shapes, tolerances=(rtol, atol), mode=mode,
        seed=seed, runtime=options, threads=threads,
    )  # fmt: skip
