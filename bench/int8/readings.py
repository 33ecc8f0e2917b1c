"""How the INT8 accuracy guard reads each output, and what that changes (issue 43).

For each bench model: ``mixprec.quantize`` with its defaults (the readings: argmax and
0.5 decisions on scores, detections, rows at the cosine bound and neighbours, worst
channel), and again with the readings of before (``output_kinds``: scores and other
outputs by one rel L2 over each sample, embeddings by their mean cosine), both on the
bench's INT8 calibration samples; then each written model against FP32 on the bench's
eval inputs, which neither run saw, by the model's own post-processing (evaluate_int8's
agreement: top-1, DB text boxes or CTC text on the labelled sets, VAD decisions,
MiniLM's nearest neighbours among the eval sentences).

Two peer models of kinds the bench's own lack, a YOLOv8 detector and a sigmoid note
transcriber, come with their users' post-processing as the probe (``peers.py``).

Usage (the bench venv, after bash bench/run.sh has built it and the derived models):
    .venv-bench/bin/python -m bench.int8.readings OUT.md [MODEL ...]   (from the repository root)
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx

import mixprec
from bench.harness.common import cpu_summary
from bench.harness.evaluate import make_baseline, run, session
from bench.harness.metrics import macs_by_name, runtime_shapes
from bench.harness.models import MODELS, int8_calibration, model_by_name
from bench.harness.peers import PEERS, path_of, peer_inputs, probe
from bench.int8.suite import evaluate_int8
from mixprec.core.metrics import neighbour_agreement
from mixprec.core.output_kinds import classify_outputs
from mixprec.io.models import load_model

#: Each kind as the guard read it before issue 43 (a sigmoid's scores and every other
#: float output by rel L2, embeddings by their mean cosine).
BEFORE = {"scores": "rel-l2", "other": "rel-l2", "embedding": "cosine"}


def _old_kinds(path: Path) -> dict[str, str]:
    kinds = classify_outputs(load_model(path))
    return {n: BEFORE[k.check] for n, k in kinds.items() if k.check in BEFORE}


def _neighbours(spec: Any, base: Any, path: Path) -> float | None:
    """MiniLM: nearest neighbours of the pooled eval sentences, INT8 against FP32."""
    if not spec.embedding_outputs:
        return None
    name = spec.embedding_outputs[0]
    got = run(session(str(path)), base.feeds)[name]
    ref = base.outputs[name]
    return neighbour_agreement(ref.reshape(len(ref), -1), got.reshape(len(got), -1))


def _one(spec: Any, base: Any, calib: list, kinds: dict[str, str] | None, work: Path) -> dict:
    start = time.perf_counter()
    result = mixprec.quantize(str(spec.path()), calib, output_kinds=kinds or {})
    seconds = time.perf_counter() - start
    out = work / f"{spec.name}_{'before' if kinds else 'after'}.onnx"
    result.save(out)
    guard = result.report.guard or {}
    row = evaluate_int8(base, out, measure_latency=False)
    reads = {}
    for check in guard.get("checks") or []:
        reads.setdefault(check["output"], []).append(
            f"{check['kind']} {check['value']:.4g} (needs {check['limit']:g})"
        )
    return {
        "int8_share": (result.report.quantization or {}).get("integer_kernel_mac_share"),
        "passed": guard.get("passed"),
        "confirmed": guard.get("confirmed"),
        "summary": guard.get("summary", ""),
        "checks": reads,
        "agreement": row.get("agreement"),
        "neighbours": _neighbours(spec, base, out),
        "seconds": seconds,
    }


def _peer(name: str, work: Path) -> str:
    """A peer model's row: both quantizations, probed on its eval samples."""
    path = path_of(name)
    calib, evals = peer_inputs(name, "calib"), peer_inputs(name, "eval")
    fp32 = session(str(path))
    ref = [run(fp32, f) for f in evals]
    cells, reading, summary = [], "", ""
    for label, kinds in (("before", _old_kinds(path)), ("after", {})):
        result = mixprec.quantize(str(path), calib, output_kinds=kinds)
        out = work / f"{name}_{label}.onnx"
        result.save(out)
        got = [run(session(str(out)), f) for f in evals]
        share = (result.report.quantization or {}).get("integer_kernel_mac_share")
        cells.append(f"{_fmt(share)}, {probe(name, ref, got)}")
        guard = result.report.guard or {}
        if label == "after":
            reading = "; ".join(
                f"{c['output']}: {c['kind']} {c['value']:.4g} (needs {c['limit']:g})"
                for c in guard.get("checks") or []
            )
            summary = str(guard.get("summary", ""))
    return f"| {name} | {reading} | {cells[0]} | {cells[1]} | {summary[:160]} |"


def _cell(r: dict) -> str:
    extra = f", neighbours {_fmt(r['neighbours'])}" if r["neighbours"] is not None else ""
    return f"{_fmt(r['int8_share'])}, {_fmt(r['agreement'])}{extra}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def main(out: str, names: list[str]) -> None:
    peers = [n for n in names if n in PEERS] if names else list(PEERS)
    specs = [model_by_name(n) for n in names if n not in PEERS] if names else list(MODELS)
    lines = [
        f"# The guard's readings before and after (issue 43): {time.strftime('%Y-%m-%d')}",
        "",
        f"CPU: {cpu_summary()}. `bench/int8/readings.py`: mixprec.quantize defaults on the",
        "bench's INT8 calibration samples; agreement on the eval inputs by the model's own",
        "post-processing (evaluate_int8); MiniLM also the eval sentences' neighbours.",
        "",
        "| model | output: reading now | before: INT8 share, agreement | after: INT8 share, "
        "agreement | after: guard |",
        "|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs:
            feeds = spec.make_inputs("eval")
            model = onnx.load(str(spec.path()))
            shapes = {k: tuple(v.shape) for k, v in feeds.items()}
            macs = macs_by_name(model, shapes, runtime_shapes(model, feeds))
            base = make_baseline(spec, feeds, macs)
            calib = int8_calibration(spec)
            old = _old_kinds(spec.path())
            before = _one(spec, base, calib, old, Path(tmp))
            after = _one(spec, base, calib, None, Path(tmp))
            reading = "; ".join(f"{o}: {', '.join(c)}" for o, c in after["checks"].items())
            lines.append(
                f"| {spec.name} | {reading} | {_cell(before)} | {_cell(after)} | "
                f"{after['summary'][:160]} |"
            )
            print(lines[-1], flush=True)
        for name in peers:
            lines.append(_peer(name, Path(tmp)))
            print(lines[-1], flush=True)
    Path(out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
