"""Accuracy-aware INT8: ``mixprec.tune(model, "int8", ...)`` against NNCF's
``nncf.quantize_with_accuracy_control`` (ONNX backend) on the same models, data and budget.

    MIXPREC_BENCH_CACHE=/work/main/bench/cache PYTHONPATH=src \\
        .venv-bench/bin/python -m bench.int8.tune [--models mnist_cnn,ppocr_rec] [--write]

* mnist_cnn: labelled accuracy on the 1000 held-out digits (10 items of 100), budget: at
  most 0.3 points below the FP32 model's accuracy. Calibration: the bench's INT8
  calibration samples (``models.int8_calibration``: 64 training-split digits, 16 x 4).
* ppocr_rec: top-1 agreement of ``softmax_11.tmp_0`` (argmax over the last axis, every
  time step) with the FP32 model, on real English lines rendered for the bench's labelled
  eval set (``ocr_text.rec_set``, in PaddleOCR's [-1, 1] range, one line per item),
  budget: agreement >= 0.99 (NNCF: max_drop 0.01 from the FP32 model's 1.0). Calibration:
  the bench's 16 calib-split lines.

Both tools get the same calibration samples and the same validation items. mixprec gets
the metric as a callable (mnist) or its built-in ``top1`` (ppocr_rec), NNCF a
``validation_fn`` returning (metric, per-item values) so it need not call it per item.
Evaluations: mixprec's own count (full + subset, plus the one FP32 reference score); NNCF's
are the calls of ``validation_fn`` (FP32 and quantized models included). INT8 MACs: the
share of the FP32 model's Conv/MatMul/Gemm MACs that ORT's CPU provider runs in integer
kernels after its graph optimizations (``int8.integer_kernel_share``, the same count for
both tools), and in the graph: Conv/MatMul/Gemm whose first two inputs come from
DequantizeLinear, input 0 also through MaxPool/Flatten/Reshape/... (MACs by node name in
the FP32 model; mixprec's own ``low_mac_share`` beside it). Latency: median INT8 / median FP32,
ORT CPU, 2 threads, interleaved, >= 20 pairs (``evaluate.interleaved_latency``).

Runs in a temporary folder (NNCF and ORT may write files in the working directory).
``--write`` writes bench/results/<date>-tune-int8.md.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx

import mixprec
from bench.harness.common import RESULTS_DIR
from bench.harness.evaluate import interleaved_latency, run, session
from bench.harness.models import (
    Feeds,
    int8_calibration,
    mnist_inputs,
    mnist_labels,
    model_by_name,
)
from bench.harness.ocr_text import rec_set
from bench.int8.suite import integer_kernel_share
from mixprec.passes.macs import concrete_shapes, count_macs

RESULTS = RESULTS_DIR
COMPUTE = ("Conv", "MatMul", "Gemm")
MNIST_BATCH = 100
MNIST_DROP = 0.003  # accuracy, as a fraction: 0.3 points
OCR_LINES = 16
OCR_DROP = 0.01  # top-1 agreement with FP32: >= 0.99
OCR_OUTPUT = "softmax_11.tmp_0"
NNCF_TIMEOUT_S = 300  # keeps the whole run under ~8 minutes on 2 cores


class Task:
    """One model: its data, the metric on a list of (feeds, truth) items, the budget."""

    def __init__(self, name: str, items: list[tuple[Feeds, np.ndarray]], calib: list[Feeds],
                 output: str, drop: float, metric_text: str, latency_feeds: Feeds):
        self.name = name
        self.spec = model_by_name(name)
        self.path = self.spec.path()
        self.model = onnx.load(str(self.path))
        self.items = items
        self.calib = calib
        self.output = output
        self.drop = drop
        self.metric_text = metric_text
        self.latency_feeds = latency_feeds

    def per_item(self, run_one, items) -> list[float]:
        """Share of argmax matches with each item's truth (labels or FP32 argmax)."""
        return [float(np.mean(run_one(feeds)[self.output].argmax(-1) == truth))
                for feeds, truth in items]


def _score(per_item: list[float], items) -> float:
    """Pooled over items (weighted by how many predictions each holds)."""
    sizes = [np.size(truth) for _feeds, truth in items]
    return float(np.dot(per_item, sizes) / max(sum(sizes), 1))


def mnist_task(limit: int | None) -> Task:
    images, labels = mnist_inputs("eval")["image"], mnist_labels()
    if limit:
        images, labels = images[:limit], labels[:limit]
    items = [({"image": images[i:i + MNIST_BATCH]}, labels[i:i + MNIST_BATCH])
             for i in range(0, len(images), MNIST_BATCH)]
    spec = model_by_name("mnist_cnn")
    return Task("mnist_cnn", items, int8_calibration(spec), "logits", MNIST_DROP,
                f"accuracy on {len(images)} held-out digits, drop <= 0.3 pt",
                {"image": mnist_inputs("eval")["image"][:spec.latency_batch]})


