"""``mixprec.quantize(model, weights="int4")``: load -> the weight-only stages and checks
(:func:`~mixprec.pipeline.weight_only.run_weights`) -> log dir."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.api import envelope
from mixprec.inputs.text import DEFAULT_WINDOW, TextData
from mixprec.io.models import ModelLike, mapped_copy
from mixprec.io.protos import weightless_proto
from mixprec.pipeline.convert import CalibrationData, ConversionResult
from mixprec.pipeline.streamed import Source, keeps_mapped, maps_a_copy
from mixprec.pipeline.weight_only import WeightsGuard, run_weights
from mixprec.repair.language_guard import cache_note, is_language_model, language_model_guard
from mixprec.repair.weights_guard import output_check, output_check_data
from mixprec.weights.config import WeightsConfig, weights_config

__all__ = ["quantize_weights"]


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
            ``text_window`` tokens (:class:`~mixprec.inputs.text.TextSamples`).
        weights: "int4" or "int8", or a ready :class:`~mixprec.weights.config.WeightsConfig`.
        progress: called with a short message at each stage.
        base_dir: the folder an in-memory model's external data is read from.
        eval_data: samples (same forms, or an .npz path / folder) the output check runs
            on instead of the calibration samples.
        weights_guard: the check of the result (default: a language model, one that
            takes ``input_ids`` and outputs ``logits``, gets the next-token guard with its
            repair, :func:`~mixprec.repair.language_guard.lm_guard`, on windows held out of the
            calibration data or on ``eval_data``; other models: each output against FP32,
            :func:`~mixprec.repair.weights_guard.output_check`).
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
    work, kind, load_s = envelope.load(model, base_dir, progress)
    with contextlib.ExitStack() as stack:
        mapped = None
        if maps_a_copy(work, config):  # pipeline.streamed's module doc
            folder = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="mixprec-mapped-", ignore_cleanup_errors=True)
            )
            clock = time.perf_counter()
            work = mapped_copy(work, folder)
            mapped = (
                "held in memory (no external data): run from a memory-mapped copy with "
                f"external data, written in {time.perf_counter() - clock:.1f}s"
            )
        texts = TextData(model, tokenizer, text_window, work)
        calibration_data, eval_data = texts.read(calibration_data), texts.read(eval_data)
        guard: WeightsGuard = weights_guard or output_check
        if weights_guard is None and config.guard and is_language_model(work):
            calibration_data, eval_data, guard = language_model_guard(
                work, calibration_data, eval_data
            )
        elif weights_guard is None and config.guard:
            calibration_data, eval_data, guard = output_check_data(
                work, calibration_data, eval_data
            )
        # a model with external data stays memory-mapped (pipeline.streamed's module doc);
        # others are copied into one proto, as the stages and checks of a small model read it
        source: Source = work if keeps_mapped(work, config) else ir.to_proto(work)
        no_cache = cache_note(work)
        del work
        model_out, report = run_weights(
            source,
            config,
            calibration_data=calibration_data,
            eval_data=eval_data,
            progress=progress,
            guard=guard,
        )
    # the copy's files are gone; its maps (and the float weights they hold) stay
    report.notes.extend([*texts.notes(), *([mapped] if mapped else [])])
    if no_cache:
        report.notes.append(no_cache)
    before = None
    if config.log_dir is not None:
        before = (
            source
            if isinstance(source, onnx.ModelProto)
            else weightless_proto(source, with_arrays=False)[0]
        )
    envelope.finish(report, load_s, config.log_dir, before, model_out)
    return ConversionResult(model_out, report, kind)
