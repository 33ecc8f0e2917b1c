"""The bf16 part of the bench: OpenVINO's blanket bf16 against mixprec's bf16, on the CPU.

Per model, four sessions run the same eval feeds (models.py) and are timed in one
interleaved loop (2 threads each; ORT as the rest of the bench, OpenVINO with
INFERENCE_NUM_THREADS 2 and PERFORMANCE_HINT LATENCY):

  ort-fp32      the FP32 model in ONNX Runtime: the reference for latency and accuracy
  ov-fp32       the FP32 model in OpenVINO, INFERENCE_PRECISION_HINT f32
  ov-bf16       the FP32 model in OpenVINO, INFERENCE_PRECISION_HINT bf16 (OpenVINO's own
                blanket bf16)
  mixprec-bf16  `mixprec convert --dtype bf16` (convert_one.py, as the FP16/BF16 rows) run
                in OpenVINO with INFERENCE_PRECISION_HINT f32, so that OpenVINO keeps
                mixprec's per-node bf16/f32 types instead of choosing its own
  mixprec-marks the FP32 model with the nodes mixprec's bf16 lists keep FP32 marked in an
                OpenVINO IR, run with INFERENCE_PRECISION_HINT bf16 (what `mixprec
                optimize`'s bf16-lists-openvino candidate writes): mixprec's lists, OpenVINO's
                fusions

Models with a labelled eval set (PP-OCR rec and cls: 128 lines) are also read on it, as
their users read them: the lines each variant answers exactly as FP32 does (decoded text;
orientation). One eval sample of 40 timesteps cannot tell two bf16 forms apart: a single
timestep that flips moves its softmax row, and the rel L2 with it, by 0.1-0.3.

What OpenVINO really compiled is read back from each compiled model: the precision hint
it applied (a CPU without bf16 keeps f32 silently) and the runtime precision of every
Convolution/FullyConnected/MatMul layer in its runtime graph.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import cpu_flags as common_cpu_flags
from bench.harness.evaluate import (
    LATENCY_SECONDS,
    MAX_LATENCY_PAIRS,
    MIN_LATENCY_PAIRS,
    MIN_SAMPLE_SECONDS,
    THREADS,
    Baseline,
    compare,
    first_line,
    labelled_scores,
    run,
    session,
)
from bench.harness.models import Feeds, ModelSpec
from bench.harness.report import median_of, num, pct
from bench.int8.suite import min_sample_cosine
from mixprec.core.metrics import rel_l2_error, worst_rel_l2
from mixprec.runtime.ov_marks import runtime_layers

Row = dict[str, Any]
Converter = Callable[[], tuple[Row, Path]]

REFERENCE = "ort-fp32"
BLANKET = "ov-bf16"
MIXPREC = "mixprec-bf16"
MARKS = "mixprec-marks"
#: variant -> (runtime, OpenVINO INFERENCE_PRECISION_HINT, which model)
VARIANTS: dict[str, tuple[str, str | None, str]] = {
    REFERENCE: ("onnxruntime", None, "fp32"),
    "ov-fp32": ("openvino", "f32", "fp32"),
    BLANKET: ("openvino", "bf16", "fp32"),
    MIXPREC: ("openvino", "f32", "mixprec"),
    MARKS: ("openvino", "bf16", "marks"),
}
#: mixprec's forms, each held to the blanket
MIXPREC_FORMS = (MIXPREC, MARKS)
OV_CONFIG = {"INFERENCE_NUM_THREADS": str(THREADS), "PERFORMANCE_HINT": "LATENCY"}
CPU_FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx2")


def cpu_flags() -> dict[str, bool]:
    """Which of CPU_FLAGS (the BF16 part's) /proc/cpuinfo lists."""
    return common_cpu_flags(CPU_FLAGS)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: OpenVINO CPU runtime layer types that do the multiply-accumulates
MAC_LAYERS = frozenset({"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected",
                        "MatMul", "Gemm"})
#: a mixprec form is "ok" against the blanket when on every output
#: worst rel L2 (mixprec) <= VERSUS_FACTOR x worst rel L2 (blanket) + VERSUS_SLACK;
#: on a labelled set instead: lines answered unlike FP32 (mixprec) <= VERSUS_FACTOR x the
#: blanket's + one line
VERSUS_FACTOR = 1.25
VERSUS_SLACK = 1e-3


@functools.cache
def _core() -> Any:
    import openvino as ov

    return ov.Core()


def openvino_info() -> dict[str, Any]:
    """OpenVINO's version and the CPU plugin's OPTIMIZATION_CAPABILITIES, or the error."""
    try:
        import openvino as ov

        capabilities = [str(c) for c in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]
    except Exception as exc:  # no OpenVINO: its rows say so
        return {"version": None, "error": first_line(exc), "capabilities": [], "bf16": False}
    return {"version": ov.__version__.split("-")[0], "error": None, "capabilities": capabilities,
            "bf16": "BF16" in capabilities}


@dataclass
class Runner:
    """One loaded model: ``infer`` returns its outputs; ``bind`` fixes the feeds and returns
    a call that only runs it (for timing); ``compiled``: what OpenVINO compiled."""

    infer: Callable[[Feeds], dict[str, np.ndarray]]
    bind: Callable[[Feeds], Callable[[], object]]
    compiled: dict[str, Any] = field(default_factory=dict)


def ort_runner(path: Path) -> Runner:
    sess = session(str(path))
    wanted = {i.name for i in sess.get_inputs()}

    def bind(feeds: Feeds) -> Callable[[], object]:
        fixed = {k: v for k, v in feeds.items() if k in wanted}
        return lambda: sess.run(None, fixed)

    return Runner(lambda feeds: run(sess, feeds), bind)


def runtime_precision(compiled: Any) -> dict[str, Any]:
    """The precision hint OpenVINO applied and the runtime precision of its MAC layers."""
    layers: dict[str, int] = {}
    macs = bf16_macs = 0
    for layer in runtime_layers(compiled):
        if layer.type in ("Const", "Input", "Output"):
            continue
        layers[layer.precision] = layers.get(layer.precision, 0) + 1
        if layer.type in MAC_LAYERS:
            macs += 1
            bf16_macs += layer.precision == "bf16"
    return {"precision_hint": compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name(),
            "mac_layers": macs, "bf16_mac_layers": bf16_macs, "layers_by_precision": layers}


def ov_runner(path: Path, hint: str, extra: Mapping[str, str] | None = None) -> Runner:
    """OpenVINO compiles the model for the input shapes it runs with (``reshape``, as its
    docs advise for the CPU plugin), once per set of shapes; every OpenVINO variant alike.
    With dynamic shapes it fuses less: mixprec's bf16 PP-OCR cls then ran 2x slower and
    less accurately than with the shapes fixed (mixprec's own runtime seam fixes them too).
    """
    model = _core().read_model(str(path))
    config = {**OV_CONFIG, "INFERENCE_PRECISION_HINT": hint, **(extra or {})}
    wanted = {name for port in model.inputs for name in port.get_names()}
    compiled_for: dict[tuple[Any, ...], tuple[Any, Any]] = {}
    info: dict[str, Any] = {}  # the first compiled model's precisions (filled on compile)

    def get(feeds: Feeds) -> tuple[Any, Any]:
        shapes = {k: tuple(np.shape(v)) for k, v in feeds.items() if k in wanted}
        key = tuple(sorted(shapes.items()))
        if key not in compiled_for:
            static = model.clone()
            try:
                static.reshape({k: list(v) for k, v in shapes.items()})
            except Exception:  # shape-dependent graphs compile as they are
                static = model
            compiled = _core().compile_model(static, "CPU", config)
            compiled_for[key] = (compiled, compiled.create_infer_request())
            if not info:
                info.update(runtime_precision(compiled))
        return compiled_for[key]

    def infer(feeds: Feeds) -> dict[str, np.ndarray]:
        compiled, request = get(feeds)
        result = request.infer({k: v for k, v in feeds.items() if k in wanted})
        return {name: np.array(result[port])
                for port in compiled.outputs for name in port.get_names()}

    def bind(feeds: Feeds) -> Callable[[], object]:
        _, request = get(feeds)
        # np.asarray keeps a 0-d input 0-d (ascontiguousarray made Silero's sr 1-d)
        fixed = {k: np.asarray(v, order="C") for k, v in feeds.items() if k in wanted}
        return lambda: request.infer(fixed, share_inputs=True)

    return Runner(infer, bind, info)


def error_text(exc: BaseException, limit: int = 500) -> str:
    """The informative part of an exception: OpenVINO's messages start with lines of source
    locations, and end with the summary of the ONNX ops its frontend could not convert."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()
             and not line.startswith(("Exception from src/", "Check '"))]
    summary = [line for line in lines if "failed for:" in line]
    text = " ".join(summary + [line for line in lines if line not in summary])
    return f"{type(exc).__name__}: {text}"[:limit]


def _batch(feeds: Feeds) -> int | None:
    """Leading dimension of the first input of rank >= 2 (the samples of the eval set)."""
    for value in feeds.values():
        if value.ndim >= 2:
            return int(value.shape[0])
    return None


def worst_sample_rel_l2(ref: np.ndarray, got: np.ndarray, batch: int | None) -> float:
    """max over samples of ||got - ref|| / ||ref|| (mixprec's own relative L2 and its
    worst sample); the whole tensor when the output has no leading axis of ``batch``
    samples."""
    if batch is None or batch < 2 or np.ndim(ref) == 0 or np.shape(ref)[0] != batch:
        return rel_l2_error(ref, got)
    return worst_rel_l2(list(ref), list(got))


def score(base: Baseline, outputs: Mapping[str, np.ndarray]) -> Row:
    """Accuracy of ``outputs`` against the ORT FP32 outputs on the eval feeds."""
    result = compare(base, outputs)
    batch = _batch(base.feeds)
    for name, entry in result["outputs"].items():
        ref, got = base.outputs[name], outputs.get(name)
        if got is None or got.shape != ref.shape:
            entry["worst_sample_rel_l2"] = float("inf")
            continue
        entry["worst_sample_rel_l2"] = worst_sample_rel_l2(ref, got, batch)
        if name in base.spec.embedding_outputs:
            entry["cosine"] = min_sample_cosine(ref, got)
    result["worst_sample_rel_l2"] = max(
        e["worst_sample_rel_l2"] for e in result["outputs"].values())
    cosines = [e["cosine"] for e in result["outputs"].values() if "cosine" in e]
    result["min_cosine"] = min(cosines) if cosines else None
    return result


def versus_blanket(mixprec: Row, blanket: Row) -> bool | None:
    """On a labelled set: mixprec's lines answered unlike FP32 <= 1.25 x the blanket's + 1;
    else its worst-sample rel L2 <= 1.25 x the blanket's + 1e-3 on every output."""
    mine, theirs = mixprec.get("labelled"), blanket.get("labelled")
    if mine and theirs:
        lines = mine["lines"]
        unlike, blanket_unlike = ((1 - x["agreement"]) * lines for x in (mine, theirs))
        return bool(unlike <= VERSUS_FACTOR * blanket_unlike + 1)
    mine, theirs = mixprec.get("outputs"), blanket.get("outputs")
    if not mine or not theirs:
        return None
    return all(
        entry["worst_sample_rel_l2"]
        <= VERSUS_FACTOR * theirs[name]["worst_sample_rel_l2"] + VERSUS_SLACK
        for name, entry in mine.items() if name in theirs)


def interleaved(calls: Mapping[str, Callable[[], object]], reference: str,
                shuffle: bool = False) -> dict[str, Any]:
    """Median latency of every session, timed round by round after warm-up; each round
    runs every session once, starting one further along each time (``shuffle``: in a
    seeded random order, so that no session always follows the same one: an OpenVINO
    session that always runs right after ONNX Runtime measured 4-8% slower than the same
    model compiled alike further along). A sample of a sub-5 ms reference repeats the run
    (the same count for every session)."""
    for _ in range(3):
        for call in calls.values():
            call()
    t0 = time.perf_counter()
    calls[reference]()
    repeat = max(1, math.ceil(MIN_SAMPLE_SECONDS / max(time.perf_counter() - t0, 1e-6)))

    def sample(call: Callable[[], object]) -> float:
        begin = time.perf_counter()
        for _ in range(repeat):
            call()
        return (time.perf_counter() - begin) / repeat

    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    budget = LATENCY_SECONDS * len(names) / 2  # as much time per session as a pair gets
    started = time.perf_counter()
    rounds = 0
    shuffler = random.Random(0)
    while rounds < MAX_LATENCY_PAIRS:
        order = [names[(rounds + i) % len(names)] for i in range(len(names))]
        if shuffle:
            shuffler.shuffle(order)
        for name in order:
            times[name].append(sample(calls[name]))
        rounds += 1
        if rounds >= MIN_LATENCY_PAIRS and time.perf_counter() - started > budget:
            break
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"ms": medians, "rounds": rounds, "runs_per_sample": repeat}