def ocr_task(limit: int | None) -> Task:
    lines = min(limit or OCR_LINES, OCR_LINES)
    images = rec_set("eval").images[:lines]
    spec = model_by_name("ppocr_rec")
    fp32 = session(str(spec.path()))
    items = []
    for i in range(lines):
        feeds = {"x": images[i:i + 1]}
        items.append((feeds, run(fp32, feeds)[OCR_OUTPUT].argmax(-1)))
    calib = int8_calibration(spec)[:lines]
    return Task("ppocr_rec", items, calib, OCR_OUTPUT, OCR_DROP,
                f"top-1 agreement with FP32 on {lines} text lines x time steps, >= 0.99",
                items[0][0])


def _macs(task: Task) -> dict[str, int]:
    """MACs by node name at the latency feeds' shapes (the ORT kernel count's shapes)."""
    feeds = task.latency_feeds
    shaped, shapes = concrete_shapes(task.model, {k: list(v.shape) for k, v in feeds.items()})
    return count_macs(shaped, shapes)


#: Ops that only move or select values: an activation's DequantizeLinear is traced back
#: through them (NNCF puts one QDQ pair before MaxPool/Flatten, ORT propagates it).
PASS_THROUGH = ("MaxPool", "Flatten", "Reshape", "Transpose", "Squeeze", "Unsqueeze",
                "Identity")


def graph_int8_share(model: onnx.ModelProto, macs: dict[str, int]) -> float:
    """Conv/MatMul/Gemm MACs (FP32 model's, by node name) whose input 0 and input 1 are
    DequantizeLinear outputs (input 0 also through the PASS_THROUGH ops)."""
    producer = {o: n for n in model.graph.node for o in n.output}

    def from_dq(name: str, through: bool) -> bool:
        node = producer.get(name)
        while through and node is not None and node.op_type in PASS_THROUGH:
            node = producer.get(node.input[0])
        return node is not None and node.op_type == "DequantizeLinear"

    low = sum(macs.get(n.name, 0) for n in model.graph.node
              if n.op_type in COMPUTE and len(n.input) > 1
              and from_dq(n.input[0], True) and from_dq(n.input[1], False))
    total = sum(macs.values())
    return low / total if total else 0.0


def measure(task: Task, model: onnx.ModelProto, macs: dict[str, int]) -> dict[str, object]:
    """Metric on every item, INT8 shares and latency ratio of a returned model."""
    sess = session(model.SerializeToString())
    values = task.per_item(lambda feeds: run(sess, feeds), task.items)
    metric = _score(values, task.items)
    with tempfile.TemporaryDirectory(prefix="tune-int8-") as folder:
        path = Path(folder) / "model.onnx"
        onnx.save(model, str(path))
        kernel = integer_kernel_share(path, task.latency_feeds, sum(macs.values()))
    latency = interleaved_latency(session(str(task.path)), sess, task.latency_feeds)
    return {"metric": metric, "graph_share": graph_int8_share(model, macs),
            "kernel_share": kernel["integer_mac_share"], "latency": latency["ratio"],
            "pairs": latency["pairs"]}


def fp32_score(task: Task) -> float:
    sess = session(str(task.path))
    return _score(task.per_item(lambda feeds: run(sess, feeds), task.items), task.items)


def run_mixprec(task: Task, macs: dict[str, int], reference: float) -> dict[str, object]:
    if task.name == "ppocr_rec":
        metric, budget = "top1", 1.0 - task.drop
    else:
        def accuracy(candidate) -> float:
            return _score(task.per_item(candidate.run, task.items), task.items)

        metric, budget = accuracy, task.drop
    data = [feeds for feeds, _truth in task.items]
    start = time.perf_counter()
    result = mixprec.tune(task.model, "int8", data, metric=metric, budget=budget,
                          calibration_data=task.calib)
    seconds = time.perf_counter() - start
    ev = result.evaluations
    found = measure(task, result.model_proto, macs)
    found.update(
        evaluations=f"{ev['full']} full + {ev['subset']} subset + {ev['reference']} FP32",
        seconds=seconds, own_share=result.low_mac_share, passed=result.passed,
        note=f"{len(result.kept_float)} of {result.candidates} kept float")
    return found


class _Timeout(Exception):
    pass


