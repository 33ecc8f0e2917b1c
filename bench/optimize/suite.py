"""The --optimize part of the bench: `mixprec optimize` against the obvious recipes.

Per model, `mixprec optimize` runs in its own subprocess (quantize_one.py's
``mixprec-optimize``, with a timeout; wall time and peak RSS of that process) on the INT8
part's calibration samples (int8.write_calibration: one .npz per sample). ORT's U8S8 QDQ
model is made the INT8 part's way (quantize_one.py ``ort-u8s8``). Then, in this process,
every recipe and optimize's written model run the same eval feeds (models.py) and are
timed in one interleaved loop (bf16.interleaved, 2 threads):

  ort-fp32   the FP32 model in ONNX Runtime: the reference (ratio 1.0)
  ov-fp32    the FP32 model in OpenVINO, INFERENCE_PRECISION_HINT f32
  ov-bf16    the FP32 model in OpenVINO, INFERENCE_PRECISION_HINT bf16 (the blanket hint;
             a CPU without bf16 computes it in f32: the page says which)
  ort-u8s8   ORT's quantize_static U8S8 QDQ model in ONNX Runtime
  ov-u8s8    the same model in OpenVINO (hint f32)
  ov-nncf    NNCF's INT8 (quantize_one.py ``nncf``: nncf.quantize, ONNX backend, default
             preset, the same samples) in OpenVINO under the bf16 hint: OpenVINO's own
             INT8 recipe, its float layers in bf16 where the CPU has it
  optimize   optimize's output, in the runtime its metadata names
             (mixprec.runtime.engines.options_from_metadata; absent: ONNX Runtime)

A recipe counts only where it is accurate (:func:`accurate`).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from bench.harness.evaluate import Baseline, decision_f1, first_line
from bench.harness.models import HELD_ROWS, Feeds, ModelSpec, eval_crops, held_out_samples
from bench.harness.report import num
from bench.int8.quantize_one import OPTIMIZE
from bench.int8.suite import quantize, write_calibration, write_samples
from bench.precision.bf16 import Runner, error_text, interleaved, ort_runner, ov_runner, score
from mixprec.core.metrics import rel_l2_error, top1_agreement
from mixprec.io.runtime_fields import props_of
from mixprec.runtime.engines import options_from_metadata
from mixprec.runtime.openvino import MARKS_CONFIG
from mixprec.runtime.ov_marks import runtime_model_path

Row = dict[str, Any]

REFERENCE = "ort-fp32"
CHOSEN = "optimize"
U8S8 = "ort-u8s8"
#: recipe -> (runtime, OpenVINO precision hint, which model)
RECIPES: dict[str, tuple[str, str | None, str]] = {
    REFERENCE: ("onnxruntime", None, "fp32"),
    "ov-fp32": ("openvino", "f32", "fp32"),
    "ov-bf16": ("openvino", "bf16", "fp32"),
    U8S8: ("onnxruntime", None, "u8s8"),
    "ov-u8s8": ("openvino", "f32", "u8s8"),
    "ov-nncf": ("openvino", "bf16", "nncf"),
}
#: which INT8 model -> the quantize_one.py tool that makes it
PEER_TOOLS = {"u8s8": U8S8, "nncf": "nncf"}
#: "accurate" (issue 36): a labelled probe drops at most 1 pt and agrees with FP32 on at
#: least 98%; without a probe, agreement (top-1, cosine, decision F1) >= 0.98 and every
#: other output's rel L2 to FP32 <= 0.1
MAX_DROP = 0.01
MIN_AGREEMENT = 0.98
MAX_REL_L2 = 0.1
SLOWER_MARGIN = 1.05  # never slower than the best accurate recipe by more than 5%
MEDIAN_GAIN = 0.90  # median at least 10% faster than the best accurate recipe
WALL_MEDIAN_S = 120.0
WALL_WORST_S = 600.0
RSS_RATIO = 1.5  # optimize's peak RSS <= 1.5x ORT quantize_static's on the same model


class _Session:
    """What ocr_text's labelled sets call (``run(names, feeds)``), on any runner."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def run(self, names: Sequence[str], feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        found = self.runner.infer(dict(feeds))
        return [found[n] for n in names]


