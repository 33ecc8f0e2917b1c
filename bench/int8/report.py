"""Markdown tables and issue 26's goals for the INT8 rows (int8.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.harness.report import (
    latency_ratio,
    median_of,
    num,
    pct,
    target_row,
    targets_markdown,
)

Row = dict[str, Any]

MIXPREC_TOOLS = ("mixprec", "mixprec-minmax", "mixprec-minmax-bc", "mixprec-entropy",
                 "mixprec-percentile", "mixprec-dynamic")
ORT_U8S8 = "ort-u8s8"
SLOWER_MARGIN = 1.05  # interleaved medians on 2 shared cores move by a few percent

COLUMNS = ("Columns: valid = full onnx.checker passes and ORT CPU loads and runs it; "
           "latency = median INT8 / median FP32 ORT CPU latency, interleaved, 2 threads, "
           ">= 20 pairs, graph optimizations on in both sessions; int MACs = share of the FP32 "
           "model's Conv/ConvTranspose/MatMul/Gemm MACs that ORT runs in integer kernels "
           "(QLinearConv, QLinearMatMul, MatMulInteger, ConvInteger, QGemm, "
           "MatMulIntegerToFloat, DynamicQuantizeMatMul) in its optimized graph at "
           "ORT_ENABLE_EXTENDED, each kernel weighted by its MACs from the shapes seen in an "
           "ORT run; worst rel L2 = over all outputs vs FP32; agreement = lowest top-1 "
           "agreement over class-score outputs, or the lowest per-sentence cosine of the "
           "MiniLM sentence embedding, or for ppocr_rec and ppocr_cls the share of the 128 "
           "labelled lines answered exactly as FP32 answers them (decoded text; orientation), "
           "for ppocr_det the box hmean (F1) of rapidocr's text boxes against FP32's boxes "
           "(IoU >= 0.5, one to one) on its 8 labelled pages, then (px) the F1 of the map's "
           "pixels above 0.3 against FP32's on them; "
           "accuracy = MNIST held-out accuracy; ppocr_det: box hmean against the rendered "
           "lines' boxes on 8 English pages (bench/harness/det_boxes.py: rapidocr 1.4.4's "
           "post-processing, thresh 0.3, box_thresh 0.5, unclip 1.6, axis-aligned), then box "
           "precision/recall; ppocr_rec: character accuracy (1 - edit "
           "distance / length) on 128 English lines rendered in DejaVu fonts "
           "(bench/harness/ocr_text.py)"
           ", then the share of exact lines; ppocr_cls: orientation accuracy on 128 such lines, "
           "half turned 180 degrees; (pt) = drop from FP32 on the same lines; quant s = reading, "
           "calibrating, quantizing and writing (no interpreter start or imports); peak RSS "
           "= of the quantizer's whole process; size = file size / FP32 file.")


def _short_error(row: Row) -> str:
    text = row.get("error") or row.get("evaluation_error") or row.get("ort_error") or ""
    return text.replace("|", "/").replace("\n", " ")[:90]


def _chosen(row: Row) -> str:
    if row.get("unchanged"):
        return "input unchanged"
    speed = ((row.get("report") or {}).get("quantization") or {}).get("speed") or {}
    return str(speed.get("chosen", "")).replace("|", "/")


def judged_ratio(row: Row) -> float | None:
    """The latency ratio the goals read: 1 for a file byte-identical to its input (the
    same model runs at the same speed; its measured ratio is the timing noise)."""
    return 1.0 if row.get("unchanged") else latency_ratio(row)


#: The goals' view of a user who passes their task's metric: mixprec-metric's row where
#: the bench has a task metric for the model, mixprec's default row elsewhere.
WITH_METRIC = "mixprec (task metric where one exists)"


def with_task_metric(rows: Sequence[Row]) -> list[Row]:
    """The rows of :data:`WITH_METRIC`, added to ``rows``."""
    metric = {r["model"]: r for r in rows if r["tool"] == "mixprec-metric"}
    picked = [dict(metric.get(r["model"], r), tool=WITH_METRIC)
              for r in rows if r["tool"] == "mixprec"]
    return [*rows, *picked]


def model_table(rows: Sequence[Row], fp32_accuracy: dict[str, float | None]) -> str:
    lines = ["| model | tool | valid | check/ORT | latency | int MACs | worst rel L2 | agreement "
             "| accuracy | quant s | peak RSS MB | size | placement |",
             "|" + "---|" * 13]
    for r in rows:
        base = f"| {r['model']} | {r['tool']} "
        if r.get("status") != "ok":
            lines.append(base + f"| {r.get('status')} | {_short_error(r)} |" + " |" * 9)
            continue
        check = "✓" if r.get("checker_error") is None else "✗"
        runs = "✓" if r.get("ort_runs") else "✗"
        acc = "–"
        if r.get("accuracy") is not None:
            acc = f"{100 * r['accuracy']:.1f}%"
            ref = fp32_accuracy.get(r["model"])
            if ref is not None:
                acc += f" ({100 * (r['accuracy'] - ref):+.1f} pt)"
            found = r.get("labelled") or {}
            if found.get("line_accuracy") is not None:
                acc += f", lines {100 * found['line_accuracy']:.1f}%"
            if found.get("recall") is not None:
                acc += (f", P {100 * found['precision']:.1f}% "
                        f"R {100 * found['recall']:.1f}%")
        agreement = r.get("agreement")
        pixel_f1 = (r.get("labelled") or {}).get("pixel_f1")
        agree = "–" if agreement is None else (
            f"boxes {agreement:.3f} (px {pixel_f1:.3f})" if pixel_f1 is not None
            else f"cos {agreement:.4f}" if r.get("min_cosine") is not None
            else f"F1 {agreement:.3f}" if r.get("decision_f1") is not None else pct(agreement))
        lines.append(
            base + f"| {'yes' if r.get('valid') else 'NO'} | {check}/{runs} "
            f"| {_latency_text(r)} | {pct(r.get('integer_mac_share'))} "
            f"| {num(r.get('worst_rel_l2'), '.2e')} | {agree} | {acc} "
            f"| {num(r.get('convert_s'), '.2f')} | {num(r.get('peak_rss_mb'), '.0f')} "
            f"| {num(r.get('size_ratio'), '.2f')} | {_chosen(r) or '–'} |")
    return "\n".join(lines)


def _latency_text(row: Row) -> str:
    measured = num(latency_ratio(row), ".2f")
    return f"1 (same file; timed {measured})" if row.get("unchanged") else measured


def aggregate(rows: Sequence[Row]) -> list[dict[str, Any]]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r["tool"], []).append(r)
    out = []
    for tool, group in groups.items():
        ok = [r for r in group if r.get("status") == "ok"]
        out.append({
            "tool": tool,
            "models": len(group),
            "attempted": sum(r.get("status") != "unavailable" for r in group),
            "valid": sum(bool(r.get("valid")) for r in group),
            "median_latency_ratio": median_of(latency_ratio(r) for r in ok),
            "median_integer_mac_share": median_of(r.get("integer_mac_share") for r in ok),
            "median_worst_rel_l2": median_of(r.get("worst_rel_l2") for r in ok),
            "median_agreement": median_of(r.get("agreement") for r in ok),
            "median_convert_s": median_of(r.get("convert_s") for r in ok),
            "median_peak_rss_mb": median_of(r.get("peak_rss_mb") for r in ok),
        })
    return out


def aggregate_table(agg: Sequence[dict[str, Any]]) -> str:
    lines = ["| tool | valid | median latency | median int MACs | median worst rel L2 "
             "| median agreement | median quant s | median peak RSS MB |", "|" + "---|" * 8]
    for a in agg:
        lines.append(
            f"| {a['tool']} | {a['valid']}/{a['models']} "
            f"| {num(a['median_latency_ratio'], '.2f')} "
            f"| {pct(a['median_integer_mac_share'])} | {num(a['median_worst_rel_l2'], '.2e')} "
            f"| {num(a['median_agreement'], '.3f')} | {num(a['median_convert_s'], '.2f')} "
            f"| {num(a['median_peak_rss_mb'], '.0f')} |")
    return "\n".join(lines)


def _find(rows: Sequence[Row], model: str, tool: str) -> Row | None:
    return next((r for r in rows if r["model"] == model and r["tool"] == tool), None)


#: "Stays accurate": agreement-type measures (top-1, embedding cosine, decision F1 against
#: FP32) at least this; a labelled accuracy drops at most 1 pt (issue 26).
ACCURATE = 0.99
MAX_DROP = 0.01


def accurate(row: Row, fp32_accuracy: dict[str, float | None]) -> bool | None:
    """Whether a row keeps FP32's answers (None: nothing to judge it by)."""
    ref = fp32_accuracy.get(row["model"])
    if row.get("accuracy") is not None and ref is not None:
        return ref - row["accuracy"] <= MAX_DROP + 1e-9
    if row.get("agreement") is not None:
        return row["agreement"] >= ACCURATE
    return None


