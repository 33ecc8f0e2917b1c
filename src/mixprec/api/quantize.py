"""``mixprec.quantize`` and ``mixprec.plan_int8``: load -> the INT8 stages -> log dir.

A short composition like :mod:`mixprec.api.convert`: the input is loaded into a private
copy, :func:`~mixprec.pipeline.quantize.run_quantize` calibrates, plans, times the
placements and applies, and the log dir gets the graphs and the report. ``max_drop=``
hands the call to :func:`mixprec.tune` (target int8).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from mixprec.api import envelope
from mixprec.api.weight_only import quantize_weights
from mixprec.core.errors import MixprecError
from mixprec.int8.config import QuantizeConfig, guard_spellings
from mixprec.io.external import input_files
from mixprec.io.models import ModelLike, load_input
from mixprec.pipeline.convert import CalibrationData, ConversionResult
from mixprec.pipeline.quantize import plan_model, resolve_qconfig
from mixprec.pipeline.report import Report
from mixprec.repair.int8_guard import EvalData, guarded_quantize
from mixprec.repair.int8_runs import quantize_once

__all__ = ["plan_int8", "quantize"]

logger = logging.getLogger(__name__)


def quantize(
    model: ModelLike,
    calibration_data: CalibrationData | None = None,
    *,
    config: QuantizeConfig | None = None,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    eval_data: EvalData | None = None,
    weights: Any = None,
    **options: Any,
) -> Any:
    """Post-training INT8 quantization: static (calibrated Q/DQ pairs) or dynamic (MatMul
    weights INT8, activations quantized at run time), chosen by ``mode``; or, with
    ``weights="int4"`` / ``"int8"``, weight-only quantization: MatMul weights in blocks,
    activations float (:func:`mixprec.api.weight_only.quantize_weights` lists its options).

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        calibration_data: a feed dict, a list of them, or any iterable/generator
            (streamed). None generates one synthetic sample and warns: scales from
            synthetic data say nothing about real accuracy.
        config: a ready :class:`QuantizeConfig`; ``options`` then replace its fields.
        progress: called with a short message at each stage.
        base_dir: the folder an in-memory model's external data is read from (as for
            :func:`~mixprec.convert`); a path's own folder otherwise.
        eval_data: samples the accuracy guard checks the INT8 model on (same forms as
            ``calibration_data``, or a path as ``--eval-data``; arrays that are not model
            inputs are labels for ``metric``); by default a seeded random half of the
            calibration samples (at most 64, or enough for 300 rows where samples hold
            few rows each) is held out, streamed from its source
            (:mod:`mixprec.checks.guard_samples`).
        weights: "int4" or "int8" (or a :class:`~mixprec.weights.config.WeightsConfig`):
            weight-only quantization instead of INT8; ``options`` are then its fields and
            the INT8 ones are refused.
        **options: the fields of :class:`QuantizeConfig` (``method``, ``mode``,
            ``activations``, ``per_channel``, ``fallback``, ``bias_correction``,
            ``rounding`` ("nearest" or "learned": AdaRound), ``equalize``, ``smooth``,
            ``speed``, ``exclude_nodes``, ``shapes``, ``latency_shapes``,
            ``placement``, ``guard``, ``guard_drop``, ``guard_rel_l2``, ``guard_cosine``,
            ``output_kinds``, ``accept_unconfirmed``, ``metric``, ``metric_budget``,
            ``fold_batchnorm``, ``check``, ``log_dir``).
            The accuracy guard is on by default: ``report.guard["passed"]`` says whether
            the result holds top-1 >= 0.99 on class scores, mean cosine >= 0.99 on
            embeddings, rel L2 <= 0.1 elsewhere (``guard_drop`` / ``guard_cosine`` /
            ``guard_rel_l2``; each output's kind and why: :mod:`mixprec.core.output_kinds`)
            on held-out samples, after moving the sensitive nodes back to float if needed;
            a pass whose held-out rows cannot confirm it (95% lower bound under the budget)
            is none: the input is written unchanged unless ``accept_unconfirmed=True``;
            ``guard=False`` warns. ``max_drop`` / ``max_rel_l2`` / ``min_cosine`` are the
            same budgets under the CLI's names (``--max-drop``, ``--max-rel-l2``,
            ``--min-cosine``). The tuner itself is
            :func:`mixprec.tune` with target "int8".

    Returns:
        A :class:`~mixprec.ConversionResult` (``.model``, ``.report``, ``.save()``).

    Example:
        >>> result = mixprec.quantize("model.onnx", batches, method="entropy")  # doctest: +SKIP
        >>> result.save("model_int8.onnx")                                      # doctest: +SKIP
    """
    options = guard_spellings(options)
    if weights is not None:
        if config is not None:
            raise MixprecError("give weights= or config= (INT8 options), not both")
        return quantize_weights(
            model, calibration_data, weights, progress=progress, base_dir=base_dir,
            eval_data=eval_data, **options,
        )  # fmt: skip
    config = resolve_qconfig(config, options)
    work, kind, load_s = envelope.load(model, base_dir, progress)
    files = input_files(work)  # one file: the model holds all its weights
    source = ir.to_proto(work)  # the input is read once: every later copy is made from it
    del work  # not held beside the copies made from ``source`` (one model's weights less)
    before = source if config.log_dir is not None else None
    if config.guard and (calibration_data is not None or eval_data is not None):
        work, report = guarded_quantize(source, config, calibration_data, eval_data, progress)
    else:
        why = _unguarded(config)
        work, report = quantize_once(source, config, calibration_data, progress)
        report.notes.append(why)
    envelope.finish(report, load_s, config.log_dir, before, work)
    whole = next(iter(files)) if kind == "path" and len(files) == 1 else None
    return ConversionResult(work, report, kind, source_file=whole if report.unchanged else None)


def _unguarded(config: QuantizeConfig) -> str:
    """Why no accuracy guard runs (logged as a warning, for the report's notes)."""
    if config.guard:
        why = "the accuracy guard is off: no samples to check the INT8 model on (give "
        why += "calibration_data or eval_data)"
    else:
        why = "accuracy guard off (guard=False / --no-guard): the INT8 model is not checked"
    logger.warning("%s", why)
    return why


def plan_int8(
    model: ModelLike,
    calibration_data: CalibrationData | None = None,
    *,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> tuple[ir.Model, Report]:
    """The INT8 plan without converting: the calibrated model annotated up to ``annotate``
    (every node the plan allows: no speed search) and its report rows, each node INT8 or
    float with the reason. ``options`` are :class:`QuantizeConfig` fields."""
    config = resolve_qconfig(None, {"speed": "off", **options})
    work, _ = load_input(model, base_dir)
    return plan_model(work, config, calibration_data=calibration_data, progress=progress)