def load(runtime: str, hint: str | None, path: Path,
         extra: Mapping[str, str] | None = None) -> Runner:
    if runtime == "onnxruntime":
        return ort_runner(path)
    return ov_runner(path, hint or "f32", extra)


def chosen_runtime(path: Path) -> tuple[str, str | None]:
    """(runtime, hint) that optimize's output names in its metadata_props."""
    options = options_from_metadata(onnx.load(str(path), load_external_data=False), 2)
    if options is None or options.name == "ort":
        return "onnxruntime", None
    return "openvino", options.precision or "f32"


def served_file(path: Path) -> tuple[Path, dict[str, str]]:
    """What plain OpenVINO compiles of optimize's output, as the optimize guide says: the
    marked IR its metadata names (bf16-lists-openvino's OUT.xml), with Snippets off (the
    marks hold only then), else the file itself. Before, the bench compiled the ONNX file
    of such a pair, without its marks: OpenVINO's blanket bf16 under another name (MNIST:
    0.94x ORT there, 0.80x as optimize had timed the pair)."""
    props = props_of(onnx.load(str(path), load_external_data=False))
    xml = runtime_model_path(props, path.parent)
    return (path, {}) if xml is None else (xml, dict(MARKS_CONFIG))


@functools.cache
def _crop_reference(spec: ModelSpec, path: Path) -> tuple[list[Feeds], dict[str, np.ndarray]]:
    """The eval crops (models.eval_crops) and FP32's outputs on them in ORT, rows stacked."""
    crops = eval_crops(spec) or []
    return crops, _stacked(ort_runner(path), crops) if crops else {}


def _stacked(runner: Runner, feeds: Sequence[Feeds]) -> dict[str, np.ndarray]:
    found = [runner.infer(dict(f)) for f in feeds]
    return {name: np.concatenate([f[name] for f in found]) for name in found[0]}


def _crop_probe(base: Baseline, runner: Runner) -> Row | None:
    """Top-1 agreement with FP32 over the 4096 eval crops of MTCNN R-Net / O-Net, and the
    worst rel L2 of the other outputs (box offsets, landmarks) over them: 8 crops cannot
    tell a recipe that keeps 99% of its answers from one that keeps 97%."""
    crops, ref = _crop_reference(base.spec, base.path)
    if not crops:
        return None
    got = _stacked(runner, crops)
    classes = base.spec.class_outputs
    top1 = min(top1_agreement(ref[n], got[n]) for n in classes)
    others = [rel_l2_error(ref[n], got[n]) for n in ref if n not in classes]
    return {"rows": len(ref[classes[0]]), "top1_agreement": top1,
            "regression_rel_l2": max(others) if others else None}


def judge(base: Baseline, runner: Runner) -> Row:
    """Accuracy of one runner on the eval feeds (and the labelled probe, if any; MTCNN
    R-Net / O-Net: agreement and regressions read over their 4096 eval crops)."""
    outputs = runner.infer(base.feeds)
    row = score(base, outputs)
    f1s = [decision_f1(base.outputs[n], outputs[n], t) for n, t in base.spec.decisions
           if n in outputs and outputs[n].shape == base.outputs[n].shape]
    row["decision_f1"] = min(f1s) if f1s else None
    row["agreement"] = next((row[k] for k in ("top1_agreement", "min_cosine", "decision_f1")
                             if row.get(k) is not None), None)
    row["regression_rel_l2"] = _regression_rel_l2(base.spec, row)
    if (probe := _crop_probe(base, runner)) is not None:
        row.update(crops=probe, agreement=probe["top1_agreement"],
                   regression_rel_l2=probe["regression_rel_l2"])
    if base.spec.labelled is not None and base.labelled_predictions is not None:
        found = base.spec.labelled()
        labelled = found.score(found.predict(_Session(runner)), base.labelled_predictions)
        row.update(labelled=labelled, accuracy=labelled["accuracy"],
                   agreement=labelled["agreement"])
    return row


