"""Accuracy-aware FP16 tuning: ``mixprec.tune`` against onnxconverter-common's
``auto_convert_mixed_precision`` on the same models, samples and budget.

    .venv-bench/bin/python -m bench.precision.tune [--models deep,ppocr_rec] [--write]

Both get the same metric: the worst output's relative L2 error against the FP32 model
(onnxconverter-common through its ``validate_fn``, on its single feed dict, the first
sample; mixprec on every sample). The returned models are then measured alike on every
sample, in ONNX Runtime as they are and emulated (every fp16 tensor rounded in an FP32
graph: ORT's CPU provider computes fp16 ops that lack kernels in FP32 and drops the
rounding between them, which hides errors). Evaluations: mixprec counts its own
(subset and full); the peer's are its ``validate_fn`` calls.

``--write`` writes bench/results/<date>-tune.md.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from bench.harness.common import RESULTS_DIR
from mixprec.core.metrics import worst_rel_l2
from mixprec.passes.emulate import emulate_low_precision
from mixprec.passes.macs import concrete_shapes, count_macs
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import run_model
from mixprec.tune.metrics import rel_l2

#: ONNX Runtime with its basic graph optimizations, as the tests' references run.
BASIC = RuntimeOptions("ort", optimization="basic")
OFF = RuntimeOptions("ort", optimization="off")

RESULTS = RESULTS_DIR
CORPUS = Path(os.environ.get("MIXPREC_CORPUS", "~/.cache/mixprec/corpus")).expanduser()
PEER_TIMEOUT_S = 90


def deep_model(blocks: int = 24, width: int = 256, offset: float = 2048.0) -> onnx.ModelProto:
    """A residual MLP, ``h += tanh(h W + b)``; every 8th block also adds and subtracts a
    large ``offset`` (a DC offset removed later), which fp16 cannot carry."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.array(offset, np.float32), "offset")]
    nodes = []
    h = "x"
    for i in range(blocks):
        w = (rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32)
        b = (0.1 * rng.standard_normal(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"], name=f"matmul{i}"),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"bias{i}"),
            helper.make_node("Tanh", [f"a{i}"], [f"t{i}"], name=f"tanh{i}"),
            helper.make_node("Add", [h, f"t{i}"], [f"h{i}"], name=f"residual{i}"),
        ]
        h = f"h{i}"
        if i % 8 == 7:
            nodes += [
                helper.make_node("Add", [h, "offset"], [f"u{i}"], name=f"add_offset{i}"),
                helper.make_node("Sub", [f"u{i}", "offset"], [f"d{i}"], name=f"sub_offset{i}"),
            ]
            h = f"d{i}"
    graph = helper.make_graph(
        [*nodes, helper.make_node("Identity", [h], ["y"], name="out")],
        "deep_residual_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, width])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _models() -> dict[str, tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]]:
    rng = np.random.default_rng(1)
    found = {
        "deep": (
            deep_model(),
            [{"x": rng.standard_normal((16, 256)).astype(np.float32)} for _ in range(8)],
        )
    }
    rec = CORPUS / "models" / "rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx"
    if rec.exists():
        found["ppocr_rec"] = (
            onnx.load(rec),
            [{"x": rng.random((1, 3, 48, 320)).astype(np.float32)} for _ in range(8)],
        )
    return found


def _low_mac_share(model: onnx.ModelProto, original: onnx.ModelProto, feeds) -> float:
    """Share of Conv/MatMul/Gemm MACs whose first input is fp16 (names as in original)."""
    shaped, shapes = concrete_shapes(original, {k: list(v.shape) for k, v in feeds.items()})
    macs = count_macs(shaped, shapes)
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    }
    types.update({t.name: t.data_type for t in inferred.graph.initializer})
    low = sum(
        macs.get(n.name, 0)
        for n in inferred.graph.node
        if n.name in macs and types.get(n.input[0]) == TensorProto.FLOAT16
    )
    total = sum(macs.values())
    return low / total if total else 0.0


def _measure(model, original, samples) -> tuple[float, float]:
    ref = [run_model(original, s, BASIC) for s in samples]
    as_is = [run_model(model, s, BASIC) for s in samples]
    emulated = emulate_low_precision(model)
    emu = [run_model(emulated, s, OFF) for s in samples]
    return rel_l2(ref, as_is), rel_l2(ref, emu)


def _plain_seconds(model, samples) -> float:
    start = time.perf_counter()
    mixprec.convert(model, "fp16", calibration_data=samples)
    return time.perf_counter() - start


def run_mixprec(model, samples, budget) -> dict[str, object]:
    start = time.perf_counter()
    result = mixprec.tune(model, "fp16", samples, budget=budget)
    seconds = time.perf_counter() - start
    as_is, emu = _measure(result.model_proto, model, samples)
    return {
        "evaluations": f"{result.evaluations['full']} full + {result.evaluations['subset']} subset",
        "seconds": seconds,
        "low_macs": _low_mac_share(result.model_proto, model, samples[0]),
        "kept_float": len(result.kept_float),
        "passed": result.passed,
        "rel_l2": as_is,
        "rel_l2_emulated": emu,
    }


class _Timeout(Exception):
    pass


def run_peer(model, samples, budget) -> dict[str, object]:
    from onnxconverter_common.auto_mixed_precision import auto_convert_mixed_precision

    calls = []

    def validate(res1, res2) -> bool:
        calls.append(1)
        worst = worst_rel_l2(res1, res2)
        return worst <= budget

    def alarm(_sig, _frame):
        raise _Timeout

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(PEER_TIMEOUT_S)
    start = time.perf_counter()
    try:
        out = auto_convert_mixed_precision(model, samples[0], validate, keep_io_types=True)
    except _Timeout:
        return {"evaluations": f"{len(calls)} (timed out)", "seconds": float(PEER_TIMEOUT_S)}
    except Exception as exc:  # the peer's own failure, reported as such
        line = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        return {
            "evaluations": f"{len(calls)} (failed: {line})",
            "seconds": time.perf_counter() - start,
        }
    finally:
        signal.alarm(0)
    seconds = time.perf_counter() - start
    as_is, emu = _measure(out, model, samples)
    return {
        "evaluations": f"{len(calls)} (one sample)",
        "seconds": seconds,
        "low_macs": _low_mac_share(out, model, samples[0]),
        "kept_float": "-",
        "passed": as_is <= budget,
        "rel_l2": as_is,
        "rel_l2_emulated": emu,
    }


BUDGETS = {"deep": 1e-2, "ppocr_rec": 1e-3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deep,ppocr_rec")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    wanted = args.models.split(",")
    rows = []
    for name, (model, samples) in _models().items():
        if name not in wanted:
            continue
        budget = BUDGETS[name]
        plain = _plain_seconds(model, samples)
        for tool, fn in (("mixprec tune", run_mixprec), ("onnxconverter-common", run_peer)):
            found = fn(model, samples, budget)
            rows.append((name, budget, plain, tool, found))
            print(name, tool, found, flush=True)
    lines = [
        f"# mixprec tune vs onnxconverter-common auto_convert_mixed_precision, "
        f"{datetime.date.today()}",
        "",
        "Produced by `.venv-bench/bin/python -m bench.precision.tune`. FP16, "
        "budget = worst-output relative L2 vs the FP32 model. 8 samples; the peer validates "
        "on the first only (its API takes one feed dict). rel L2 columns: the returned "
        "model on all 8 samples, in ORT CPU as is / emulated (every fp16 tensor rounded). "
        "plain s = one `mixprec.convert` of the same model and samples. low MACs: "
        "Conv/MatMul/Gemm MACs whose first input is fp16.",
        "",
        "| model | budget | tool | evaluations | s | x plain | low MACs | rel L2 (ORT) "
        "| rel L2 (emulated) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, budget, plain, tool, f in rows:

        def num(key: str, fmt: str, f: dict[str, object] = f) -> str:
            value = f.get(key)
            return format(value, fmt) if isinstance(value, float) else "-"

        lines.append(
            f"| {name} | {budget:g} | {tool} | {f['evaluations']} | {num('seconds', '.1f')} "
            f"| {f['seconds'] / plain:.1f} | {num('low_macs', '.1%')} | {num('rel_l2', '.2e')} "
            f"| {num('rel_l2_emulated', '.2e')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{datetime.date.today()}-tune.md").write_text(text)


if __name__ == "__main__":
    main()
