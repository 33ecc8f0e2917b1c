"""Measurements of one converted model against its FP32 original (ORT CPU)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from bench.harness.metrics import ModelStats, Shape, model_stats
from bench.harness.models import Feeds, ModelSpec
from mixprec.core.metrics import rel_l2_error
from mixprec.runtime.engine import TIMING_HINTS
from mixprec.runtime.ort_sessions import make_session

THREADS = 2
MIN_LATENCY_PAIRS = 20
MAX_LATENCY_PAIRS = 200
LATENCY_SECONDS = 3.0  # per row, beyond the minimum number of pairs
MIN_SAMPLE_SECONDS = 0.005  # tiny models: one timing sample repeats the run this long


def session(model: str | bytes, optimize: bool = True) -> ort.InferenceSession:
    """CPU session, 2 threads, opened as mixprec opens the sessions it times
    (:data:`mixprec.runtime.engine.TIMING_HINTS`: pool threads spin within a run, as ORT
    serves a model, and stop when it ends, leaving the cores to the next session timed
    beside it); ``optimize=False`` for emulation graphs, whose Cast round trips ORT's
    graph optimizers could fuse away or mis-fuse."""
    level = "all" if optimize else "off"
    return make_session(model, THREADS, optimization=level, hints=TIMING_HINTS)


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:limit]


def check(path: Path) -> str | None:
    """None when onnx.checker's full check passes, else its message."""
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # a failed check is a measurement
        return first_line(exc, 500)
    return None


def run(sess: ort.InferenceSession, feeds: Feeds) -> dict[str, np.ndarray]:
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    outs = sess.run(names, {k: v for k, v in feeds.items() if k in wanted})
    return dict(zip(names, outs, strict=True))


@dataclass
class Baseline:
    """The FP32 model's reference numbers for one ModelSpec."""

    spec: ModelSpec
    path: Path
    feeds: Feeds
    latency_feeds: Feeds
    shapes: dict[str, Shape]
    outputs: dict[str, np.ndarray]
    stats: ModelStats
    macs_by_name: dict[str, int]
    checker_error: str | None
    accuracy: float | None
    # spec.labelled: FP32's answers on the labelled set and their scores (ocr_text.py)
    labelled_predictions: list[Any] | None = None
    labelled: dict[str, Any] | None = None


def latency_feeds(spec: ModelSpec, feeds: Feeds) -> Feeds:
    if spec.latency_batch is None:
        return feeds
    return {k: v[: spec.latency_batch] if v.ndim else v for k, v in feeds.items()}


def compare(base: Baseline, outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    per_output: dict[str, dict[str, float | None]] = {}
    for name, ref in base.outputs.items():
        got = outputs.get(name)
        if got is None or got.shape != ref.shape:
            shape = None if got is None else list(got.shape)
            per_output[name] = {"rel_l2": float("inf"), "max_abs": float("inf"),
                                "problem": f"missing or shape {shape} != {list(ref.shape)}"}
            continue
        got32 = got.astype(np.float32) if np.issubdtype(got.dtype, np.floating) else got
        entry: dict[str, Any] = {"rel_l2": rel_l2_error(ref, got32)}
        diff = np.abs(got32.astype(np.float64) - ref.astype(np.float64))
        entry["max_abs"] = float(np.nanmax(diff)) if np.all(np.isfinite(diff)) else float("inf")
        if name in base.spec.class_outputs:
            entry["top1_agreement"] = float(np.mean(ref.argmax(-1) == got32.argmax(-1)))
        per_output[name] = entry
    result: dict[str, Any] = {"outputs": per_output}
    result["worst_rel_l2"] = max(v["rel_l2"] for v in per_output.values())
    result["max_abs_err"] = max(v["max_abs"] for v in per_output.values())
    tops = [v["top1_agreement"] for v in per_output.values() if "top1_agreement" in v]
    result["top1_agreement"] = min(tops) if tops else None
    if base.spec.labels is not None:
        logits = outputs.get(base.spec.class_outputs[0])
        if logits is not None:
            result["accuracy"] = float(np.mean(logits.argmax(-1) == base.spec.labels()))
    return result


def interleaved_latency(a: ort.InferenceSession, b: ort.InferenceSession,
                        feeds: Feeds) -> dict[str, float | int]:
    """Median latencies of A and B, timed alternately (A, B, A, B, ...) after warm-up."""
    wanted_a = {i.name for i in a.get_inputs()}
    wanted_b = {i.name for i in b.get_inputs()}
    fa = {k: v for k, v in feeds.items() if k in wanted_a}
    fb = {k: v for k, v in feeds.items() if k in wanted_b}
    for _ in range(3):
        a.run(None, fa)
        b.run(None, fb)
    t0 = time.perf_counter()
    a.run(None, fa)
    repeat = max(1, math.ceil(MIN_SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6)))

    def sample(sess: ort.InferenceSession, feeds_: Feeds) -> float:
        begin = time.perf_counter()
        for _ in range(repeat):
            sess.run(None, feeds_)
        return (time.perf_counter() - begin) / repeat

    times_a: list[float] = []
    times_b: list[float] = []
    started = time.perf_counter()
    while len(times_a) < MAX_LATENCY_PAIRS:
        times_a.append(sample(a, fa))
        times_b.append(sample(b, fb))
        if len(times_a) >= MIN_LATENCY_PAIRS and time.perf_counter() - started > LATENCY_SECONDS:
            break
    med_a, med_b = statistics.median(times_a), statistics.median(times_b)
    return {"fp32_ms": med_a * 1e3, "converted_ms": med_b * 1e3, "ratio": med_b / med_a,
            "pairs": len(times_a), "runs_per_sample": repeat}