def _regression_rel_l2(spec: ModelSpec, row: Row) -> float | None:
    """The worst rel L2 over outputs that are not class scores, embeddings or decisions."""
    judged = {*spec.class_outputs, *spec.embedding_outputs, *(n for n, _ in spec.decisions)}
    found = [e["rel_l2"] for n, e in row["outputs"].items() if n not in judged]
    return max(found) if found else None


def accurate(row: Row, fp32_accuracy: float | None) -> bool | None:
    """Issue 36's "accurate" (see MAX_DROP...); None: nothing measured."""
    if row.get("status") != "ok":
        return None
    checks: list[bool] = []
    if row.get("accuracy") is not None and fp32_accuracy is not None:
        checks.append(fp32_accuracy - row["accuracy"] <= MAX_DROP + 1e-9)
    if row.get("agreement") is not None:
        checks.append(row["agreement"] >= MIN_AGREEMENT)
    if row.get("labelled") is None and row.get("regression_rel_l2") is not None:
        checks.append(row["regression_rel_l2"] <= MAX_REL_L2)
    return all(checks) if checks else None


def _variant(spec: ModelSpec, name: str, runtime: str, hint: str | None) -> Row:
    return {"model": spec.name, "variant": name, "runtime": runtime, "precision_hint": hint}


def measure(base: Baseline, row: Row, path: Path | None,
            extra: Mapping[str, str] | None = None) -> Runner | None:
    """Loads and scores one variant into ``row`` (``extra``: OpenVINO properties beside
    the hint); its runner, or None (the error noted)."""
    if path is None:
        row.setdefault("status", "error")
        return None
    try:
        runner = load(row["runtime"], row["precision_hint"], path, extra)
        row.update(judge(base, runner), status="ok", compiled=runner.compiled)
    except Exception as exc:  # a model a runtime cannot load or run is a result
        row.update(status="error", error=error_text(exc))
        return None
    row["accurate"] = accurate(row, base.accuracy)
    return runner


def serving_shapes(base: Baseline) -> list[str]:
    """``--shape`` arguments for the bench shape (what every recipe is timed at): what a
    user serving at that shape gives optimize."""
    return [f"{name}={','.join(str(d) for d in value.shape)}"
            for name, value in base.latency_feeds.items() if np.ndim(value)]


def run_optimize(spec: ModelSpec, base: Baseline, work: Path, calib_dir: Path,
                 timeout: float, accept: bool = False,
                 held_dir: Path | None = None) -> tuple[Row, Path | None]:
    """`mixprec optimize` in its own measured subprocess, told the bench shape (``accept``:
    with --accept-unconfirmed; ``held_dir``: held-out samples as --eval-data); the run's
    row and its output."""
    extra = [a for shape in serving_shapes(base) for a in ("--shape", shape)]
    extra += ["--accept-unconfirmed"] if accept else []
    extra += ["--eval-data", str(held_dir)] if held_dir is not None else []
    run, out = quantize(spec, OPTIMIZE, work, calib_dir, timeout, extra)
    report = run.get("report") or {}
    report.pop("nodes", None)  # run_mixprec_cli's per-node count: optimize has none
    keep = ("status", "error", "convert_s", "import_s", "wall_s", "peak_rss_mb", "argv")
    found = {k: run.get(k) for k in keep if k in run}
    found.update(winner=report.get("winner"), unchanged=report.get("unchanged"),
                 metadata=report.get("metadata"), summary=report.get("summary"),
                 candidates=report.get("candidates"), notes=report.get("notes"))
    return found, out if run.get("status") == "ok" and out.is_file() else None


def _peer(spec: ModelSpec, tool: str, work: Path, calib_dir: Path,
          timeout: float) -> tuple[Row, Path | None]:
    row, out = quantize(spec, tool, work, calib_dir, timeout)
    keep = {k: row.get(k) for k in ("status", "error", "convert_s", "wall_s", "peak_rss_mb")}
    return keep, out if row.get("status") == "ok" and out.is_file() else None