def evaluate_targets(rows: Sequence[Row], tool: str,
                     fp32_accuracy: dict[str, float | None]) -> list[dict[str, Any]]:
    """Issue 26's goals for one mixprec method, each met / missed with the offenders."""
    mine = [r for r in rows if r["tool"] == tool and r.get("status") != "unavailable"]
    timed = [r for r in mine if r.get("valid") and judged_ratio(r) is not None]
    med = median_of(judged_ratio(r) for r in timed)
    detail = "" if med is None else f"median {med:.2f}"
    targets = [target_row("median INT8/FP32 latency <= 0.8", [] if med is None or med <= 0.8
                       else [detail], len(timed), detail)]
    offenders = [f"{r['model']}: {judged_ratio(r):.2f}" for r in timed
                 if judged_ratio(r) > SLOWER_MARGIN]
    targets.append(target_row(f"no model slower than its input (ratio > {SLOWER_MARGIN}: a 5% "
                           "allowance for timing noise)", offenders, len(timed)))
    offenders, checked = [], 0
    for r in timed:
        peer = _find(rows, r["model"], ORT_U8S8)
        if peer is None or not peer.get("valid") or latency_ratio(peer) is None:
            continue
        if not accurate(peer, fp32_accuracy):
            continue
        checked += 1
        if judged_ratio(r) > latency_ratio(peer) * SLOWER_MARGIN:
            offenders.append(f"{r['model']}: {judged_ratio(r):.2f} vs ORT's "
                             f"{latency_ratio(peer):.2f}")
    targets.append(target_row("none slower than an accurate ORT U8S8 result by more than 5% "
                           f"(accurate: agreement/cosine/decision F1 >= {ACCURATE}, accuracy "
                           "drop <= 1 pt)", offenders, checked))
    judged = [(r, accurate(r, fp32_accuracy)) for r in mine if r.get("valid")]
    offenders = [f"{r['model']}: {_agreement_text(r, fp32_accuracy)}" for r, ok in judged
                 if ok is False]
    targets.append(target_row("every real-accuracy drop <= 1 pt (same measures)", offenders,
                           sum(ok is not None for _, ok in judged)))
    targets += _cost_targets(rows, mine)
    offenders = [f"{r['model']}: {r.get('status')} {_short_error(r)}".strip()
                 for r in mine if not r.get("valid")]
    targets.append(target_row("100% valid (full checker passes, ORT loads and runs)", offenders,
                           len(mine)))
    return targets


