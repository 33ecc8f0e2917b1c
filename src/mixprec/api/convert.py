"""``mixprec.convert`` and ``mixprec.inspect``: load -> the FP16/BF16 stages -> log dir.

Each is a short composition: the input is loaded into a private copy
(:func:`~mixprec.io.models.load_input`), :func:`~mixprec.pipeline.convert.run_convert`
runs the stages through ``check`` (``convert``) or ``annotate`` (``inspect``), and the log
dir gets the graphs and the report. ``max_error=`` hands the call to :func:`mixprec.tune`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from mixprec.api import envelope
from mixprec.api.tune import tune
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.io.models import ModelLike
from mixprec.pipeline.convert import CalibrationData, ConversionResult, resolve_config, run_convert
from mixprec.pipeline.report import Report

__all__ = ["annotate", "convert", "inspect"]


def _run(
    model: ModelLike,
    target_dtype: str | None,
    config: ConvertConfig | None,
    calibration_data: CalibrationData | None,
    progress: Callable[[str], None] | None,
    options: dict[str, Any],
    until: str,
    base_dir: str | os.PathLike[str] | None,
) -> ConversionResult:
    config = resolve_config(target_dtype, config, options)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable, not {type(progress).__name__}")
    work, kind, load_s = envelope.load(model, base_dir, progress)
    before = ir.to_proto(work) if config.log_dir is not None else None
    work, report = run_convert(
        work, config, calibration_data=calibration_data, progress=progress, until=until
    )
    envelope.finish(report, load_s, config.log_dir, before, work)
    return ConversionResult(work, report, kind)


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


def annotate(
    model: ModelLike,
    target_dtype: str | None = None,
    *,
    config: ConvertConfig | None = None,
    calibration_data: CalibrationData | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> ConversionResult:
    """The painted model without its rewrite: the stages through ``annotate``, with the
    decisions on the nodes (what ``mixprec report`` draws); arguments as :func:`convert`."""
    options.pop("check", None)
    return _run(
        model, target_dtype, config, calibration_data, progress, options, "annotate", base_dir
    )


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
    return annotate(
        model,
        target_dtype,
        config=config,
        calibration_data=calibration_data,
        progress=progress,
        base_dir=base_dir,
        **options,
    ).report
