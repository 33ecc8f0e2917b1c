"""Benchmark mixprec against peer FP16/BF16 converters on real pretrained models.

    python -m bench [--models a,b] [--converters x,y] [--timeout 600] [--no-latency]
                          [--int8-only | --bf16-only | --weights-only | --optimize-only]
                          [--no-int8] [--no-bf16]
                          [--quantizers t,u] [--weight-models m,n] [--weight-tools v,w]

Needs the corpus (bench/harness/fetch.py) and the derived models (bench/exporters/minilm.py,
bench/exporters/mnist.py). Every conversion runs in its own subprocess
(bench/precision/convert_one.py) with a timeout; the rest is measured here. The INT8 part
(int8/suite.py, int8/quantize_one.py) runs
the INT8 quantizers the same way on the same models; the bf16 part (precision/bf16.py) runs the FP32
model, OpenVINO's blanket bf16 and mixprec's bf16 in OpenVINO. Writes
bench/results/<date>.json, .md and .png (<date>-int8.json and .md with --int8-only,
<date>-bf16.json and .md with --bf16-only) and prints the markdown. --weights-only runs
only the weight-only part (weights.py: INT4/INT8 weight-only quantizers on SmolLM2-135M
and Gemma 3 270M with their KV caches and on MiniLM) into <date>-weights.json and .md.
--optimize-only runs only the --optimize part (optimize.py: `mixprec optimize` against
the obvious recipes) into <date>-optimize.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from bench.harness import report
from bench.harness.common import (
    REPO_ROOT,
    RESULTS_DIR,
    cache_dir,
    module_command,
    result_row,
    run_measured,
)
from bench.harness.evaluate import Baseline, evaluate, first_line, make_baseline
from bench.harness.metrics import macs_by_name, runtime_shapes
from bench.harness.models import MODELS, ModelSpec
from bench.int8 import report as report_int8
from bench.int8 import suite as int8
from bench.optimize import suite as optimize
from bench.precision import bf16
from bench.precision.emulate import emulator
from bench.weights import report as report_weights
from bench.weights import suite as weights

JOBS: list[tuple[str, str]] = [
    ("mixprec", "fp16"),
    ("mixprec-nocal", "fp16"),
    ("onnxconverter-common", "fp16"),
    ("ort-float16", "fp16"),
    ("modelopt", "fp16"),
    ("mixprec", "bf16"),
    ("mixprec-nocal", "bf16"),
    ("modelopt", "bf16"),
]

PACKAGES = ("mixprec", "onnx", "onnxruntime", "onnxconverter-common", "nvidia-modelopt",
            "polygraphy", "onnx-graphsurgeon", "onnxscript", "onnxslim", "onnx-ir", "torch",
            "nncf", "openvino", "transformers", "tokenizers", "numpy", "ml_dtypes", "protobuf",
            "matplotlib", "gguf", "accelerate")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    try:
        found["mixprec_git"] = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
            capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        found["mixprec_git"] = None
    return found


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu": cpu, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "memory_gib": memory,
            "platform": platform.platform()}


def convert(spec: ModelSpec, converter: str, dtype: str, work: Path, calib: Path,
            shapes: dict[str, tuple[int, ...]], timeout: float) -> tuple[dict[str, Any], Path]:
    tag = f"{spec.name}__{converter}__{dtype}"
    out = work / f"{tag}.onnx"
    result_json = work / f"{tag}.json"
    result_json.unlink(missing_ok=True)
    cmd = [*module_command("precision.convert_one"), converter, dtype,
           str(spec.path()), str(out), str(result_json), "--calib", str(calib),
           "--calib-dir", str(calib.parent)]
    model = onnx.load(str(spec.path()), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    for vi in model.graph.input:
        if vi.name in initializers or vi.name not in shapes:
            continue
        dims = vi.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value <= 0 for d in dims):
            cmd += ["--shape", f"{vi.name}={','.join(str(d) for d in shapes[vi.name])}"]
    proc = run_measured(cmd, timeout, work / f"{tag}.log")
    row = result_row(proc, result_json, work / f"{tag}.log", timeout, "convert_one")
    return row, out


def reuse_or_convert(done: tuple[dict[str, Any], Path] | None, spec: ModelSpec, work: Path,
                     calib: Path, shapes: dict[str, tuple[int, ...]],
                     timeout: float) -> tuple[dict[str, Any], Path]:
    """mixprec's bf16 model for the bf16 part: the FP16/BF16 rows' conversion when they ran
    it (its failure included), else the same conversion (convert_one.py, same flags) now."""
    if done is not None:
        return done
    return convert(spec, "mixprec", "bf16", work, calib, shapes, timeout)


def prepare(spec: ModelSpec, work: Path) -> tuple[Baseline, Path]:
    feeds = spec.make_inputs("eval")
    calib_feeds = spec.make_inputs("calib")
    calib_dir = work / "inputs" / spec.name
    calib_dir.mkdir(parents=True, exist_ok=True)
    calib = calib_dir / "calib.npz"
    np.savez(calib, **calib_feeds)
    np.savez(work / "inputs" / f"{spec.name}_eval.npz", **feeds)
    model = onnx.load(str(spec.path()))
    shapes = {k: tuple(v.shape) for k, v in feeds.items()}
    macs = macs_by_name(model, shapes, runtime_shapes(model, feeds))
    return make_baseline(spec, feeds, macs), calib


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated subset of: "
                        + ",".join(m.name for m in MODELS))
    parser.add_argument("--converters", help="comma-separated subset of converter names")
    parser.add_argument("--timeout", type=float,
                        default=float(os.environ.get("MIXPREC_BENCH_TIMEOUT", "600")),
                        help="seconds per conversion (env MIXPREC_BENCH_TIMEOUT, default 600)")
    parser.add_argument("--no-latency", action="store_true", help="skip the latency runs")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--int8-only", action="store_true",
                      help="run only the INT8 part (results in <date>-int8.json/.md)")
    part.add_argument("--bf16-only", action="store_true",
                      help="run only the bf16 part (results in <date>-bf16.json/.md)")
    part.add_argument("--weights-only", action="store_true",
                      help="run only the weight-only part (results in <date>-weights.json/.md)")
    parser.add_argument("--accept-unconfirmed", action="store_true",
                        help="the --optimize part with optimize --accept-unconfirmed (results "
                        "in <date>-optimize-accept.json/.md)")
    parser.add_argument("--held-out", action="store_true",
                        help="the --optimize part with a held-out split handed to optimize as "
                        "--eval-data (models.held_out_samples; results in "
                        "<date>-optimize-held.json/.md)")
    part.add_argument("--optimize-only", action="store_true",
                      help="run only the --optimize part: mixprec optimize against the "
                      "obvious recipes (results in <date>-optimize.json/.md)")
    parser.add_argument("--no-int8", action="store_true", help="skip the INT8 part")
    parser.add_argument("--no-bf16", action="store_true",
                        help="skip the bf16 part (OpenVINO blanket bf16 vs mixprec bf16)")
    parser.add_argument("--quantizers", help="comma-separated subset of: " + ",".join(int8.TOOLS))
    parser.add_argument("--weight-models",
                        help="weight-only part: comma-separated subset of: "
                        + ",".join(weights.WEIGHT_MODELS))
    parser.add_argument("--weight-tools",
                        help="weight-only part: comma-separated subset of: "
                        + ",".join(weights.TOOLS))
    args = parser.parse_args(argv)
    if (args.int8_only and args.no_int8) or (args.bf16_only and args.no_bf16):
        parser.error("--int8-only/--bf16-only contradicts --no-int8/--no-bf16")

    specs = [m for m in MODELS if not args.models or m.name in args.models.split(",")]
    jobs = [j for j in JOBS if not args.converters or j[0] in args.converters.split(",")]
    tools = [t for t in int8.TOOLS if not args.quantizers or t in args.quantizers.split(",")]
    if args.int8_only or args.bf16_only:
        jobs = []
    if args.no_int8 or args.bf16_only:
        tools = []
    with_bf16 = not (args.no_bf16 or args.int8_only)
    started = time.perf_counter()
    date = dt.date.today().isoformat()
    work = cache_dir() / "work" / date
    work.mkdir(parents=True, exist_ok=True)
    emulate_fn, emulate_name = emulator()
    info = {"date": date, "started": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": machine(), "versions": versions(), "emulation": emulate_name,
            "timeout_s": args.timeout, "threads": 2, "jobs": jobs, "int8_tools": tools,
            "bf16_part": with_bf16}
    if args.weights_only:
        return weights_part(info, work, args, started)
    if args.optimize_only:
        return optimize_part(info, work, args, started, specs)
    print(f"bench: {len(specs)} models x ({len(jobs)} conversions + {len(tools)} INT8 "
          f"quantizers{' + the bf16 part' if with_bf16 else ''}); work dir {work}", flush=True)

    rows: list[dict[str, Any]] = []
    int8_rows: list[dict[str, Any]] = []
    bf16_rows: list[dict[str, Any]] = []
    baselines: dict[str, dict[str, Any]] = {}
    for spec in specs:
        base, calib = prepare(spec, work)
        baselines[spec.name] = {
            "source": spec.source, "path": str(base.path), "size_bytes": base.path.stat().st_size,
            "input_shapes": {k: list(v) for k, v in base.shapes.items()},
            "checker_error": base.checker_error, "stats": base.stats.to_dict(),
            "accuracy": base.accuracy, "labelled": base.labelled,
        }
        converted: dict[tuple[str, str], tuple[dict[str, Any], Path]] = {}
        for converter, dtype in jobs:
            t0 = time.perf_counter()
            row, out = convert(spec, converter, dtype, work, calib, base.shapes, args.timeout)
            converted[converter, dtype] = (row, out)
            row.update(model=spec.name, converter=converter, dtype=dtype)
            if row["status"] == "ok":
                try:
                    row.update(evaluate(base, out, dtype, emulate_fn, not args.no_latency))
                except Exception as exc:  # keep going with the other rows
                    row["evaluation_error"] = first_line(exc, 500)
            row["valid"] = report.is_valid(row)
            rows.append(row)
            summary = row.get("error") or (
                f"valid={row['valid']} casts={(row.get('stats') or {}).get('casts')} "
                f"relL2={row.get('worst_rel_l2')}")
            print(f"bench: {spec.name:11s} {converter:21s} {dtype} {row['status']:11s} "
                  f"{time.perf_counter() - t0:6.1f}s  {str(summary)[:110]}", flush=True)
        if tools:
            int8_rows += int8.run_model(spec, base, tools, work, args.timeout,
                                        not args.no_latency)
        if with_bf16:
            mixprec_bf16 = functools.partial(
                reuse_or_convert, converted.get(("mixprec", "bf16")), spec, work, calib,
                base.shapes, args.timeout)
            bf16_rows += bf16.run_model(spec, base, mixprec_bf16, not args.no_latency, work)

    names = [s.name for s in specs]
    targets = report.evaluate_targets(rows, names,
                                      {k: v["size_bytes"] for k, v in baselines.items()})
    agg = report.aggregate(rows)
    fp32_accuracy = {k: v["accuracy"] for k, v in baselines.items()}
    int8_part: dict[str, Any] = {}
    if tools:
        int8_part = {
            "rows": int8_rows,
            "aggregate": report_int8.aggregate(int8_rows),
            "targets": {t: report_int8.evaluate_targets(int8_rows, t, fp32_accuracy)
                        for t in report_int8.MIXPREC_TOOLS if t in tools},
            "calibration_samples": {r["model"]: r["calibration_samples"] for r in int8_rows},
        }
        if "mixprec" in tools and "mixprec-metric" in tools:  # the user who gives a metric
            int8_part["targets"][report_int8.WITH_METRIC] = report_int8.evaluate_targets(
                report_int8.with_task_metric(int8_rows), report_int8.WITH_METRIC,
                fp32_accuracy)
    bf16_part: dict[str, Any] = {}
    if with_bf16:
        bf16_part = bf16.part(bf16_rows, bf16.cpu_flags(), bf16.openvino_info())
    info["elapsed_s"] = time.perf_counter() - started

    args.results.mkdir(parents=True, exist_ok=True)
    suffix = "-int8" if args.int8_only else "-bf16" if args.bf16_only else ""
    stem = args.results / f"{date}{suffix}"
    payload = {**info, "models": baselines, "rows": rows, "aggregate": agg, "targets": targets,
               "int8": int8_part, "bf16": bf16_part}
    stem.with_suffix(".json").write_text(json.dumps(_json_safe(payload), indent=1))
    written = ".json, .md"
    if rows:
        report.chart(rows, names, stem.with_suffix(".png"))
        written += " and .png"
    markdown = render(info, baselines, rows, agg, targets, int8_part, bf16_part)
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"bench: wrote {stem}{written} in {info['elapsed_s']:.0f}s")
    return 0


def weights_part(info: dict[str, Any], work: Path, args: argparse.Namespace,
                 started: float) -> int:
    """The weight-only part alone: <date>-weights.json and .md."""
    picked = args.weight_tools.split(",") if args.weight_tools else None
    # in --weight-tools' order (e.g. the peers first, a slow tool last)
    tools = list(weights.TOOLS) if picked is None else [t for t in picked if t in weights.TOOLS]
    models = tuple(m for m in (args.weight_models or ",".join(weights.WEIGHT_MODELS)).split(",")
                   if m in weights.WEIGHT_MODELS)
    info.update(jobs=[], int8_tools=[], bf16_part=False, weight_tools=tools,
                weight_models=list(models))
    print(f"bench: weight-only part, {len(tools)} tools on {', '.join(models)}; work dir "
          f"{work}", flush=True)
    found = weights.part(work, tools, args.timeout, models)
    info["elapsed_s"] = time.perf_counter() - started
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"{info['date']}-weights"
    stem.with_suffix(".json").write_text(
        json.dumps(_json_safe({**info, "weights": found}), indent=1))
    m = info["machine"]
    markdown = "\n".join([
        f"# mixprec benchmark, weight-only part, {info['date']}", "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gib']} GiB.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v), "",
        report_weights.render(found), f"Total bench time: {info['elapsed_s']:.0f} s.", ""])
    stem.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"bench: wrote {stem}.json, .md in {info['elapsed_s']:.0f}s")
    return 0


def optimize_part(info: dict[str, Any], work: Path, args: argparse.Namespace, started: float,
                  specs: list[ModelSpec]) -> int:
    """The --optimize part alone: <date>-optimize.json and .md, rewritten after each model
    (a run stopped part way keeps the models done); models in --models' order."""
    info.update(jobs=[], int8_tools=[], bf16_part=False, optimize_part=True)
    if args.models:
        order = args.models.split(",")
        specs = sorted(specs, key=lambda s: order.index(s.name))
    print(f"bench: --optimize part on {len(specs)} models; work dir {work}", flush=True)
    results: list[dict[str, Any]] = []
    for spec in specs:
        base, _ = prepare(spec, work)
        results.append(optimize.run_model(spec, base, work, args.timeout, not args.no_latency,
                                          args.accept_unconfirmed, args.held_out))
        markdown = write_optimize(info, results, args.results, started, args.accept_unconfirmed,
                                  args.held_out)
    print(markdown)
    print(f"bench: wrote {args.results / info['date']}-optimize*.json, .md in "
          f"{info['elapsed_s']:.0f}s")
    return 0