def _agreement_text(row: Row, fp32_accuracy: dict[str, float | None]) -> str:
    if row.get("accuracy") is not None:
        ref = fp32_accuracy.get(row["model"])
        drop = "" if ref is None else f" ({100 * (row['accuracy'] - ref):+.1f} pt)"
        return f"accuracy {100 * row['accuracy']:.1f}%{drop}"
    return f"agreement {row.get('agreement'):.4f}"


def _cost_targets(rows: Sequence[Row], mine: Sequence[Row]) -> list[dict[str, Any]]:
    """Quantize wall time <= 3x ORT U8S8's in the median and never > 8x; peak RSS <=
    1.5x ORT's on every model (where ORT produced a model)."""
    times, offenders_time, offenders_rss = [], [], []
    for r in mine:
        peer = _find(rows, r["model"], ORT_U8S8)
        if r.get("status") != "ok" or peer is None or peer.get("status") != "ok":
            continue
        ratio = r["convert_s"] / max(peer["convert_s"], 1e-9)
        times.append(ratio)
        if ratio > 8:
            offenders_time.append(f"{r['model']}: {ratio:.1f}x")
        rss = (r.get("peak_rss_mb") or 0) / max(peer.get("peak_rss_mb") or 1e-9, 1e-9)
        if rss > 1.5:
            offenders_rss.append(f"{r['model']}: {rss:.2f}x ({r['peak_rss_mb']:.0f} vs "
                                 f"{peer['peak_rss_mb']:.0f} MB)")
    med = median_of(times)
    detail = "" if med is None else f"median {med:.1f}x"
    if med is not None and med > 3:
        offenders_time.insert(0, detail)
    return [target_row("quantize wall time <= 3x ORT U8S8's in the median, never > 8x",
                    offenders_time, len(times), detail),
            target_row("peak RSS <= 1.5x ORT U8S8's on every model", offenders_rss, len(times))]