def _load(variant: str, fp32: Path, forms: Mapping[str, Path | None]) -> Runner:
    runtime, hint, which = VARIANTS[variant]
    path = fp32 if which == "fp32" else forms.get(which)
    if path is None:
        raise RuntimeError(f"no mixprec {which} model")
    return ort_runner(path) if runtime == "onnxruntime" else ov_runner(path, hint or "f32")


def _conversion(convert: Converter) -> tuple[Row, Path | None]:
    """mixprec's bf16 conversion, reduced to what the bf16 rows report."""
    row, out = convert()
    keep = ("status", "error", "convert_s", "wall_s", "peak_rss_mb", "argv")
    return {k: row.get(k) for k in keep if k in row}, out if row.get("status") == "ok" else None


def _marked(spec: ModelSpec, base: Baseline, work: Path | None) -> tuple[Row, Path | None]:
    """mixprec's bf16 lists as OpenVINO marks (``mixprec.pipeline.marks.bf16_marked`` on
    the calibration feeds, written by ``save_marked``): the IR's path, and how it went."""
    import onnx

    from mixprec.io.runtime_fields import fp32_nodes
    from mixprec.optimize.metadata import save_marked
    from mixprec.pipeline.marks import bf16_marked

    if work is None:
        return {"status": "skipped", "error": "no work dir"}, None
    t0 = time.perf_counter()
    try:
        proto, report = bf16_marked(onnx.load(str(base.path)), [spec.make_inputs("calib")])
        xml = save_marked(proto, work / f"{spec.name}__mixprec-marks__bf16.onnx")
    except Exception as exc:  # a model the marks cannot be written for is a result
        return {"status": "error", "error": error_text(exc)}, None
    return {"status": "ok", "convert_s": time.perf_counter() - t0,
            "kept_fp32": len(fp32_nodes(proto) or []), "nodes": len(report.nodes)}, xml