def write_held_out(spec: ModelSpec, folder: Path) -> int | None:
    """Writes the model's held-out samples (models.held_out_samples) to ``folder``, one .npz
    each; None where the bench has none for it."""
    samples = held_out_samples(spec)
    return None if samples is None else write_samples(samples, folder)


def run_model(spec: ModelSpec, base: Baseline, work: Path, timeout: float,
              measure_latency: bool = True, accept: bool = False, held: bool = False) -> Row:
    """One model: optimize's run (``accept``: --accept-unconfirmed; ``held``: with the
    model's held-out samples as --eval-data, where the bench has some), every recipe's row
    and optimize's output's row."""
    t0 = time.perf_counter()
    calib_dir = work / "inputs" / f"{spec.name}_int8_calib"
    write_calibration(spec, calib_dir)
    held_dir = work / "inputs" / f"{spec.name}_held"
    count = write_held_out(spec, held_dir) if held else None
    run, chosen = run_optimize(spec, base, work, calib_dir, timeout, accept,
                               held_dir if count else None)
    run["held_out_samples"] = count
    peers = {which: _peer(spec, tool, work, calib_dir, timeout)
             for which, tool in PEER_TOOLS.items()}
    paths = {"fp32": base.path, **{which: out for which, (_, out) in peers.items()}}
    rows: dict[str, Row] = {}
    runners: dict[str, Runner] = {}
    for name, (runtime, hint, which) in RECIPES.items():
        rows[name] = _variant(spec, name, runtime, hint)
        if which in peers:
            rows[name]["quantization"] = peers[which][0]
        if (runner := measure(base, rows[name], paths[which])) is not None:
            runners[name] = runner
    rows[CHOSEN] = _chosen_row(spec, base, chosen, run, runners)
    rows[CHOSEN]["same_as"] = same_deployment(rows[CHOSEN], chosen, paths)
    if measure_latency and REFERENCE in runners:
        add_latency(rows, runners, base)
    result = {"model": spec.name, "optimize": run, "rows": list(rows.values())}
    result["summary"] = summarize(result)
    _print(spec, result, time.perf_counter() - t0)
    return result


def _chosen_row(spec: ModelSpec, base: Baseline, chosen: Path | None, run: Row,
                runners: dict[str, Runner]) -> Row:
    if chosen is None:
        row = _variant(spec, CHOSEN, "?", None)
        row.update(status=run.get("status") or "error", error=run.get("error"))
        return row
    try:
        runtime, hint = chosen_runtime(chosen)
    except Exception as exc:  # metadata mixprec itself cannot read is a result
        row = _variant(spec, CHOSEN, "?", None)
        row.update(status="error", error=first_line(exc))
        return row
    row = _variant(spec, CHOSEN, runtime, hint)
    served, extra = served_file(chosen) if runtime == "openvino" else (chosen, {})
    if served != chosen:
        row["served"] = f"{served.name} with {extra}"
    if (runner := measure(base, row, served, extra)) is not None:
        runners[CHOSEN] = runner
    return row


def _graph_bytes(path: Path) -> bytes:
    """The model as a runtime compiled at the bench shape sees it: through onnx_ir (one
    spelling of empty fields), initializers by name, no metadata, no value_info, no input
    or output shapes (a model written with the static shape it was timed at is the same
    deployment as the dynamic one the bench compiles at that shape)."""
    proto = ir.serde.serialize_model(ir.serde.deserialize_model(onnx.load(str(path))))
    del proto.metadata_props[:], proto.graph.value_info[:]
    for value in (*proto.graph.input, *proto.graph.output):
        value.type.tensor_type.ClearField("shape")
    ordered = sorted(proto.graph.initializer, key=lambda t: t.name)
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(ordered)
    return proto.SerializeToString()


