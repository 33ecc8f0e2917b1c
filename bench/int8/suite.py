"""The INT8 part of the bench: every quantizer on every model, measured the same way.

Each quantizer runs in its own subprocess (quantize_one.py, with a timeout) on the same
calibration samples (models.int8_calibration, written as one .npz file per sample); each
result is measured here on the same eval feeds as the FP16/BF16 rows (models.py).
"""

from __future__ import annotations

import filecmp
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from bench.harness.common import BENCH_DIR, module_command, result_row, run_measured
from bench.harness.evaluate import (
    Baseline,
    add_latency,
    check,
    compare,
    decision_f1,
    first_line,
    labelled_scores,
    run,
    session,
)
from bench.harness.metrics import ValueInfo, node_macs, runtime_shapes, subgraphs, value_infos
from bench.harness.models import Feeds, ModelSpec, int8_calibration
from bench.int8.quantize_one import TOOLS as TOOLS  # the one list of quantizers, for bench.main
from mixprec.core.metrics import row_cosines

#: ONNX Runtime CPU kernels that run a Conv/MatMul/Gemm in integers, and in float.
INTEGER_KERNELS = {
    # op type -> (op whose MAC formula applies, index of the activation, of the weight)
    "QLinearConv": ("Conv", 0, 3),
    "ConvInteger": ("Conv", 0, 1),
    "QLinearConvTranspose": ("ConvTranspose", 0, 3),
    "QLinearMatMul": ("MatMul", 0, 3),
    "MatMulInteger": ("MatMul", 0, 1),
    "MatMulIntegerToFloat": ("MatMul", 0, 1),
    "DynamicQuantizeMatMul": ("MatMul", 0, 1),
    "QGemm": ("Gemm", 0, 3),
}
FLOAT_KERNELS = {
    "Conv": ("Conv", 0, 1),
    "FusedConv": ("Conv", 0, 1),
    "ConvTranspose": ("ConvTranspose", 0, 1),
    "MatMul": ("MatMul", 0, 1),
    "FusedMatMul": ("MatMul", 0, 1),
    "Gemm": ("Gemm", 0, 1),
    "FusedGemm": ("Gemm", 0, 1),
}


def write_samples(samples: Sequence[Feeds], folder: Path) -> int:
    """Writes ``samples`` to ``folder`` (emptied of earlier .npz files), one .npz each."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.npz"):
        old.unlink()
    for i, feeds in enumerate(samples):
        np.savez(folder / f"sample_{i:02d}.npz", **feeds)
    return len(samples)


def write_calibration(spec: ModelSpec, folder: Path) -> int:
    """Writes the model's INT8 calibration samples to ``folder``, one .npz each."""
    return write_samples(int8_calibration(spec), folder)


def _kernel_macs(node: onnx.NodeProto, infos: Mapping[str, ValueInfo]) -> int | None:
    like, a, w = INTEGER_KERNELS.get(node.op_type) or FLOAT_KERNELS[node.op_type]
    if max(a, w) >= len(node.input):
        return None
    stand_in = onnx.helper.make_node(like, [node.input[a], node.input[w]], node.output[:1])
    stand_in.attribute.extend(at for at in node.attribute if at.name in ("transA", "transB"))
    if node.op_type == "FusedMatMul" and any(at.name == "transA" and at.i for at in node.attribute):
        shape_a = infos.get(node.input[a], ValueInfo()).shape
        out = infos.get(node.output[0], ValueInfo()).shape
        if shape_a is None or out is None or len(shape_a) < 2:
            return None
        return int(np.prod(out, dtype=np.int64)) * shape_a[-2]
    return node_macs(stand_in, infos)