class _AsSession:
    """A runner as the labelled sets call a session: ``run(names, feeds)``."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    def run(self, names: Sequence[str], feeds: Feeds) -> list[np.ndarray]:
        outputs = self.runner.infer(feeds)
        return [outputs[name] for name in names]


def _measure(spec: ModelSpec, variant: str, base: Baseline, made: Mapping[str, Row],
             forms: Mapping[str, Path | None]) -> tuple[Row, Runner | None]:
    """One variant's row (accuracy on the eval feeds, and on the labelled set where the
    model has one) and its loaded runner, if any."""
    runtime, hint, which = VARIANTS[variant]
    row: Row = {"model": spec.name, "variant": variant, "runtime": runtime,
                "precision_hint": hint}
    if which in made:
        row["conversion"] = made[which]
        if forms.get(which) is None:
            row.update(status=made[which].get("status") or "error", error=made[which].get("error"))
            return row, None
    try:
        runner = _load(variant, base.path, forms)
        row.update(status="ok", compiled=runner.compiled)
        row.update(score(base, runner.infer(base.feeds)))
        if spec.labelled is not None:
            row["labelled"] = labelled_scores(base, _AsSession(runner))  # type: ignore[arg-type]
    except Exception as exc:  # a model a runtime cannot load or run is a result
        row.update(status="error", error=error_text(exc))
        return row, None
    return row, runner


def run_model(spec: ModelSpec, base: Baseline, convert: Converter,
              measure_latency: bool = True, work: Path | None = None) -> list[Row]:
    """The rows of one model (VARIANTS), latency measured in one interleaved loop;
    ``work``: where mixprec's marked IR is written."""
    t0 = time.perf_counter()
    conversion, converted = _conversion(convert)
    marks, marked = _marked(spec, base, work)
    made = {"mixprec": conversion, "marks": marks}
    forms = {"mixprec": converted, "marks": marked}
    rows: dict[str, Row] = {}
    runners: dict[str, Runner] = {}
    for variant in VARIANTS:
        rows[variant], runner = _measure(spec, variant, base, made, forms)
        if runner is not None:
            runners[variant] = runner
    for form in MIXPREC_FORMS:
        if BLANKET in runners and form in runners:
            rows[form]["versus_blanket"] = versus_blanket(rows[form], rows[BLANKET])
    if measure_latency and REFERENCE in runners:
        _add_latency(rows, runners, base)
    for row in rows.values():
        latency = (row.get("latency") or {}).get("ratio")
        summary = row.get("error") or (f"relL2={num(row.get('worst_sample_rel_l2'), '.2e')} "
                                       f"latency={num(latency, '.2f')}")
        print(f"bench: {spec.name:11s} {row['variant']:21s} bf16 {row['status']:11s} "
              f"{time.perf_counter() - t0:6.1f}s  {str(summary)[:110]}", flush=True)
    return list(rows.values())


