"""Markdown tables, issue-3 targets and the chart, from the rows bench.main measured."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

PEERS_FP16 = ("onnxconverter-common", "ort-float16", "modelopt")
PEERS_BF16 = ("modelopt",)
MIXPREC = ("mixprec", "mixprec-nocal")


def label(row: Row) -> str:
    return f"{row['converter']} {row['dtype']}"


def is_valid(row: Row) -> bool:
    """fp16: converted and runs in ORT; bf16: converted and passes the full checker."""
    if row.get("status") != "ok":
        return False
    if row["dtype"] == "fp16":
        return bool(row.get("ort_runs"))
    return row.get("checker_error") is None


def num(value: float | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, fmt)


def pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def median_of(values: Iterable[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def stat(row: Row, key: str) -> Any:
    return (row.get("stats") or {}).get(key)


def latency_ratio(row: Row) -> float | None:
    return (row.get("latency") or {}).get("ratio")


def _short_error(row: Row) -> str:
    text = row.get("error") or row.get("emulation_error") or ""
    return text.replace("|", "/").replace("\n", " ")[:90]


def model_table(rows: Sequence[Row]) -> str:
    head = ("| model | converter | dtype | valid | check/ORT | casts | low nodes | low MACs "
            "| size | worst rel L2 | max abs err | top-1 | conv s | peak RSS MB | latency |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        base = f"| {r['model']} | {r['converter']} | {r['dtype']} "
        if r.get("status") != "ok":
            lines.append(base + f"| {r.get('status')} | {_short_error(r)} |" + " |" * 9)
            continue
        check = "✓" if r.get("checker_error") is None else "✗"
        runs = "✓" if r.get("ort_runs") else "✗"
        err = num(r.get("worst_rel_l2"), ".2e")
        if r.get("mode") == "emulated":
            err += " (emu)"
        if "accuracy" in r:
            top1 = f"{pct(r.get('top1_agreement'))} acc {100 * r['accuracy']:.1f}%"
        else:
            top1 = pct(r.get("top1_agreement"))
        lines.append(
            base + f"| {'yes' if is_valid(r) else 'NO'} | {check}/{runs} "
            f"| {num(stat(r, 'casts'), 'd')} | {pct(stat(r, 'low_node_share'))} "
            f"| {pct(stat(r, 'low_mac_share'))} | {num(r.get('size_ratio'), '.2f')} "
            f"| {err} | {num(r.get('max_abs_err'), '.2e')} | {top1} "
            f"| {num(r.get('convert_s'), '.2f')} | {num(r.get('peak_rss_mb'), '.0f')} "
            f"| {num(latency_ratio(r), '.2f')} |"
        )
    return "\n".join(lines)


def aggregate(rows: Sequence[Row]) -> list[dict[str, Any]]:
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(label(r), []).append(r)
    out = []
    for name, group in groups.items():
        tried = [r for r in group if r.get("status") != "unavailable"]
        ok = [r for r in group if r.get("status") == "ok"]
        out.append({
            "converter": name,
            "models": len(group),
            "attempted": len(tried),
            "valid": sum(is_valid(r) for r in group),
            "median_casts": median_of(stat(r, "casts") for r in ok),
            "median_low_mac_share": median_of(stat(r, "low_mac_share") for r in ok),
            "median_worst_rel_l2": median_of(r.get("worst_rel_l2") for r in ok),
            "median_latency_ratio": median_of(latency_ratio(r) for r in ok),
            "median_convert_s": median_of(r.get("convert_s") for r in ok),
            "median_peak_rss_mb": median_of(r.get("peak_rss_mb") for r in ok),
        })
    return out


def aggregate_table(agg: Sequence[dict[str, Any]]) -> str:
    lines = ["| converter | valid | median casts | median low MACs | median worst rel L2 "
             "| median latency ratio | median conv s | median peak RSS MB |",
             "|" + "---|" * 8]
    for a in agg:
        lines.append(
            f"| {a['converter']} | {a['valid']}/{a['models']} | {num(a['median_casts'], '.1f')} "
            f"| {pct(a['median_low_mac_share'])} | {num(a['median_worst_rel_l2'], '.2e')} "
            f"| {num(a['median_latency_ratio'], '.2f')} | {num(a['median_convert_s'], '.2f')} "
            f"| {num(a['median_peak_rss_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def _find(rows: Sequence[Row], model: str, converter: str, dtype: str) -> Row | None:
    for r in rows:
        if (r["model"], r["converter"], r["dtype"]) == (model, converter, dtype):
            return r
    return None


def target_row(name: str, offenders: list[str], checked: int, detail: str = "") -> dict[str, Any]:
    status = "not evaluated" if checked == 0 else ("missed" if offenders else "met")
    return {"target": name, "status": status, "checked": checked, "offenders": offenders,
            "detail": detail}


def evaluate_targets(rows: Sequence[Row], models: Sequence[str],
                     fp32_sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Issue 3's targets for mixprec, each met / missed with the offending models."""
    mine = [r for r in rows if r["converter"] in MIXPREC and r.get("status") != "unavailable"]
    targets = []

    # 1. validity
    offenders = [f"{label(r)} on {r['model']}" for r in mine if not is_valid(r)]
    targets.append(target_row("100% valid (fp16 runs in ORT; bf16 passes full checker)",
                           offenders, len(mine)))

    # 2. casts vs peers with no more low-precision MACs
    offenders, checked = [], 0
    for dtype, peers in (("fp16", PEERS_FP16), ("bf16", PEERS_BF16)):
        for model in models:
            r = _find(rows, model, "mixprec", dtype)
            if r is None or not is_valid(r) or stat(r, "low_mac_share") is None:
                continue
            bars = []
            for peer in peers:
                p = _find(rows, model, peer, dtype)
                if p is None or not is_valid(p) or stat(p, "low_mac_share") is None:
                    continue
                if stat(r, "low_mac_share") >= stat(p, "low_mac_share") - 1e-9:
                    bars.append((stat(p, "casts"), peer))
            if not bars:
                continue
            checked += 1
            lowest, who = min(bars)
            if stat(r, "casts") > lowest:
                offenders.append(f"{model} {dtype}: {stat(r, 'casts')} casts > {lowest} ({who})")
    targets.append(target_row("casts <= lowest peer's where mixprec's low MAC share >= the peer's",
                           offenders, checked))

    # 3. fp16 accuracy
    offenders, checked = [], 0
    for model in models:
        r = _find(rows, model, "mixprec", "fp16")
        if r is None or r.get("status") != "ok" or "outputs" not in r:
            continue
        checked += 1
        for out, entry in r["outputs"].items():
            mine_err = entry["rel_l2"]
            peer_errs = [
                (p["outputs"][out]["rel_l2"], peer) for peer in PEERS_FP16
                if (p := _find(rows, model, peer, "fp16")) is not None and is_valid(p)
                and out in p.get("outputs", {}) and p.get("mode") == "ort"
            ]
            if mine_err > 1e-2:
                offenders.append(f"{model}/{out}: rel L2 {mine_err:.2e} > 1e-2")
            if peer_errs:
                best, who = min(peer_errs)
                if mine_err > 1.5 * best:
                    offenders.append(f"{model}/{out}: rel L2 {mine_err:.2e} > 1.5 x {best:.2e} "
                                     f"({who})")
    targets.append(target_row("fp16 rel L2 <= 1.5 x best peer on every output and <= 1e-2",
                           offenders, checked))

    # 4. calibrated conversion time vs ModelOpt
    offenders, checked = [], 0
    for dtype in ("fp16", "bf16"):
        for model in models:
            r = _find(rows, model, "mixprec", dtype)
            m = _find(rows, model, "modelopt", dtype)
            if r is None or m is None or r.get("status") != "ok" or m.get("status") != "ok":
                continue
            checked += 1
            if r["convert_s"] > 0.1 * m["convert_s"]:
                offenders.append(f"{model} {dtype}: {r['convert_s']:.2f}s > 0.1 x "
                                 f"{m['convert_s']:.2f}s")
    targets.append(target_row("conversion time with calibration <= 0.1 x ModelOpt's on every model "
                           "(where ModelOpt converts)", offenders, checked))

    # 5. --no-calibrate time vs onnxconverter-common, on the median
    ratios = []
    for model in models:
        r = _find(rows, model, "mixprec-nocal", "fp16")
        o = _find(rows, model, "onnxconverter-common", "fp16")
        if r and o and r.get("status") == "ok" and o.get("status") == "ok" and o["convert_s"] > 0:
            ratios.append(r["convert_s"] / o["convert_s"])
    med = median_of(ratios)
    offenders = [] if med is None or med <= 1.0 else [f"median ratio {med:.2f}"]
    targets.append(target_row("--no-calibrate conversion time <= 1.0 x onnxconverter-common's "
                           "(median over models)", offenders, len(ratios),
                           "" if med is None else f"median ratio {med:.2f}"))

    # 6. peak RSS
    offenders, checked = [], 0
    for r in mine:
        if r.get("peak_rss_mb") is None or r.get("status") != "ok":
            continue
        checked += 1
        limit = 3 * fp32_sizes[r["model"]] / 2**20 + 150
        if r["peak_rss_mb"] > limit:
            offenders.append(f"{label(r)} on {r['model']}: {r['peak_rss_mb']:.0f} MB > "
                             f"{limit:.0f} MB")
    targets.append(target_row("peak RSS <= 3 x model file size + 150 MB", offenders, checked))

    # 7. output size
    offenders, checked = [], 0
    for r in mine:
        if r.get("size_ratio") is None:
            continue
        checked += 1
        if r["size_ratio"] > 0.55:
            offenders.append(f"{label(r)} on {r['model']}: {r['size_ratio']:.2f}")
    targets.append(target_row("output size <= 0.55 x FP32 file", offenders, checked))
    return targets