def same_deployment(row: Row, chosen: Path | None, paths: Mapping[str, Path | None]) -> str | None:
    """The recipe that is optimize's output itself (same runtime, hint and graph; the FP32
    model in a runtime, or OpenVINO's bf16 hint on it), or None: two sessions of one
    deployment then time apart only by this machine's noise."""
    if chosen is None or row.get("status") != "ok" or row.get("served"):
        return None  # a marked IR with its own properties is a deployment of its own
    served = (row["runtime"], row["precision_hint"] or None)
    alike = [(name, paths.get(which)) for name, (runtime, hint, which) in RECIPES.items()
             if (runtime, hint or None) == served and paths.get(which) is not None]
    written = _graph_bytes(chosen) if alike else None
    return next((name for name, path in alike if path and _graph_bytes(path) == written), None)


def add_latency(rows: dict[str, Row], runners: Mapping[str, Runner], base: Baseline) -> None:
    """Every runner timed in one interleaved loop at the model's bench shape, in a random
    order each round (bf16.interleaved's ``shuffle``)."""
    try:
        timing = interleaved({k: r.bind(base.latency_feeds) for k, r in runners.items()},
                             REFERENCE, shuffle=True)
    except Exception as exc:
        for name in runners:
            rows[name]["latency_error"] = first_line(exc)
        return
    reference = timing["ms"][REFERENCE]
    for name, ms in timing["ms"].items():
        rows[name]["latency"] = {"ms": ms, "ratio": ms / reference, "rounds": timing["rounds"],
                                 "runs_per_sample": timing["runs_per_sample"]}


def _ratio(row: Row | None) -> float | None:
    return None if row is None else (row.get("latency") or {}).get("ratio")


def best_recipe(rows: Sequence[Row]) -> Row | None:
    """The fastest accurate, timed recipe (optimize's own row excluded)."""
    found = [r for r in rows if r["variant"] in RECIPES and r.get("accurate")
             and _ratio(r) is not None]
    return min(found, key=lambda r: _ratio(r) or 0.0, default=None)


def summarize(result: Row) -> Row:
    """The page's row of one model."""
    chosen = next((r for r in result["rows"] if r["variant"] == CHOSEN), None)
    best = best_recipe(result["rows"])
    ratio, best_ratio = _ratio(chosen), _ratio(best)
    same = None if chosen is None else chosen.get("same_as")
    # optimize's output is that recipe: the recipe's own timing is its speed, and the two
    # sessions' difference is this run's noise between identical deployments
    deployed = next((_ratio(r) for r in result["rows"] if r["variant"] == same), None) or ratio
    run = result["optimize"]
    return {"model": result["model"], "winner": run.get("winner"),
            "runtime": None if chosen is None else chosen.get("runtime"),
            "precision_hint": None if chosen is None else chosen.get("precision_hint"),
            "ratio": ratio, "accurate": None if chosen is None else chosen.get("accurate"),
            "accuracy": _accuracy_text(chosen), "best_recipe": None if best is None
            else best["variant"], "best_ratio": best_ratio,
            "same_as": same, "same_noise": None if same is None or not ratio or not deployed
            else ratio / deployed,
            "versus_best": None if deployed is None or not best_ratio else deployed / best_ratio,
            "wall_s": run.get("wall_s"), "peak_rss_mb": run.get("peak_rss_mb"),
            "u8s8_peak_rss_mb": u8s8_rss(result["rows"]),
            "status": run.get("status"), "error": run.get("error")}


def u8s8_rss(rows: Sequence[Row]) -> float | None:
    """ORT quantize_static's peak RSS on the model (its measured subprocess)."""
    for row in rows:
        quantization = row.get("quantization") or {}
        if row["variant"] == "ort-u8s8" and quantization.get("status") == "ok":
            return quantization.get("peak_rss_mb")
    return None


def _accuracy_text(row: Row | None) -> str:
    if row is None or row.get("status") != "ok":
        return "–"
    parts = []
    if row.get("accuracy") is not None:
        parts.append(f"acc {100 * row['accuracy']:.1f}%")
    if row.get("agreement") is not None:
        parts.append(f"agree {row['agreement']:.4f}")
    if row.get("labelled") is None and row.get("regression_rel_l2") is not None:
        parts.append(f"relL2 {row['regression_rel_l2']:.2e}")
    return ", ".join(parts) or "–"