def _add_latency(rows: dict[str, Row], runners: Mapping[str, Runner], base: Baseline) -> None:
    try:
        timing = interleaved({k: r.bind(base.latency_feeds) for k, r in runners.items()},
                             REFERENCE)
    except Exception as exc:
        for variant in runners:
            rows[variant]["latency_error"] = first_line(exc)
        return
    reference = timing["ms"][REFERENCE]
    for variant, ms in timing["ms"].items():
        rows[variant]["latency"] = {"ms": ms, "ratio": ms / reference,
                                    "rounds": timing["rounds"],
                                    "runs_per_sample": timing["runs_per_sample"]}


def aggregate(rows: Sequence[Row]) -> list[Row]:
    """Per variant: rows that ran, median latency ratio, median worst-sample rel L2, and
    for mixprec-bf16 on how many models it is ok against the blanket."""
    out = []
    for variant in VARIANTS:
        group = [r for r in rows if r["variant"] == variant]
        ok = [r for r in group if r["status"] == "ok"]
        verdicts = [r.get("versus_blanket") for r in ok if r.get("versus_blanket") is not None]
        out.append({
            "variant": variant, "models": len(group), "ran": len(ok),
            "median_latency_ratio": median_of((r.get("latency") or {}).get("ratio") for r in ok),
            "median_worst_rel_l2": median_of(r.get("worst_sample_rel_l2") for r in ok),
            "versus_blanket_ok": (sum(bool(v) for v in verdicts) if variant in MIXPREC_FORMS
                                  else None),
            "versus_blanket_checked": len(verdicts) if variant in MIXPREC_FORMS else None,
        })
    return out