def write_optimize(info: dict[str, Any], results: list[dict[str, Any]], folder: Path,
                   started: float, accept: bool = False, held: bool = False) -> str:
    """Writes <date>-optimize.json and .md (with --accept-unconfirmed:
    <date>-optimize-accept.*; with --held-out: -held) for the models done; returns the
    markdown."""
    found = optimize.part(results)
    info["elapsed_s"] = time.perf_counter() - started
    info["optimize_accept_unconfirmed"] = accept
    info["optimize_held_out"] = held
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ("-accept" if accept else "") + ("-held" if held else "")
    stem = folder / f"{info['date']}-optimize{suffix}"
    stem.with_suffix(".json").write_text(
        json.dumps(_json_safe({**info, "optimize": found}), indent=1))
    m = info["machine"]
    markdown = "\n".join([
        f"# mixprec benchmark, optimize part, {info['date']}"
        + (" (optimize --accept-unconfirmed)" if accept else "")
        + (" (a held-out split as optimize --eval-data)" if held else ""), "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gib']} GiB.",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v), "",
        optimize.render(found), f"Total bench time: {info['elapsed_s']:.0f} s.", ""])
    stem.with_suffix(".md").write_text(markdown)
    return markdown


def render(info: dict[str, Any], baselines: dict[str, dict[str, Any]], rows: list[dict[str, Any]],
           agg: list[dict[str, Any]], targets: list[dict[str, Any]],
           int8_part: dict[str, Any] | None = None,
           bf16_part: dict[str, Any] | None = None) -> str:
    v = info["versions"]
    m = info["machine"]
    lines = [
        f"# mixprec benchmark, {info['date']}",
        "",
        f"Machine: {m['cpu']}, {m['usable_cores']} usable cores, {m['memory_gib']} GiB. "
        f"ORT CPU, {info['threads']} intra-op threads.",
        "Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        "",
        ("FP16/BF16 columns" if rows else "FP16/BF16 part not run; its columns") +
        ": valid = fp16 runs in ORT / bf16 passes onnx.checker full_check; check/ORT = "
        "full checker passes / ORT CPU loads and runs it; casts = Cast nodes (subgraphs "
        "included); low nodes / low MACs = share of float nodes / of Conv, ConvTranspose, "
        "MatMul, Gemm multiply-accumulates whose first float input is fp16/bf16; size = file "
        "size / FP32 file; worst rel L2 and max abs err over all outputs vs the FP32 model in "
        f"ORT ((emu) = {info['emulation']}: every low-precision tensor rounded through its "
        "dtype in an FP32 graph, used for bf16 and for models ORT cannot run); top-1 = "
        "lowest arg-max agreement over class-score outputs; conv s = reading, converting and "
        "writing (no interpreter start or imports); peak RSS = of the converter's whole "
        "process; latency = median converted / median FP32, interleaved runs.",
        "",
        "## FP32 models",
        "",
        "| model | source | inputs | MB | nodes | GMACs | full check |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, b in baselines.items():
        shapes = "; ".join(f"{k} {'x'.join(map(str, s)) or 'scalar'}"
                           for k, s in b["input_shapes"].items())
        check = "pass" if b["checker_error"] is None else f"fail: {b['checker_error'][:60]}"
        acc = f" (accuracy {100 * b['accuracy']:.1f}%)" if b.get("accuracy") is not None else ""
        lines.append(f"| {name} | {b['source']}{acc} | {shapes} | {b['size_bytes'] / 2**20:.1f} "
                     f"| {b['stats']['nodes']} | {b['stats']['macs_total'] / 1e9:.2f} | {check} |")
    lines.append("")
    if rows:
        lines += ["## Per model and converter", "", report.model_table(rows), "",
                  "## Per converter", "", report.aggregate_table(agg), "",
                  "## Issue 3 targets for mixprec", "", report.targets_markdown(targets), ""]
    if int8_part:
        lines.append(report_int8.render(
            int8_part["rows"], int8_part["aggregate"], int8_part["targets"],
            {k: v["accuracy"] for k, v in baselines.items()}, int8_part["calibration_samples"],
            {k: v.get("labelled") for k, v in baselines.items()}))
    if bf16_part:
        lines.append(bf16.render(bf16_part, {k: v["accuracy"] for k, v in baselines.items()}))
    problems = [r for r in rows if r.get("status") == "ok" and (
        r.get("ort_error") or r.get("checker_error") or r.get("emulation_error"))]
    if problems:
        lines += ["## Problems with converted models", ""]
        for r in problems:
            for key in ("checker_error", "ort_error", "emulation_error"):
                if r.get(key):
                    text = str(r[key]).replace("\n", " ")[:220]
                    lines.append(f"- {r['model']} {report.label(r)}: {key}: {text}")
        lines.append("")
    failures = [r for r in rows if r.get("status") != "ok"]
    if failures:
        lines += ["## Conversions that did not produce a model", ""]
        for r in failures:
            text = str(r.get("error")).replace("\n", " ")[:300]
            lines.append(f"- {r['model']} {report.label(r)}: {r['status']}: {text}")
        lines.append("")
    lines.append(f"Total bench time: {info['elapsed_s']:.0f} s.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