def make_baseline(spec: ModelSpec, feeds: Feeds, macs: dict[str, int]) -> Baseline:
    path = spec.path()
    model = onnx.load(str(path))
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    outputs = run(session(str(path)), feeds)
    stats = model_stats(model, shapes, macs)
    accuracy = None
    if spec.labels is not None:
        accuracy = float(np.mean(outputs[spec.class_outputs[0]].argmax(-1) == spec.labels()))
    predictions, labelled = None, None
    if spec.labelled is not None:
        found = spec.labelled()
        predictions = found.predict(session(str(path)))
        labelled = found.score(predictions, predictions)
        accuracy = labelled["accuracy"]
    return Baseline(spec, path, feeds, latency_feeds(spec, feeds), shapes, outputs, stats, macs,
                    check(path), accuracy, predictions, labelled)


def labelled_scores(base: Baseline, sess: ort.InferenceSession) -> dict[str, Any] | None:
    """A converted model's scores on the spec's labelled set: against the ground truth
    (accuracy, ...) and against FP32's answers on the same lines (agreement)."""
    if base.spec.labelled is None or base.labelled_predictions is None:
        return None
    found = base.spec.labelled()
    return found.score(found.predict(sess), base.labelled_predictions)


def evaluate(base: Baseline, converted: Path, dtype: str,
             emulate: Callable[[onnx.ModelProto], onnx.ModelProto],
             measure_latency: bool = True) -> dict[str, Any]:
    """Everything measured on one converted model (the conversion itself is measured apart)."""
    row: dict[str, Any] = {}
    model = onnx.load(str(converted))
    size = converted.stat().st_size
    row["size_bytes"] = size
    row["size_ratio"] = size / base.path.stat().st_size
    row["checker_error"] = check(converted)
    row["stats"] = model_stats(model, base.shapes, base.macs_by_name).to_dict()

    native: ort.InferenceSession | None = None
    try:
        native = session(str(converted))
        native_outputs = run(native, base.feeds)
        row["ort_error"] = None
    except Exception as exc:  # failing to load or run is a result
        native = None
        row["ort_error"] = first_line(exc, 500)
    row["ort_runs"] = native is not None

    if dtype == "fp16" and native is not None:
        row["mode"] = "ort"
        row.update(compare(base, native_outputs))
    else:
        row["mode"] = "emulated"
        try:
            stand_in = emulate(model)
            emulated = session(stand_in.SerializeToString(), optimize=False)
            row.update(compare(base, run(emulated, base.feeds)))
        except Exception as exc:
            row["emulation_error"] = first_line(exc, 500)

    if measure_latency and native is not None:
        add_latency(row, base, native)
    return row


def add_latency(row: dict[str, Any], base: Baseline, converted: ort.InferenceSession) -> None:
    """``row["latency"]``: converted / FP32 median latency (interleaved), or the error."""
    try:
        row["latency"] = interleaved_latency(session(str(base.path)), converted,
                                             base.latency_feeds)
    except Exception as exc:
        row["latency_error"] = first_line(exc)


def decision_f1(ref: np.ndarray, got: np.ndarray, threshold: float) -> float:
    """F1 of ``got > threshold`` against ``ref > threshold`` (1.0 where neither says yes):
    the bench's probe of a detector's or tagger's decisions (mixprec's guard counts the
    same decisions' agreement per row, :func:`mixprec.core.metrics.decision_agreement`)."""
    want, have = ref > threshold, got > threshold
    both = float(np.sum(want & have))
    total = float(np.sum(want) + np.sum(have))
    return 1.0 if total == 0 else 2.0 * both / total