def part(rows: list[Row], flags: dict[str, bool], openvino: dict[str, Any]) -> Row:
    """Everything the bf16 part writes under ``"bf16"`` in the results JSON."""
    result: Row = {
        "cpu_flags": flags, "openvino": openvino, "config": OV_CONFIG,
        "variants": {k: {"runtime": v[0], "precision_hint": v[1], "model": v[2]}
                     for k, v in VARIANTS.items()},
        "versus_blanket_rule": f"labelled lines unlike FP32 <= {VERSUS_FACTOR} x blanket's "
                               f"+ 1, else worst-sample rel L2 <= {VERSUS_FACTOR} x blanket "
                               f"+ {VERSUS_SLACK:g} on every output",
        "rows": rows, "aggregate": aggregate(rows)}
    result["computed_in_f32"] = computed_in_f32(result)
    return result


def computed_in_f32(bf16_part: Row) -> bool:
    """True when OpenVINO ran no bf16 here: the CPU plugin does not list BF16, or it
    compiled every ov-bf16 model with precision hint f32 (what it does without bf16)."""
    if bf16_part["openvino"].get("error"):
        return False  # OpenVINO computed nothing
    if not bf16_part["openvino"].get("bf16"):
        return True
    hints = [(r.get("compiled") or {}).get("precision_hint") for r in bf16_part["rows"]
             if r["variant"] == BLANKET and r["status"] == "ok"]
    return bool(hints) and "bf16" not in hints