def _print(spec: ModelSpec, result: Row, seconds: float) -> None:
    for row in result["rows"]:
        summary = row.get("error") or (f"accurate={row.get('accurate')} "
                                       f"{_accuracy_text(row)} latency={num(_ratio(row), '.2f')}")
        print(f"bench: {spec.name:11s} {row['variant']:21s} opt {row.get('status', '?'):11s} "
              f"{seconds:6.1f}s  {str(summary)[:110]}", flush=True)


def target_row(goal: str, offenders: list[str], checked: int, detail: str = "") -> Row:
    return {"goal": goal, "met": not offenders and checked > 0, "offenders": offenders,
            "checked": checked, "detail": detail}


def goals(summaries: Sequence[Row]) -> list[Row]:
    """Issue 36's goals on the per-model rows, each met / missed with the offenders."""
    ran = [s for s in summaries if s.get("status") == "ok"]
    offenders = [f"{s['model']}: " + (s["accuracy"] if s.get("status") == "ok"
                                      else f"optimize {s.get('status')}")
                 for s in summaries if s.get("accurate") is not True]
    targets = [target_row("every model accurate (probe drop <= 1 pt, agreement >= 0.98; "
                       "without a probe also rel L2 <= 0.1)", offenders, len(summaries))]
    versus = [s for s in ran if s.get("versus_best") is not None]
    targets.append(target_row(
        f"never slower than the best accurate recipe by more than {SLOWER_MARGIN - 1:.0%}",
        [f"{s['model']}: {s['versus_best']:.2f}x {s['best_recipe']}" for s in versus
         if s["versus_best"] > SLOWER_MARGIN], len(versus)))
    med = statistics.median(s["versus_best"] for s in versus) if versus else None
    detail = "" if med is None else f"median {med:.2f}x the best recipe"
    targets.append(target_row(f"median at least {1 - MEDIAN_GAIN:.0%} faster than the best "
                           "accurate recipe (median ratio <= 0.90)",
                           [detail] if med is not None and med > MEDIAN_GAIN else [],
                           len(versus), detail))
    targets += _wall_goals(summaries)
    both = [s for s in ran if s.get("peak_rss_mb") and s.get("u8s8_peak_rss_mb")]
    targets.append(target_row(
        f"optimize peak RSS <= {RSS_RATIO:g}x ORT quantize_static's on the same model",
        [f"{s['model']}: {s['peak_rss_mb']:.0f} MB = "
         f"{s['peak_rss_mb'] / s['u8s8_peak_rss_mb']:.2f}x {s['u8s8_peak_rss_mb']:.0f} MB"
         for s in both if s["peak_rss_mb"] > RSS_RATIO * s["u8s8_peak_rss_mb"]], len(both)))
    return targets


def _wall_goals(summaries: Sequence[Row]) -> list[Row]:
    """Over every run, a time-out included (its wall time is the timeout, and it misses)."""
    ran = [s for s in summaries if s.get("wall_s") is not None]
    walls = [s["wall_s"] for s in ran]
    med = statistics.median(walls) if walls else None
    detail = "" if med is None else f"median {med:.0f} s"
    return [target_row(f"optimize wall time median <= {WALL_MEDIAN_S / 60:.0f} min",
                    [detail] if med is not None and med > WALL_MEDIAN_S else [],
                    len(walls), detail),
            target_row(f"optimize wall time worst <= {WALL_WORST_S / 60:.0f} min",
                    [f"{s['model']}: {s['wall_s']:.0f} s{' (timed out)' * timed_out(s)}"
                     for s in ran if s["wall_s"] > WALL_WORST_S or timed_out(s)], len(walls))]


def timed_out(summary: Row) -> bool:
    return summary.get("status") == "timeout"


