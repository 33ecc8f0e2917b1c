"""Markdown tables and the issue-8 targets for the INT8 rows (int8.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from report import _median, _num, _pct, _target, latency_ratio, targets_markdown

Row = dict[str, Any]

MIXPREC_TOOLS = ("mixprec", "mixprec-minmax", "mixprec-minmax-bc", "mixprec-entropy",
                 "mixprec-percentile", "mixprec-dynamic")
ORT_DEFAULT = "ort-s8s8"  # quantize_static's documented default (QDQ, S8S8, MinMax)
ORT_U8S8 = "ort-u8s8"
OCR_CLASSIFIERS = ("ppocr_rec", "ppocr_cls")
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
           "MiniLM sentence embedding; accuracy = MNIST held-out accuracy; quant s = reading, "
           "calibrating, quantizing and writing (no interpreter start or imports); peak RSS "
           "= of the quantizer's whole process; size = file size / FP32 file.")


def _short_error(row: Row) -> str:
    text = row.get("error") or row.get("evaluation_error") or row.get("ort_error") or ""
    return text.replace("|", "/").replace("\n", " ")[:90]


def _chosen(row: Row) -> str:
    speed = ((row.get("report") or {}).get("quantization") or {}).get("speed") or {}
    return str(speed.get("chosen", "")).replace("|", "/")


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
        agreement = r.get("agreement")
        agree = "–" if agreement is None else (
            f"cos {agreement:.4f}" if r.get("min_cosine") is not None else _pct(agreement))
        lines.append(
            base + f"| {'yes' if r.get('valid') else 'NO'} | {check}/{runs} "
            f"| {_num(latency_ratio(r), '.2f')} | {_pct(r.get('integer_mac_share'))} "
            f"| {_num(r.get('worst_rel_l2'), '.2e')} | {agree} | {acc} "
            f"| {_num(r.get('convert_s'), '.2f')} | {_num(r.get('peak_rss_mb'), '.0f')} "
            f"| {_num(r.get('size_ratio'), '.2f')} | {_chosen(r) or '–'} |")
    return "\n".join(lines)


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
            "median_latency_ratio": _median(latency_ratio(r) for r in ok),
            "median_integer_mac_share": _median(r.get("integer_mac_share") for r in ok),
            "median_worst_rel_l2": _median(r.get("worst_rel_l2") for r in ok),
            "median_agreement": _median(r.get("agreement") for r in ok),
            "median_convert_s": _median(r.get("convert_s") for r in ok),
            "median_peak_rss_mb": _median(r.get("peak_rss_mb") for r in ok),
        })
    return out


def aggregate_table(agg: Sequence[dict[str, Any]]) -> str:
    lines = ["| tool | valid | median latency | median int MACs | median worst rel L2 "
             "| median agreement | median quant s | median peak RSS MB |", "|" + "---|" * 8]
    for a in agg:
        lines.append(
            f"| {a['tool']} | {a['valid']}/{a['models']} "
            f"| {_num(a['median_latency_ratio'], '.2f')} "
            f"| {_pct(a['median_integer_mac_share'])} | {_num(a['median_worst_rel_l2'], '.2e')} "
            f"| {_num(a['median_agreement'], '.3f')} | {_num(a['median_convert_s'], '.2f')} "
            f"| {_num(a['median_peak_rss_mb'], '.0f')} |")
    return "\n".join(lines)


def _find(rows: Sequence[Row], model: str, tool: str) -> Row | None:
    return next((r for r in rows if r["model"] == model and r["tool"] == tool), None)


def evaluate_targets(rows: Sequence[Row], tool: str,
                     fp32_accuracy: dict[str, float | None]) -> list[dict[str, Any]]:
    """Issue 8's targets for one mixprec method, each met / missed with the offenders."""
    mine = [r for r in rows if r["tool"] == tool and r.get("status") != "unavailable"]
    timed = [r for r in mine if r.get("valid") and latency_ratio(r) is not None]
    targets = []

    med = _median(latency_ratio(r) for r in timed)
    offenders = [] if med is None or med <= 0.6 else [f"median {med:.2f}"]
    targets.append(_target("median INT8/FP32 latency <= 0.6", offenders, len(timed),
                           "" if med is None else f"median {med:.2f}"))

    offenders = [f"{r['model']}: {latency_ratio(r):.2f}" for r in timed
                 if latency_ratio(r) > SLOWER_MARGIN]
    targets.append(_target(f"no model slower than FP32 (latency ratio > {SLOWER_MARGIN} counts "
                           "as slower: a 5% allowance for timing noise)", offenders, len(timed)))

    relative = []
    for r in timed:
        peer = _find(rows, r["model"], ORT_U8S8)
        if peer is not None and peer.get("valid") and latency_ratio(peer):
            relative.append(latency_ratio(r) / latency_ratio(peer))
    med = _median(relative)
    offenders = [] if med is None or med <= 0.8 else [f"median {med:.2f}"]
    targets.append(_target("median latency <= 0.8 x ORT U8S8's (per model: INT8/FP32 ratio over "
                           "ORT U8S8's INT8/FP32 ratio, same run)", offenders, len(relative),
                           "" if med is None else f"median {med:.2f}"))

    shares = [r.get("integer_mac_share") for r in mine if r.get("valid")]
    med = _median(shares)
    offenders = [] if med is None or med >= 0.9 else [f"median {100 * med:.0f}%"]
    targets.append(_target("median integer-kernel MAC share >= 90%", offenders,
                           sum(s is not None for s in shares),
                           "" if med is None else f"median {100 * med:.0f}%"))

    offenders, checked = [], 0
    for r in mine:
        ref = fp32_accuracy.get(r["model"])
        if r.get("accuracy") is None or ref is None:
            continue
        checked += 1
        if ref - r["accuracy"] > 0.003 + 1e-9:
            offenders.append(f"{r['model']}: {100 * r['accuracy']:.1f}% vs FP32 {100 * ref:.1f}%")
    targets.append(_target("MNIST accuracy drop <= 0.3 pt", offenders, checked))

    offenders, checked = [], 0
    for r in mine:
        if r["model"] in OCR_CLASSIFIERS and r.get("top1_agreement") is not None:
            checked += 1
            if r["top1_agreement"] < 0.99:
                offenders.append(f"{r['model']}: {100 * r['top1_agreement']:.1f}%")
    targets.append(_target("OCR rec/cls top-1 agreement >= 99%", offenders, checked))

    offenders, checked = [], 0
    for r in mine:
        if r.get("min_cosine") is not None:
            checked += 1
            if r["min_cosine"] < 0.99:
                offenders.append(f"{r['model']}: lowest cosine {r['min_cosine']:.4f}")
    targets.append(_target("MiniLM sentence-embedding cosine >= 0.99 (lowest over sentences)",
                           offenders, checked))

    offenders, checked = [], 0
    for r in mine:
        peer = _find(rows, r["model"], ORT_DEFAULT)
        if r.get("status") != "ok" or peer is None or peer.get("status") != "ok":
            continue
        checked += 1
        if r["convert_s"] > peer["convert_s"]:
            offenders.append(f"{r['model']}: {r['convert_s']:.2f}s > {peer['convert_s']:.2f}s")
    targets.append(_target("quantization time <= ORT quantize_static MinMax's (default S8S8, "
                           "pre-processing included) on every model", offenders, checked))

    offenders = [f"{r['model']}: {r.get('status')} {_short_error(r)}".strip()
                 for r in mine if not r.get("valid")]
    targets.append(_target("100% valid (full checker passes, ORT loads and runs)", offenders,
                           len(mine)))
    return targets


def render(rows: Sequence[Row], agg: Sequence[dict[str, Any]],
           targets: dict[str, list[dict[str, Any]]], fp32_accuracy: dict[str, float | None],
           samples: dict[str, int]) -> str:
    calib = ", ".join(f"{m} {n}" for m, n in samples.items())
    lines = ["## INT8", "",
             "Every tool quantizes from the same calibration samples (one .npz per sample, "
             f"disjoint from the eval inputs; samples per model: {calib}) and is measured on the "
             "same eval inputs as the FP16/BF16 rows. mixprec runs with its defaults "
             "(mode auto, activations auto, per-channel, speed auto; -bc: bias correction on, "
             "-dynamic: mode dynamic); placement = the placement mixprec's "
             "speed=auto kept.", "", COLUMNS, "",
             model_table(rows, fp32_accuracy), "", "### Per tool", "", aggregate_table(agg), ""]
    for tool, found in targets.items():
        lines += [f"### Issue 8 targets for {tool}", "", targets_markdown(found), ""]
    return "\n".join(lines)