def precision_note(flags: Mapping[str, bool], openvino: Mapping[str, Any],
                   in_f32: bool = False) -> str:
    """What OpenVINO's bf16 means on this CPU, for the section header."""
    have = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in flags.items())
    if openvino.get("error"):
        return f"OpenVINO not usable ({openvino['error']}); CPU flags: {have}."
    capabilities = "/".join(openvino["capabilities"])
    if in_f32 or not openvino["bf16"]:
        return (f"**OpenVINO computed in f32**: no bf16 on this CPU (CPU flags: {have}; "
                f"OpenVINO {openvino['version']} OPTIMIZATION_CAPABILITIES {capabilities}), so "
                "the ov-bf16 and mixprec-bf16 rows measure f32 arithmetic (see OV compiled).")
    native = any(flags.get(f) for f in NATIVE_BF16_FLAGS)
    how = ("native bf16 instructions" if native else
           "no native bf16 instructions (OpenVINO emulates bf16 on AVX-512: slow)")
    return (f"OpenVINO {openvino['version']} lists BF16 in OPTIMIZATION_CAPABILITIES "
            f"({capabilities}); CPU flags: {have}: {how}.")


def _ov_precision(row: Row) -> str:
    compiled = row.get("compiled") or {}
    if not compiled:
        return "–"
    return (f"{compiled['precision_hint']}, {compiled['bf16_mac_layers']}/"
            f"{compiled['mac_layers']} bf16")


def _versus(row: Row) -> str:
    if row["variant"] not in MIXPREC_FORMS:
        return ""
    verdict = row.get("versus_blanket")
    return "–" if verdict is None else ("ok" if verdict else "WORSE")


def _accuracy(row: Row, fp32_accuracy: float | None) -> str:
    if row.get("accuracy") is None:
        return "–"
    text = f"{100 * row['accuracy']:.1f}%"
    if fp32_accuracy is not None:
        text += f" ({100 * (row['accuracy'] - fp32_accuracy):+.1f} pt)"
    return text


def _labelled(row: Row) -> str:
    found = row.get("labelled")
    if not found:
        return "–"
    unlike = round((1 - found["agreement"]) * found["lines"])
    return f"{100 * found['agreement']:.1f}% ({unlike}/{found['lines']} unlike)"


def model_table(rows: Sequence[Row], fp32_accuracy: Mapping[str, float | None]) -> str:
    lines = ["| model | variant | latency | ms | worst rel L2 | top-1 | cosine | accuracy "
             "| labelled lines as FP32 | OV compiled | mixprec vs blanket |", "|" + "---|" * 11]
    for r in rows:
        base = f"| {r['model']} | {r['variant']} "
        if r["status"] != "ok":
            text = str(r.get("error")).replace("|", "/").replace("\n", " ")[:90]
            lines.append(base + f"| {r['status']}: {text} |" + " |" * 7 + f" {_versus(r)} |")
            continue
        latency = r.get("latency") or {}
        lines.append(
            base + f"| {num(latency.get('ratio'), '.2f')} | {num(latency.get('ms'), '.2f')} "
            f"| {num(r.get('worst_sample_rel_l2'), '.2e')} | {pct(r.get('top1_agreement'))} "
            f"| {num(r.get('min_cosine'), '.4f')} "
            f"| {_accuracy(r, fp32_accuracy.get(r['model']))} | {_labelled(r)} "
            f"| {_ov_precision(r)} | {_versus(r)} |")
    return "\n".join(lines)


