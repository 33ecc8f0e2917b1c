"""``mixprec.quantize(model, weights="int4")``: load -> the weight-only stages and checks
(:func:`~mixprec.pipeline.weights.run_weights`) -> log dir."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.guard.language import is_language_model, lm_guard
from mixprec.guard.samples import WINDOWS_HELD_OUT_SHARE, split_for_guard
from mixprec.io.models import ModelLike, load_input
from mixprec.io.protos import weightless_proto
from mixprec.io.text import DEFAULT_WINDOW, TextSamples, find_tokenizer, is_text_path
from mixprec.pipeline.convert import CalibrationData, ConversionResult
from mixprec.pipeline.report import Report
from mixprec.pipeline.streamed import Source, streams
from mixprec.pipeline.weights import WeightsGuard, run_weights
from mixprec.report.logdir import write_log_dir
from mixprec.weights.config import WeightsConfig, parse_weights

__all__ = ["INT8_ONLY", "quantize_weights", "weights_config"]

#: :func:`mixprec.quantize` options of INT8 only; with ``weights=`` they have nothing to
#: act on and are refused.
INT8_ONLY = (
    "method",
    "activations",
    "per_channel",
    "mode",
    "placement",
    "speed",
    "latency_shapes",
    "fallback",
    "bias_correction",
    "rounding",
    "equalize",
    "smooth",
    "fold_batchnorm",
    "guard_cosine",
    "min_cosine",
    "metric",
    "metric_budget",
)


def weights_config(weights: str | int | WeightsConfig, options: dict[str, Any]) -> WeightsConfig:
    """The config of a ``weights=`` call: ``weights`` (a bit width or a config) with
    ``options`` (:class:`WeightsConfig` fields; ``weight_method`` is ``method``)."""
    options = dict(options)
    given = sorted(k for k in INT8_ONLY if k in options)
    if given:
        hint = "; the weight method is weight_method=" if "method" in given else ""
        verb = "does" if len(given) == 1 else "do"
        raise MixprecError(
            f"with weights=, {', '.join(f'{k}=' for k in given)} {verb} not apply (INT8 "
            f"only: weight-only quantization leaves activations float){hint}"
        )
    if "weight_method" in options:
        options["method"] = options.pop("weight_method")
    try:
        if isinstance(weights, WeightsConfig):
            return dataclasses.replace(weights, **options)
        return WeightsConfig(bits=parse_weights(weights), **options)
    except TypeError as exc:
        raise MixprecError(f"quantize(weights=...): {exc}") from None


def quantize_weights(
    model: ModelLike,
    calibration_data: CalibrationData | None = None,
    weights: str | int | WeightsConfig = "int4",
    *,
    progress: Callable[[str], None] | None = None,
    base_dir: str | os.PathLike[str] | None = None,
    eval_data: CalibrationData | str | os.PathLike[str] | None = None,
    weights_guard: WeightsGuard | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    text_window: int = DEFAULT_WINDOW,
    **options: Any,
) -> ConversionResult:
    """Weight-only quantization (what :func:`mixprec.quantize` does with ``weights=``).

    Args:
        model: a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model``; never mutated.
        calibration_data: samples (a feed dict, a list, any iterable) the output check
            runs on (RTN reads none of them); a data-aware method reads them too. Or a
            ``.txt`` file (a folder of them): text, tokenized and cut into windows of
            ``text_window`` tokens (:class:`~mixprec.io.text.TextSamples`).
        weights: "int4" or "int8", or a ready :class:`~mixprec.weights.config.WeightsConfig`.
        progress: called with a short message at each stage.
        base_dir: the folder an in-memory model's external data is read from.
        eval_data: samples (same forms, or an .npz path / folder) the output check runs
            on instead of the calibration samples.
        weights_guard: the check of the result (default: a language model, one that
            takes ``input_ids`` and outputs ``logits``, gets the next-token guard with its
            repair, :func:`~mixprec.guard.language.lm_guard`, on windows held out of the
            calibration data or on ``eval_data``; other models: each output against FP32,
            :func:`~mixprec.pipeline.weights.output_check`).
        tokenizer: the ``tokenizer.json`` of text data (default: the one beside the model).
        text_window: tokens per window of text data.
        **options: :class:`~mixprec.weights.config.WeightsConfig` fields (``block_size``,
            ``symmetric``, ``weight_method``, ``accuracy_level``, ``lm_head``,
            ``embeddings``, ``exclude_nodes``, ``layers``, ``shapes``, ``guard_drop``,
            ``guard_rel_l2``, ``check``, ``log_dir``, ``runtime``, ``stream``);
            ``guard=False`` in them turns the output check off. A model whose external
            data is over 2 GB is streamed (``stream=True`` forces it): its weights are
            read from the data files one at a time, never all in memory.

    Returns:
        A :class:`~mixprec.ConversionResult`; ``report.guard["passed"]`` is False when
        an output went non-finite or missed a budget given.

    Example:
        >>> result = mixprec.quantize("llm.onnx", samples, weights="int4")  # doctest: +SKIP
        >>> result.save("llm.int4.onnx")                                    # doctest: +SKIP
    """
    config = weights_config(weights, options)
    t0 = time.perf_counter()
    if progress is not None:
        progress("loading")
    work, kind = load_input(model, base_dir)
    texts = _TextData(model, tokenizer, text_window, work)
    calibration_data, eval_data = texts.read(calibration_data), texts.read(eval_data)
    guard = weights_guard
    if guard is None and config.guard and is_language_model(work):
        calibration_data, eval_data, guard = _language_model_guard(
            work, calibration_data, eval_data
        )
    # a streamed model stays memory-mapped (pipeline.streamed's module doc); others are
    # copied into one proto, as the stages and checks of a small model read it
    source: Source = work if streams(work, config) else ir.to_proto(work)
    del work
    load_s = time.perf_counter() - t0
    model_out, report = run_weights(
        source,
        config,
        calibration_data=calibration_data,
        eval_data=eval_data,
        progress=progress,
        guard=guard,
    )
    texts.note(report)
    report.timings = {"load": load_s, **report.timings}
    if config.log_dir is not None:
        before = (
            source
            if isinstance(source, onnx.ModelProto)
            else weightless_proto(source, with_arrays=False)[0]
        )
        write_log_dir(config.log_dir, before, model_out, report)
    return ConversionResult(model_out, report, kind)


class _TextData:
    """Text paths given as data, read as :class:`~mixprec.io.text.TextSamples`."""

    def __init__(
        self,
        model: ModelLike,
        tokenizer: str | os.PathLike[str] | None,
        window: int,
        work: ir.Model,
    ) -> None:
        self.model_path = model if isinstance(model, str | os.PathLike) else None
        self.tokenizer = tokenizer
        self.window = window
        self.work = work
        self.read_texts: list[TextSamples] = []

    def read(self, data: Any) -> Any:
        if not is_text_path(data):
            return data
        found = find_tokenizer(self.model_path, self.tokenizer)
        text = TextSamples(data, self.work, found, window=self.window)
        self.read_texts.append(text)
        return text

    def note(self, report: Report) -> None:
        report.notes.extend(f"text data: {t.describe()}" for t in self.read_texts)


def _language_model_guard(
    work: ir.Model, calibration_data: Any, eval_data: Any
) -> tuple[Any, Any, WeightsGuard]:
    """A language model's data and guard: ``eval_data`` when given, else a seeded random
    fifth of the calibration windows held out of the calibration (fewer than five: all
    of them do both)."""
    if eval_data is not None or calibration_data is None:
        where = "eval windows" if eval_data is not None else None
        return calibration_data, eval_data, functools.partial(lm_guard, where=where)
    split = split_for_guard(calibration_data, None, work, WINDOWS_HELD_OUT_SHARE)
    where = "calibration windows (too few to hold any out)" if split.in_sample else None
    where = where or "held-out calibration windows"
    return split.calibration, split.held, functools.partial(lm_guard, where=where)