def targets_markdown(targets: Sequence[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        mark = {"met": "MET", "missed": "MISSED"}.get(t["status"], "NOT EVALUATED")
        extra = f" ({t['detail']})" if t.get("detail") else ""
        lines.append(f"- **{mark}** — {t['target']}; checked {t['checked']}{extra}")
        for o in t["offenders"]:
            lines.append(f"  - {o}")
    return "\n".join(lines)


def chart(rows: Sequence[Row], models: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(label(r) for r in rows))
    panels: list[tuple[str, Callable[[Row], float | None], bool]] = [
        ("low-precision MAC share", lambda r: stat(r, "low_mac_share"), False),
        ("worst output rel L2 vs FP32 (log)", lambda r: r.get("worst_rel_l2"), True),
        ("ORT CPU latency / FP32", latency_ratio, False),
        ("Cast nodes", lambda r: stat(r, "casts"), False),
        ("output size / FP32 size", lambda r: r.get("size_ratio"), False),
        ("conversion time s (log)", lambda r: r.get("convert_s"), True),
    ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 3.2 * len(panels)), sharex=True)
    width = 0.8 / max(1, len(names))
    colours = plt.get_cmap("tab10")
    for ax, (title, value, log) in zip(axes, panels, strict=True):
        for k, name in enumerate(names):
            xs, ys = [], []
            for i, model in enumerate(models):
                r = next((r for r in rows if r["model"] == model and label(r) == name), None)
                v = value(r) if r is not None and r.get("status") == "ok" else None
                if v is not None and math.isfinite(v) and (v > 0 or not log):
                    xs.append(i + (k - (len(names) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=name, color=colours(k % 10))
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=4, fontsize=9)
    axes[-1].set_xticks(range(len(models)))
    axes[-1].set_xticklabels(models, rotation=20)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    fig.savefig(path, dpi=80)
    plt.close(fig)