def aggregate_table(agg: Sequence[Row]) -> str:
    lines = ["| variant | ran | median latency | median worst rel L2 | mixprec vs blanket |",
             "|---|---|---|---|---|"]
    for a in agg:
        versus = ("" if a["versus_blanket_ok"] is None
                  else f"ok on {a['versus_blanket_ok']}/{a['versus_blanket_checked']}")
        lines.append(f"| {a['variant']} | {a['ran']}/{a['models']} "
                     f"| {num(a['median_latency_ratio'], '.2f')} "
                     f"| {num(a['median_worst_rel_l2'], '.2e')} | {versus} |")
    return "\n".join(lines)


COLUMNS = ("Variants: ort-fp32 = the FP32 model in ONNX Runtime (the reference); ov-fp32 = "
           "the FP32 model in OpenVINO, INFERENCE_PRECISION_HINT f32; ov-bf16 = the FP32 "
           "model in OpenVINO, INFERENCE_PRECISION_HINT bf16 (OpenVINO's blanket bf16); "
           "mixprec-bf16 = `mixprec convert --dtype bf16 --inputs calib.npz` (as the BF16 "
           "rows) in OpenVINO, INFERENCE_PRECISION_HINT f32, so mixprec's per-node types "
           "decide; mixprec-marks = the FP32 model, the nodes mixprec's bf16 lists keep FP32 "
           "marked in an OpenVINO IR, INFERENCE_PRECISION_HINT bf16 (what optimize's "
           "bf16-lists-openvino writes). OpenVINO: INFERENCE_NUM_THREADS 2, PERFORMANCE_HINT "
           "LATENCY; ORT: 2 "
           "intra-op threads, spinning within a run, stopped after it. Columns: "
           "latency = median / median of ort-fp32, "
           "all sessions timed in one interleaved loop (round by round, >= 20 rounds "
           "after warm-up); ms = that median; worst rel L2 = max over outputs and eval "
           "samples of ||y - ref|| / ||ref||, ref = ort-fp32 outputs; top-1 = lowest arg-max "
           "agreement over class-score outputs; cosine = lowest per-row cosine of embedding "
           "outputs (MiniLM); accuracy = MNIST held-out accuracy (drop from FP32); labelled "
           "lines as FP32 = PP-OCR rec/cls on their 128 labelled lines: the share decoded "
           "(text; orientation) exactly as FP32 decodes it; OV "
           "compiled = the precision hint OpenVINO applied, and its Convolution/"
           "FullyConnected/MatMul runtime layers that run in bf16; mixprec vs blanket = ok "
           f"when a mixprec form's labelled lines unlike FP32 <= {VERSUS_FACTOR} x ov-bf16's "
           f"+ 1 (rec, cls), else its worst rel L2 <= {VERSUS_FACTOR} x ov-bf16's + "
           f"{VERSUS_SLACK:g} on every output.")


def render(bf16_part: Row, fp32_accuracy: Mapping[str, float | None]) -> str:
    in_f32 = computed_in_f32(bf16_part)
    title = "## BF16 (OpenVINO CPU)"
    if bf16_part["openvino"].get("error"):
        title = "## BF16 (OpenVINO CPU; OpenVINO not usable)"
    elif in_f32:
        title = "## BF16 (OpenVINO CPU; OpenVINO computed in f32: no bf16 on this CPU)"
    return "\n".join([
        title, "", precision_note(bf16_part["cpu_flags"], bf16_part["openvino"], in_f32), "",
        COLUMNS, "",
        model_table(bf16_part["rows"], fp32_accuracy), "",
        aggregate_table(bf16_part["aggregate"]), "",
    ])