def run_nncf(task: Task, macs: dict[str, int], reference: float) -> dict[str, object]:
    import nncf

    calls: list[int] = []
    lock = threading.Lock()

    def validate(model: onnx.ModelProto, data) -> tuple[float, list[float]]:
        items = list(data)
        with lock:
            calls.append(len(items))
        sess = session(model.SerializeToString())
        values = task.per_item(lambda feeds: run(sess, feeds), items)
        return _score(values, items), values

    drops: list[str] = []

    class Drops(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if text.startswith("Accuracy drop"):
                drops.append(text.split(" is ")[-1].split(": ")[-1].split(" (")[0])

    def alarm(_sig, _frame):
        raise _Timeout

    handler = Drops()
    logging.getLogger("nncf").addHandler(handler)
    calibration = nncf.Dataset(task.calib)
    validation = nncf.Dataset(task.items)
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(NNCF_TIMEOUT_S)
    start = time.perf_counter()
    try:
        out = nncf.quantize_with_accuracy_control(
            task.model, calibration, validation, validate, max_drop=task.drop,
            drop_type=nncf.DropType.ABSOLUTE, subset_size=max(len(task.calib), len(task.items)))
    except _Timeout:
        last = f"; last drop it logged {float(drops[-1]):.4f}" if drops else ""
        return {"evaluations": f"{len(calls)} ({sum(calls)} items), timed out",
                "seconds": float(NNCF_TIMEOUT_S),
                "note": f"stopped at {NNCF_TIMEOUT_S} s{last}"}
    finally:
        signal.alarm(0)
        logging.getLogger("nncf").removeHandler(handler)
    seconds = time.perf_counter() - start
    found = measure(task, out, macs)
    found.update(evaluations=f"{len(calls)} ({sum(calls)} items)", seconds=seconds,
                 own_share=None, passed=found["metric"] >= reference - task.drop - 1e-12,
                 note="")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mnist_cnn,ppocr_rec")
    parser.add_argument("--tools", default="mixprec,nncf")
    parser.add_argument("--limit", type=int, default=None,
                        help="dry run: this many digits / lines only")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    makers = {"mnist_cnn": mnist_task, "ppocr_rec": ocr_task}
    tools = {"mixprec": ("mixprec tune", run_mixprec),
             "nncf": ("NNCF quantize_with_accuracy_control", run_nncf)}
    os.chdir(tempfile.mkdtemp(prefix="tune-int8-cwd-"))
    rows = []
    for name in args.models.split(","):
        task = makers[name](args.limit)
        macs = _macs(task)
        reference = fp32_score(task)
        print(name, "FP32", reference, flush=True)
        for key in args.tools.split(","):
            tool, fn = tools[key]
            try:
                found = fn(task, macs, reference)
            except Exception as exc:  # a tool's failure is a result
                line = str(exc).strip().splitlines()
                found = {"evaluations": f"failed: {type(exc).__name__}: "
                                        f"{line[-1][:160] if line else ''}"}
            rows.append((task, reference, tool, found))
            print(name, tool, found, flush=True)
    lines = [
        f"# mixprec tune vs NNCF quantize_with_accuracy_control, INT8, {datetime.date.today()}",
        "",
        "Produced by `MIXPREC_BENCH_CACHE=/work/main/bench/cache PYTHONPATH=src "
        "/work/main/.venv-bench/bin/python -m bench.int8.tune --write` (NNCF "
        f"{_version('nncf')}, ONNX backend, defaults otherwise; onnxruntime "
        f"{_version('onnxruntime')}). Same calibration samples and validation items for both "
        "tools; see the docstring of bench/int8/tune.py. evaluations: mixprec's own count; "
        "NNCF's = calls of its `validation_fn` (items passed in all). INT8 MACs (ORT) = share "
        "of the FP32 Conv/MatMul/Gemm MACs ORT's CPU provider runs in integer kernels after "
        "graph optimization; (graph) = Conv/MatMul/Gemm fed by DequantizeLinear on inputs 0 "
        "(also through MaxPool/Flatten/Reshape/Transpose/Squeeze/Unsqueeze) and 1; "
        "mixprec's own `low_mac_share` in brackets. latency = median INT8 / median FP32, "
        "ORT CPU, 2 threads, interleaved.",
        "",
        "| model | metric, budget | FP32 | tool | evaluations | s | achieved | met "
        "| INT8 MACs (ORT) | INT8 MACs (graph) | latency | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for task, reference, tool, f in rows:

        def num(key: str, fmt: str, f: dict[str, object] = f) -> str:
            value = f.get(key)
            return format(value, fmt) if isinstance(value, float) else "-"

        graph = num("graph_share", ".1%")
        if f.get("own_share") is not None:
            graph += f" ({f['own_share']:.1%})"
        met = "-" if "passed" not in f else ("yes" if f["passed"] else "no")
        lines.append(
            f"| {task.name} | {task.metric_text} | {reference:.4f} | {tool} "
            f"| {f['evaluations']} | {num('seconds', '.1f')} | {num('metric', '.4f')} | {met} "
            f"| {num('kernel_share', '.1%')} | {graph} | {num('latency', '.2f')} "
            f"| {f.get('note', '')} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{datetime.date.today()}-tune-int8.md").write_text(text)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