def summary_table(summaries: Sequence[Row]) -> str:
    lines = ["| model | chosen | runtime | ratio | accurate | accuracy | best accurate recipe "
             "| its ratio | chosen / best | wall s | peak RSS MB | quantize_static's MB |",
             "|" + "---|" * 12]
    for s in summaries:
        runtime = s.get("runtime") or "–"
        if s.get("precision_hint"):
            runtime += f" ({s['precision_hint']})"
        verdict = {True: "yes", False: "**no**", None: "–"}[s.get("accurate")]
        winner = s.get("winner") or f"{s.get('status')}: {str(s.get('error'))[:60]}"
        lines.append(
            f"| {s['model']} | {winner} | {runtime} | {num(s.get('ratio'), '.2f')} "
            f"| {verdict} | {s['accuracy']} | {s.get('best_recipe') or '–'} "
            f"| {num(s.get('best_ratio'), '.2f')} | {_versus_text(s)} "
            f"| {num(s.get('wall_s'), '.0f')} | {num(s.get('peak_rss_mb'), '.0f')} "
            f"| {num(s.get('u8s8_peak_rss_mb'), '.0f')} |")
    return "\n".join(lines)


def _versus_text(summary: Row) -> str:
    """chosen / best; where optimize's output is a recipe itself, that recipe's ratio to the
    best, and how far its own session timed from the recipe's."""
    text = num(summary.get("versus_best"), ".2f")
    if summary.get("same_as"):
        text += (f" (= {summary['same_as']}; its own session "
                 f"{num(summary.get('same_noise'), '.2f')}x)")
    return text


def recipe_table(results: Sequence[Row]) -> str:
    lines = ["| model | variant | runtime | ratio | ms | accurate | accuracy | note |",
             "|" + "---|" * 8]
    for result in results:
        for r in result["rows"]:
            latency = r.get("latency") or {}
            verdict = {True: "yes", False: "no", None: "–"}[r.get("accurate")]
            note = str(r.get("error") or r.get("latency_error") or "").replace("|", "/")[:90]
            runtime = r["runtime"] + (f" ({r['precision_hint']})" if r["precision_hint"] else "")
            lines.append(f"| {r['model']} | {r['variant']} | {runtime} "
                         f"| {num(latency.get('ratio'), '.2f')} "
                         f"| {num(latency.get('ms'), '.2f')} | {verdict} "
                         f"| {_accuracy_text(r)} | {note} |")
    return "\n".join(lines)


def goals_markdown(targets: Sequence[Row]) -> str:
    lines = ["| goal | met | checked | detail / offenders |", "|---|---|---|---|"]
    for t in targets:
        found = "; ".join(t["offenders"]) or t["detail"]
        lines.append(f"| {t['goal']} | {'yes' if t['met'] else '**no**'} | {t['checked']} "
                     f"| {found} |")
    return "\n".join(lines)


def candidates_table(results: Sequence[Row]) -> str:
    """optimize's own table, as its --json gave it."""
    lines = ["| model | candidate | runtime | ratio | rounds | accuracy | verdict |",
             "|" + "---|" * 7]
    for result in results:
        for c in result["optimize"].get("candidates") or []:
            verdict = c["verdict"] + (f": {c['reason']}" if c.get("reason") else "")
            lines.append(f"| {result['model']} | {c['name']} | {c['runtime']} "
                         f"| {num(c.get('ratio'), '.2f')} | {c.get('rounds') or '–'} "
                         f"| {c.get('accuracy') or '–'} | {verdict.replace('|', '/')[:120]} |")
    return "\n".join(lines)


