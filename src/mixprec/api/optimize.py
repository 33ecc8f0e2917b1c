"""``mixprec.optimize``: load -> try every candidate (precision x runtime) -> the winner."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx_ir as ir

from mixprec.core.readings import user_kinds
from mixprec.io.external import input_files
from mixprec.io.models import ModelLike, load_input
from mixprec.io.runtime_fields import runtime_fields_of
from mixprec.optimize.candidates import Candidate
from mixprec.optimize.checked import user_metric
from mixprec.optimize.result import OptimizeResult
from mixprec.optimize.run import optimize_model

__all__ = ["optimize"]


def optimize(
    model: ModelLike,
    calibration_data: Any = None,
    *,
    eval_data: Any = None,
    runtime: str = "auto",
    device: str = "cpu",
    threads: int = 2,
    candidates: Sequence[str | Candidate] | None = None,
    metric: Callable[..., float] | str | None = None,
    metric_budget: float | None = None,
    time_budget: float | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    output_kinds: Mapping[str, Any] | Sequence[str] | None = None,
    accept_unconfirmed: bool = False,
) -> OptimizeResult:
    """The fastest model that keeps its answers, on this machine, in the runtime it will
    run in: each candidate (the input in ONNX Runtime and OpenVINO, bf16 in OpenVINO where
    this CPU computes it, :func:`mixprec.quantize` guarded in each runtime: the guide's
    table) is checked on held-out samples against the input in ONNX Runtime and, when
    accurate, timed beside it; the fastest accurate one wins (ties go to the simpler one).

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        calibration_data: samples (forms as :func:`mixprec.quantize` takes): the INT8
            candidates calibrate on them, a seeded random half (at most 64, or enough
            for 300 rows where samples hold few rows each) is held out to check every
            candidate, and the first sample's shape is timed. None: 8
            generated inputs, no INT8 (the last line says it needs data), and every other
            candidate held to convert's relative L2 for its precision.
        eval_data: samples to check the candidates on instead of the held-out half.
        runtime: ``"auto"`` (every runtime installed), ``"ort"`` or ``"openvino"`` (that
            runtime's candidates only; one error line when it is not installed).
        device: ``"cpu"`` (default: the candidates above), or ``"cuda"``/``"tensorrt"``:
            then the candidates are ``fp32-cuda`` (the input), ``fp16-cuda`` and
            ``bf16-cuda`` (:func:`mixprec.convert`'s fp16/bf16), each in ONNX Runtime on
            that provider (onnxruntime-gpu; one error line when it is not installed),
            checked against the input in ONNX Runtime's CPU provider and timed beside the
            input on the device, the feeds bound there; the winner, the input included,
            carries ``mixprec.runtime_hints={"provider": "cuda"}``.
        threads: intra-op threads, for every candidate and the input alike.
        candidates: names (``["fp32-ort", "int8-ort"]``) or
            :class:`~mixprec.optimize.candidates.Candidate` entries; default every one.
            Without ``fp32-ort`` the input is the reference only, and the fastest
            accurate candidate given wins.
        metric: the user's score ``metric(fp32_outputs, outputs[, labels])`` (a callable
            or ``"MODULE:FUNCTION"``) instead of the per-output checks, with ...
        metric_budget: ... its lowest accepted score.
        time_budget: seconds for the timing of all candidates (building and checking
            them is not counted); one error line when too small to time any.
        shapes: the serving shape by input name (``{"x": [8, 3, 224, 224]}``): every
            candidate, and the INT8 speed plan's placements, are timed on inputs of it
            (default: the first calibration sample's shape). Checked against the model's
            inputs (names, rank, fixed dims) before any work.
        progress: called with a short message at each step.
        base_dir: the folder an in-memory model's external data is read from.
        output_kinds: how the checks read outputs, by name, in place of mixprec's own
            reading (``{"output0": "detection"}``, or ``["output0=detection"]``;
            :mod:`mixprec.core.readings`).
        accept_unconfirmed: count a candidate accurate when its checks pass on too few
            held-out rows to confirm them (by default it loses, and the last line says
            how many rows would); FP32 in any runtime needs no confirming.

    Returns:
        An :class:`~mixprec.optimize.result.OptimizeResult`: ``.model_proto`` (carrying
        ``mixprec.runtime`` and ``mixprec.runtime_hints``, except the input unchanged),
        ``.runtime``, ``.table``, ``.summary``, ``.save(path)``.

    Example:
        >>> result = mixprec.optimize("model.onnx", "samples/")  # doctest: +SKIP
        >>> print(result.format_table()); result.save("model_fast.onnx")  # doctest: +SKIP
    """
    metric_of = user_metric(metric, metric_budget)
    kinds = user_kinds(output_kinds)
    work, kind = load_input(model, base_dir)
    files = input_files(work)  # one file: the model holds all its weights
    source = ir.to_proto(work)
    del work
    result = optimize_model(
        source,
        calibration_data,
        eval_data,
        candidates=candidates,
        runtime=runtime,
        device=device,
        threads=threads,
        metric=metric_of,
        time_budget=time_budget,
        progress=progress,
        shapes=shapes,
        output_kinds=kinds,
        accept_unconfirmed=accept_unconfirmed,
    )
    # byte for byte only where the file is the answer as it is (no earlier runtime fields)
    as_is = kind == "path" and len(files) == 1 and not runtime_fields_of(source)
    whole = next(iter(files)) if as_is else None
    return dataclasses.replace(result, source_file=whole if result.unchanged else None)