def integer_kernel_share(path: Path, feeds: Mapping[str, np.ndarray],
                         fp32_macs: int) -> dict[str, Any]:
    """Share of the FP32 model's Conv/ConvTranspose/MatMul/Gemm MACs that ONNX Runtime's
    CPU provider runs in integer kernels, read from its optimized graph (ORT_ENABLE_EXTENDED,
    the level where QDQ groups fuse into QLinear*/QGemm/MatMulIntegerToFloat).

    Tool-independent: the optimized graph is run once with every value exposed, and each
    compute kernel's MACs are computed from its own input and output shapes (the same
    product as the original node's). The share is integer MACs / the FP32 model's total.
    """
    with tempfile.TemporaryDirectory(prefix="bench-int8-") as folder:
        optimized_path = str(Path(folder) / "optimized.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = optimized_path
        options.intra_op_num_threads = 2
        options.log_severity_level = 3
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(optimized_path)
    shapes = runtime_shapes(optimized, feeds)
    kernels: dict[str, int] = {}
    totals = {"integer": 0, "float": 0, "unresolved": 0}

    def visit(graph: onnx.GraphProto, outer: Mapping[str, ValueInfo]) -> None:
        infos = value_infos(graph, outer, shapes)
        for node in graph.node:
            if node.op_type in INTEGER_KERNELS or node.op_type in FLOAT_KERNELS:
                kernels[node.op_type] = kernels.get(node.op_type, 0) + 1
                macs = _kernel_macs(node, infos)
                if macs is None:
                    totals["unresolved"] += 1
                else:
                    totals["integer" if node.op_type in INTEGER_KERNELS else "float"] += macs
            for sub in subgraphs(node):
                visit(sub, infos)

    visit(optimized.graph, {})
    share = totals["integer"] / fp32_macs if fp32_macs else None
    return {"integer_mac_share": share, "integer_macs": totals["integer"],
            "float_macs": totals["float"], "unresolved_kernels": totals["unresolved"],
            "ort_kernels": kernels}


def min_sample_cosine(ref: np.ndarray, got: np.ndarray) -> float:
    """The lowest cosine of a sample (the leading axis, each sample flattened) to FP32's:
    mixprec's row cosines (-1 for a sample that is not finite)."""
    n = ref.shape[0]
    return float(np.min(row_cosines(ref.reshape(n, -1), got.reshape(n, -1))))


#: The task metric's budget for mixprec-metric: what report_int8 counts as accurate.
ACCURATE = 0.99


#: mixprec-metric's CTC metric: the greedy text of each line (arg-max per timestep, repeats
#: merged, blank 0 dropped; class ids stand for the characters), scored as 1 - the edit
#: distance to FP32's text over FP32's length, summed over the lines it gets.
CTC_METRIC = """import numpy as np


def _text(scores):
    ids = np.asarray(scores).argmax(-1).reshape(-1, np.shape(scores)[-2])
    return [[int(c) for k, c in enumerate(row) if c != 0 and (k == 0 or c != row[k - 1])]
            for row in ids]


def _distance(a, b):
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def characters(fp32_outputs, int8_outputs):
    wrong = total = 0
    for want, have in zip(fp32_outputs, int8_outputs):
        for a, b in zip(_text(want[OUTPUT]), _text(have[OUTPUT])):
            wrong, total = wrong + _distance(a, b), total + len(a)
    return 1.0 - wrong / max(total, 1)
"""


def has_task_metric(spec: ModelSpec) -> bool:
    """Whether mixprec-metric has a metric of the model's task to run with."""
    return bool(spec.decisions or spec.text_map or spec.ctc_output)


def write_metric(spec: ModelSpec, work: Path) -> str:
    """A metric module for ``mixprec quantize --metric`` that scores INT8 against FP32 as
    this bench does, written beside the work files; returns ``PATH:FUNCTION``.

    A text detector (``spec.text_map``): det_boxes.py itself, numpy only, its ``box_hmean``
    the hmean of rapidocr's text boxes from INT8's map against those from FP32's, over the
    samples the metric gets (a user accepts losing at most 1% of the boxes: ACCURATE).
    A CTC recogniser (``spec.ctc_output``): :data:`CTC_METRIC`'s ``characters`` (at most 1%
    of the characters read differently). Otherwise: the lowest decision F1 over
    ``spec.decisions``."""
    path = work / f"metric_{spec.name}.py"
    if spec.text_map is not None:
        source = (BENCH_DIR / "harness" / "det_boxes.py").read_text()
        path.write_text(f"{source}\n\nOUTPUT = {spec.text_map!r}\n")
        return f"{path}:box_hmean"
    if spec.ctc_output is not None:
        path.write_text(f"{CTC_METRIC}\n\nOUTPUT = {spec.ctc_output!r}\n")
        return f"{path}:characters"
    path.write_text(
        "import numpy as np\n\n\n"
        "def decisions(fp32_outputs, int8_outputs):\n"
        f"    found = []\n    for name, threshold in {list(spec.decisions)!r}:\n"
        "        want = np.concatenate([np.ravel(o[name]) for o in fp32_outputs]) > threshold\n"
        "        have = np.concatenate([np.ravel(o[name]) for o in int8_outputs]) > threshold\n"
        "        total = int(want.sum() + have.sum())\n"
        "        found.append(1.0 if total == 0 else 2.0 * int((want & have).sum()) / total)\n"
        "    return min(found)\n")
    return f"{path}:decisions"


def evaluate_int8(base: Baseline, path: Path, measure_latency: bool = True) -> dict[str, Any]:
    """Everything measured on one INT8 model (the quantization itself is measured apart)."""
    row: dict[str, Any] = {"size_bytes": path.stat().st_size,
                           "size_ratio": path.stat().st_size / base.path.stat().st_size,
                           "checker_error": check(path)}
    try:
        native = session(str(path))
        outputs = run(native, base.feeds)
        row["ort_error"] = None
    except Exception as exc:  # failing to load or run is a result
        row.update(ort_runs=False, ort_error=first_line(exc, 500))
        return row
    row["ort_runs"] = True
    row.update(compare(base, outputs))
    cosines = [min_sample_cosine(base.outputs[name], outputs[name])
               for name in base.spec.embedding_outputs
               if name in outputs and outputs[name].shape == base.outputs[name].shape]
    row["min_cosine"] = min(cosines) if cosines else None
    f1s = [decision_f1(base.outputs[name], outputs[name], t) for name, t in base.spec.decisions
           if name in outputs and outputs[name].shape == base.outputs[name].shape]
    row["decision_f1"] = min(f1s) if f1s else None
    row["agreement"] = next((row[k] for k in ("top1_agreement", "min_cosine", "decision_f1")
                             if row.get(k) is not None), None)
    if base.spec.labelled is not None:
        # PP-OCR rec/cls: accuracy on the labelled lines (its drop from FP32's is what
        # report_int8 judges), agreement = lines answered exactly as FP32 answers them;
        # det: box hmean against the lines' boxes, agreement = against FP32's boxes
        try:
            row["labelled"] = labelled_scores(base, native)
        except Exception as exc:
            row["labelled_error"] = first_line(exc, 500)
        if row.get("labelled"):
            row.update(accuracy=row["labelled"]["accuracy"],
                       agreement=row["labelled"]["agreement"])
    try:
        row.update(integer_kernel_share(path, base.feeds, base.stats.macs_total))
    except Exception as exc:
        row["kernel_share_error"] = first_line(exc, 500)
    if measure_latency:
        add_latency(row, base, native)
    return row


def quantize(spec: ModelSpec, tool: str, work: Path, calib_dir: Path,
             timeout: float, extra: Sequence[str] = ()) -> tuple[dict[str, Any], Path]:
    """Runs quantize_one.py for (model, tool) in a measured subprocess (``extra``: more of
    its arguments)."""
    tag = f"{spec.name}__{tool}__int8"
    out = work / f"{tag}.onnx"
    result_json = work / f"{tag}.json"
    result_json.unlink(missing_ok=True)
    cmd = [*module_command("int8.quantize_one"), tool, str(spec.path()), str(out),
           str(result_json), "--calib-dir", str(calib_dir), *extra]
    if tool == "mixprec-metric" and has_task_metric(spec):
        cmd += ["--metric", str(write_metric(spec, work)), "--metric-budget", str(ACCURATE)]
    proc = run_measured(cmd, timeout, work / f"{tag}.log")
    row = result_row(proc, result_json, work / f"{tag}.log", timeout, "quantize_one")
    quantization = (row.get("report") or {}).get("quantization")
    if isinstance(quantization, dict):
        quantization.pop("tensors", None)  # per-tensor scales stay in mixprec's own output
    return row, out


def run_model(spec: ModelSpec, base: Baseline, tools: list[str], work: Path, timeout: float,
              measure_latency: bool) -> list[dict[str, Any]]:
    """All INT8 rows of one model."""
    calib_dir = work / "inputs" / f"{spec.name}_int8_calib"
    count = write_calibration(spec, calib_dir)
    rows = []
    for tool in tools:
        if tool == "mixprec-metric" and not has_task_metric(spec):
            continue  # no task metric: the same run as "mixprec"
        row, out = quantize(spec, tool, work, calib_dir, timeout)
        row.update(model=spec.name, tool=tool, calibration_samples=count)
        if row["status"] == "ok" and out.is_file():
            # the input written back byte for byte: its speed is the input's
            row["unchanged"] = filecmp.cmp(out, spec.path(), shallow=False)
        if row["status"] == "ok":
            try:
                row.update(evaluate_int8(base, out, measure_latency))
            except Exception as exc:  # keep going with the other rows
                row["evaluation_error"] = first_line(exc, 500)
        row["valid"] = (row["status"] == "ok" and row.get("checker_error") is None
                        and bool(row.get("ort_runs")))
        rows.append(row)
        latency = (row.get("latency") or {}).get("ratio")
        summary = row.get("error") or (
            f"valid={row['valid']} int MACs={row.get('integer_mac_share')} "
            f"relL2={row.get('worst_rel_l2')} latency={latency}")
        print(f"bench: {spec.name:11s} {tool:21s} int8 {row['status']:11s} "
              f"{row['wall_s']:6.1f}s  {str(summary)[:110]}", flush=True)
    return rows
