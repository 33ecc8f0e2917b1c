"""``mixprec.tune``: load -> :func:`~mixprec.tune.run.tune_model` -> log dir."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from mixprec.io.models import ModelLike
from mixprec.report.tune_plot import write_tune_log
from mixprec.runtime.engine import RuntimeOptions
from mixprec.tune.options import tune_from_options
from mixprec.tune.result import TuneResult

__all__ = ["tune"]


def tune(
    model: ModelLike,
    target: str | None = "fp16",
    data: Any = None,
    *,
    metric: str | Callable[..., float] = "rel-l2",
    budget: float | str | None = None,
    calibration_data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
    max_evaluations: int | None = None,
    progress: Callable[[str], None] | None = None,
    threads: int = 2,
    mode: str = "emulated",
    metric_budget: float | None = None,
    runtime: RuntimeOptions | str | None = None,
    **options: Any,
) -> TuneResult:
    """Find the model that keeps the most MACs in low precision (or INT8) within a budget.

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        target: "fp16", "bf16" or "int8".
        data: the samples the metric is measured on: a feed dict, a list or iterable of
            them, or a path (an ``.npz`` with a leading sample axis, or a folder of
            ``.npz``). They are also the calibration data unless ``calibration_data``.
        metric: "rel-l2" (default), "max-abs", "top1", "cosine" (against the FP32
            model's outputs), or a callable taking a
            :class:`~mixprec.checks.user_metric.Candidate` and returning a score, higher is
            better; with ``metric_budget``, your own score as the INT8
            guard takes it: ``FUNCTION(fp32_outputs, outputs[, labels])`` (one dict per
            sample; ``labels``: each sample's arrays that are not model inputs), a
            callable or ``"MODULE:FUNCTION"`` / ``"FILE.py:FUNCTION"``.
        budget: the bound on a built-in metric (default per target: rel-l2 1e-2 fp16,
            8e-2 bf16, 1e-1 int8; top1 0.99; cosine 0.9999/0.999/0.99); for a callable,
            the accepted drop from the FP32 score: a number, or "N%" (relative).
        calibration_data: samples for calibration, when they differ from ``data``.
        max_evaluations: the most model evaluations (subset and full together).
        metric_budget: the lowest accepted value of your own score (``--metric-budget``):
            the same loader and scoring as ``quantize(metric=, metric_budget=)``.
        progress: called with a short message at each phase.
        threads: ONNX Runtime intra-op threads.
        mode: how fp16/bf16 candidates run: "emulated" (default: float32 with every
            low tensor rounded, as a runtime that computes in the low dtype sees it) or
            "ort" (fp16 as is on ONNX Runtime's CPU provider, which computes ops lacking
            fp16 kernels in float32 and so hides some errors). INT8 always runs as is:
            for target "int8", ``mode`` may name the quantize mode instead ("auto",
            "static" or "dynamic", as :func:`mixprec.quantize`).
        runtime: where candidates, their sensitivity run and the FP32 reference run:
            a :class:`~mixprec.runtime.engine.RuntimeOptions` or a runtime name (default:
            ONNX Runtime's CPU provider, or the engine ``mode`` names); for int8 also
            the quantizer's ``runtime`` unless ``options`` name one.
        **options: :func:`mixprec.convert`'s options for fp16/bf16, or
            :func:`mixprec.quantize`'s for int8 (``speed`` defaults to "off").

    Returns:
        A :class:`TuneResult` (a :class:`~mixprec.ConversionResult` with ``.save()``).

    Example:
        >>> r = mixprec.tune("m.onnx", "fp16", "samples.npz", budget=1e-3)  # doctest: +SKIP
        >>> r.passed, r.low_mac_share, [s.name for s in r.kept_float]     # doctest: +SKIP
    """
    result = tune_from_options(
        model,
        target,
        data,
        metric=metric,
        budget=budget,
        calibration_data=calibration_data,
        max_evaluations=max_evaluations,
        progress=progress,
        threads=threads,
        mode=mode,
        options=options,
        metric_budget=metric_budget,
        runtime=runtime,
    )
    if options.get("log_dir") is not None:
        write_tune_log(options["log_dir"], result)
    return result