def labelled_text(fp32_labelled: dict[str, dict[str, Any] | None]) -> str:
    """FP32's own scores on the labelled sets, one sentence."""
    parts = []
    for model, found in fp32_labelled.items():
        if not found:
            continue
        text = f"{model} {100 * found['accuracy']:.1f}%"
        where = f"{found['lines']} lines"
        if found.get("line_accuracy") is not None:
            text = (f"{model} character accuracy {100 * found['accuracy']:.1f}%, exact lines "
                    f"{100 * found['line_accuracy']:.1f}%")
        if found.get("pages") is not None:
            text = (f"{model} box hmean {100 * found['accuracy']:.1f}% (precision "
                    f"{100 * found['precision']:.1f}%, recall {100 * found['recall']:.1f}%)")
            where = f"{found['lines']} lines on {found['pages']} pages"
        parts.append(f"{text} ({where})")
    return ("FP32 on the labelled lines: " + "; ".join(parts) + ".") if parts else ""


def guard_table(rows: Sequence[Row]) -> str:
    """What each mixprec row's accuracy guard measured: held-out samples and the rows its
    final checks were graded on, each check's value with its 95% lower bound (agreement
    checks) beside the budget, whether the rows confirm the pass, and what was kept."""
    head = ["| model | tool | held out | rows graded | check | value | 95% bound | budget "
            "| confirmed | kept float | result |", "|" + "---|" * 11]
    for row in rows:
        guard = (row.get("report") or {}).get("guard")
        if not guard:
            continue
        for check in guard.get("checks", []):
            bound = check.get("bound")
            side = "<=" if check.get("kind") == "rel-l2" else ">="
            head.append(
                f"| {row['model']} | {row['tool']} | {guard.get('eval_samples', '–')} "
                f"| {check.get('rows', '–')} | {check.get('kind')} '{check.get('output')}' "
                f"| {num(check.get('value'), '.4g')} | {num(bound, '.4g')} "
                f"| {side} {check.get('limit'):g} | {'yes' if guard.get('confirmed') else 'no'} "
                f"| {len(guard.get('kept_float', []))} | {_chosen(row) or '–'} |")
    return "\n".join(head) if len(head) > 2 else ""


def render(rows: Sequence[Row], agg: Sequence[dict[str, Any]],
           targets: dict[str, list[dict[str, Any]]], fp32_accuracy: dict[str, float | None],
           samples: dict[str, int],
           fp32_labelled: dict[str, dict[str, Any] | None] | None = None) -> str:
    calib = ", ".join(f"{m} {n}" for m, n in samples.items())
    lines = ["## INT8", "",
             "Every tool quantizes from the same calibration samples (one .npz per sample, "
             f"disjoint from the eval inputs; samples per model: {calib}) and is measured on the "
             "same eval inputs as the FP16/BF16 rows. mixprec runs with its defaults "
             "(mode auto, activations auto, per-channel, speed auto; -bc: bias correction on, "
             "-dynamic: mode dynamic); placement = the placement mixprec's "
             "speed=auto kept.", "", COLUMNS, ""]
    labelled = labelled_text(fp32_labelled or {})
    if labelled:
        lines += [labelled, ""]
    lines += [model_table(rows, fp32_accuracy), ""]
    guards = guard_table(rows)
    if guards:
        lines += ["### The accuracy guard", "", "What mixprec's guard measured (issue 35): the "
                  "held-out samples, the rows its final checks were graded on, and for "
                  "agreement checks the 95% Wilson lower bound beside the budget; 'confirmed' "
                  "= the rows support the pass (a result that is the input unchanged needs "
                  "none).", "", guards, ""]
    lines += ["### Per tool", "", aggregate_table(agg), ""]
    for tool, found in targets.items():
        lines += [f"### Issue 26 goals for {tool}", "", targets_markdown(found), ""]
    return "\n".join(lines)