COLUMNS = (
    "Recipes, each timed in one interleaved loop with the others and with optimize's output "
    "(each round runs every session once in a seeded random order: with a fixed order the "
    "OpenVINO session right after ORT's measured 4-8% slower than the same model further "
    "along; 2 threads; ORT threads spin within a run and stop after it "
    "(session.force_spinning_stop); OpenVINO INFERENCE_NUM_THREADS 2, PERFORMANCE_HINT "
    "LATENCY, compiled for the bench shape): ort-fp32 (the reference, ratio 1.00), ov-fp32, "
    "ov-bf16 (OpenVINO's blanket bf16 hint), ort-u8s8 (ORT quantize_static U8S8 QDQ, "
    "per-channel, MinMax, on the same 16 calibration samples) in ORT, ov-u8s8 (the same "
    "model in OpenVINO), ov-nncf (NNCF's quantize, ONNX backend, default preset, the same "
    "samples, in OpenVINO under the bf16 hint: OpenVINO's own INT8 recipe). "
    "ratio = median latency / ort-fp32's at the model's bench shape. "
    "Accurate: where a labelled probe exists (PP-OCR det/rec/cls: ocr_text.py; MNIST: "
    f"held-out digits) accuracy drops at most {MAX_DROP * 100:.0f} pt and agreement with "
    f"FP32's answers >= {MIN_AGREEMENT}; elsewhere agreement with FP32 on the eval inputs "
    f"(top-1 for MTCNN, embedding cosine for MiniLM, decision F1 at 0.5 for Silero) >= "
    f"{MIN_AGREEMENT} and every other output's rel L2 to FP32 <= {MAX_REL_L2} (MTCNN's box "
    f"and landmark regressions, Silero's state); R-Net and O-Net are read over {HELD_ROWS} "
    "eval crops (top-1 and the regressions' rel L2), not the 8 latency crops. best accurate "
    "recipe = the fastest accurate one. chosen / best: where optimize's output is a recipe "
    "itself (the same graph in the same runtime with the same hint: FP32 in a runtime, or "
    "OpenVINO's bf16 hint on it), that recipe's ratio to the best, with its own session's "
    "ratio to the recipe's in brackets (two sessions of one deployment: this run's noise). "
    "wall s / peak RSS = the `mixprec optimize` process "
    "(interpreter start and imports included).")


#: the flags the page names (issue 36: "give its flags")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def bf16_note(results: Sequence[Row]) -> str:
    """What OpenVINO's bf16 hint computed here, read back from the compiled ov-bf16 models."""
    hints = {(r.get("compiled") or {}).get("precision_hint") for res in results
             for r in res["rows"] if r["variant"] == "ov-bf16" and r.get("status") == "ok"}
    if not hints:
        return "No ov-bf16 model compiled."
    if hints == {"f32"}:
        return ("**OpenVINO's bf16 hint computed f32 here** (it compiled every ov-bf16 model "
                "with precision f32: no bf16 on this CPU), so ov-bf16 measures f32 arithmetic.")
    return f"OpenVINO compiled ov-bf16 with precision hints {sorted(map(str, hints))}."


def part(results: list[Row]) -> Row:
    """Everything the part writes under ``"optimize"`` in the results JSON."""
    from bench.harness.common import cpu_flags, cpu_name

    flags = cpu_flags(FLAGS)
    return {"cpu": cpu_name(), "cpu_flags": flags, "bf16_note": bf16_note(results),
            "recipes": {k: {"runtime": v[0], "precision_hint": v[1], "model": v[2]}
                        for k, v in RECIPES.items()},
            "models": results, "goals": goals([r["summary"] for r in results])}


def held_note(results: Sequence[Row]) -> str:
    """Where optimize was given held-out samples (--held-out): how many, per model."""
    counts = {r["model"]: r["optimize"].get("held_out_samples") for r in results}
    if not any(counts.values()):
        return ""
    each = ", ".join(f"{m} {n}" if n else f"{m} none (its calibration samples are split)"
                     for m, n in counts.items())
    return (f"optimize was given held-out samples as --eval-data (a \"held\" split, apart from "
            f"calibration and evaluation; models.held_out_samples): {each}.")


def render(found: Row) -> str:
    results = found["models"]
    summaries = [r["summary"] for r in results]
    flags = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in found["cpu_flags"].items())
    return "\n".join([
        "## mixprec optimize against the obvious recipes", "",
        f"CPU: {found['cpu']}; flags: {flags}. {found['bf16_note']}", "", COLUMNS, "",
        held_note(results), "",
        summary_table(summaries), "", "### Issue 36's goals", "", goals_markdown(goals(summaries)),
        "", "### Every recipe", "", recipe_table(results), "",
        "### optimize's own table (its --json)", "", candidates_table(results), ""])
