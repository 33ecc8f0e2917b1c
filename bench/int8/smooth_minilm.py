"""SmoothQuant on MiniLM: INT8 sentence embeddings with and without it, beside ORT's.

Calibrates on the bench's 16 INT8 calibration sentences (models.int8_calibration, one
sentence per sample) and measures on held-out sentences none of them holds: the bench's
8 EVAL_SENTENCES and the HELD_OUT ones below (paraphrase pairs among them, so that
nearest neighbours mean something), one sentence per run at its own length.

Per variant: mean and lowest cosine of the mean-pooled sentence embedding to FP32's,
nearest-neighbour agreement (the nearest other held-out sentence by cosine is the same
as FP32's), and the INT8/FP32 median latency ratio (interleaved runs, 2 threads, ORT CPU)
on the bench's eval batch (8 sentences padded to 18 tokens) and at batch 1.

Usage (dev venv): nice -n 10 .venv/bin/python -m bench.int8.smooth_minilm [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bench.harness.evaluate import session
from bench.harness.models import int8_calibration, minilm_inputs, model_by_name

HELD_OUT = [
    "The meeting has been moved to Friday afternoon.",
    "We rescheduled the meeting for Friday after lunch.",
    "My laptop will not turn on after the update.",
    "After installing the update my computer refuses to start.",
    "The recipe needs two cups of sugar and three eggs.",
    "You will need three eggs and two cups of sugar for this recipe.",
    "Stock markets fell sharply after the interest rate announcement.",
    "Shares dropped quickly once the central bank raised rates.",
    "The hikers reached the summit just before sunset.",
    "Just before the sun went down, the climbers got to the top.",
    "Please send me the invoice by email.",
    "Could you email the bill to me?",
    "The cat is sleeping on the warm windowsill.",
    "A kitten dozes in the sunshine by the window.",
    "Our team won the championship last season.",
    "Last year we took the league title.",
    "The doctor advised him to drink more water.",
    "He was told by his physician to stay hydrated.",
    "Traffic on the motorway was backed up for miles.",
    "There was a long traffic jam on the highway.",
    "She is learning to play the violin.",
    "The new phone has a much better camera.",
    "Heavy snow closed the mountain pass overnight.",
    "The bakery sells fresh bread every morning.",
]


def _tokenizer() -> Any:
    from tokenizers import Tokenizer

    from bench.harness.common import minilm_dir

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def held_out_feeds() -> list[dict[str, np.ndarray]]:
    from bench.harness.sentences import EVAL_SENTENCES

    encoded = _tokenizer().encode_batch(EVAL_SENTENCES + HELD_OUT)
    return [
        {
            "input_ids": np.array([e.ids], np.int64),
            "attention_mask": np.array([e.attention_mask], np.int64),
            "token_type_ids": np.array([e.type_ids], np.int64),
        }
        for e in encoded
    ]


def embeddings(model: str | bytes, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    sess = session(model)
    return np.concatenate([sess.run(["sentence_embedding"], f)[0] for f in feeds])


def scores(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    def unit(e: np.ndarray) -> np.ndarray:
        return e / np.linalg.norm(e, axis=1, keepdims=True)

    a, b = unit(ref.astype(np.float64)), unit(got.astype(np.float64))
    cos = np.sum(a * b, axis=1)
    sim_a, sim_b = a @ a.T, b @ b.T
    np.fill_diagonal(sim_a, -2)
    np.fill_diagonal(sim_b, -2)
    nn = float(np.mean(np.argmax(sim_a, 1) == np.argmax(sim_b, 1)))
    return {"cos_mean": float(cos.mean()), "cos_min": float(cos.min()), "nn_agree": nn}


def _mixprec(source: str, calib: list[dict[str, Any]], **options: Any) -> tuple[bytes, dict]:
    import mixprec

    result = mixprec.quantize(source, calib, **options)
    report = result.report
    quant = report.quantization or {}
    info = {
        "mode": quant.get("mode"),
        "smooth": (quant.get("smooth") or {}).get("summary"),
        "guard": (report.guard or {}).get("summary"),
        "timings": {k: round(v, 2) for k, v in report.timings.items()},
        "unchanged": report.unchanged,
    }
    return result.model_proto.SerializeToString(), info


def _ort_u8s8(source: str, calib: list[dict[str, Any]]) -> tuple[bytes, dict]:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calib)

        def get_next(self) -> dict[str, Any] | None:
            return next(self.it, None)

    with tempfile.TemporaryDirectory(prefix="smooth-ort-") as folder, contextlib.chdir(folder):
        pre, out = f"{folder}/pre.onnx", f"{folder}/out.onnx"
        quant_pre_process(source, pre, skip_symbolic_shape=True)
        quantize_static(
            pre,
            out,
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
        return Path(out).read_bytes(), {"options": "QDQ U8S8 per-channel MinMax, pre-processed"}


STATIC_ALL = {"mode": "static", "speed": "off", "guard": False}
WEIGHTED = {**STATIC_ALL, "placement": "weighted"}
DYNAMIC_ALL = {"mode": "dynamic", "speed": "off", "guard": False}
VARIANTS: dict[str, dict[str, Any]] = {
    "mixprec default, smooth off": {"smooth": None},
    "mixprec default": {},
    "static all": {**STATIC_ALL, "smooth": None},
    "static all + smooth auto": {**STATIC_ALL, "smooth": "auto"},
    "static weighted": {**WEIGHTED, "smooth": None},
    "static weighted + smooth auto": {**WEIGHTED, "smooth": "auto"},
    "static weighted + smooth 0.5": {**WEIGHTED, "smooth": 0.5},
    "static weighted + smooth 0.8": {**WEIGHTED, "smooth": 0.8},
    "dynamic all": {**DYNAMIC_ALL, "smooth": None},
    "dynamic all + smooth auto": {**DYNAMIC_ALL, "smooth": "auto"},
    "ort quantize_static u8s8": {},
}
ROUNDS = 40


def joint_latency(models: dict[str, bytes], source: str, feeds: dict[str, Any]) -> dict[str, float]:
    """INT8/FP32 median latency ratio of each model, all timed in the same rounds
    (rotating order, each sample >= 5 ms of repeated runs), so that load from other
    processes hits every model alike."""
    sessions = {"fp32": session(source), **{k: session(v) for k, v in models.items()}}
    for sess in sessions.values():
        for _ in range(3):
            sess.run(None, feeds)
    begin = time.perf_counter()
    sessions["fp32"].run(None, feeds)
    repeat = max(1, int(0.005 / max(time.perf_counter() - begin, 1e-6)) + 1)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    labels = list(sessions)
    for r in range(ROUNDS):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            begin = time.perf_counter()
            for _ in range(repeat):
                sessions[label].run(None, feeds)
            times[label].append((time.perf_counter() - begin) / repeat)
    base = float(np.median(times["fp32"]))
    return {k: round(float(np.median(v)) / base, 3) for k, v in times.items() if k != "fp32"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    source = str(model_by_name("minilm").path())
    calib = int8_calibration(model_by_name("minilm"))
    held = held_out_feeds()
    batch8 = minilm_inputs("eval")
    ref = embeddings(source, held)
    rows = []
    blobs: dict[str, bytes] = {}
    for name, options in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        if name.startswith("ort"):
            blob, info = _ort_u8s8(source, calib)
        else:
            blob, info = _mixprec(source, calib, **options)
        row: dict[str, Any] = {"variant": name, "quantize_s": round(time.perf_counter() - start, 1)}
        row.update(scores(ref, embeddings(blob, held)))
        blobs[name] = blob
        row["ops"] = sorted(
            {n.op_type for n in onnx.load_from_string(blob).graph.node}
            & {"QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger"}
        )
        row.update(info)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.no_latency:
        for label, feeds in (("latency_b8", batch8), ("latency_b1", held[0])):
            ratios = joint_latency(blobs, source, feeds)
            for row in rows:
                row[label] = ratios[row["variant"]]
            print(label, json.dumps(ratios), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
