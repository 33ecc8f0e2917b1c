"""The panels around the graph on the report page: summary, FP32 reasons, validation,
MACs by op type and precision, and an optional search curve (all static HTML/SVG)."""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from collections.abc import Sequence

from mixprec.pipeline.report import Report
from mixprec.report.graph_view import PRECISION_LABELS, GraphView

__all__ = [
    "esc",
    "guard_checks",
    "mac_chart",
    "reason_groups",
    "search_curve",
    "summary_rows",
    "validation",
]


def esc(text: object) -> str:
    """``text`` escaped for the report pages' HTML (quotes included)."""
    return html.escape(str(text), quote=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def summary_rows(
    report: Report | None, views: Sequence[GraphView], converted: bool
) -> list[tuple[str, str]]:
    """Label/value rows of the summary table."""
    drawn = Counter(n.precision for v in views for n in v.nodes)
    rows = [("nodes drawn", f"{sum(drawn.values())} in {len(views)} graph(s)")]
    if report is None:
        return rows
    low = "INT8" if report.target == "int8" else f"{report.target} (low precision)"
    rows += [
        ("target", low),
        (
            "nodes in low precision",
            f"{report.low_nodes} of {len(report.nodes)} ({report.low_node_share:.1%})",
        ),
        (
            "MACs in low precision",
            f"{report.low_mac_share:.1%} of {report.total_macs / 1e6:.1f} M"
            if report.total_macs
            else "n/a (no counted MACs)",
        ),
    ]
    if converted:
        rows += [
            ("casts before → after", f"{report.casts_before} → {report.casts_after}"),
            (
                "parameter bytes before → after",
                f"{_mb(report.param_bytes_before)} → {_mb(report.param_bytes_after)}",
            ),
        ]
        if drawn.get("qdq"):
            rows.append(("QuantizeLinear / DequantizeLinear nodes", str(drawn["qdq"])))
    else:
        rows += [
            ("casts in the input", str(report.casts_before)),
            ("parameter bytes", _mb(report.param_bytes_before)),
            ("model written", "no (report only: the plan, not the result)"),
        ]
    if report.quantization and isinstance(
        share := report.quantization.get("integer_kernel_mac_share"), float
    ):
        rows.append(("MACs in ORT integer kernels", f"{share:.1%}"))
    if report.timings:
        rows.append(("time", f"{sum(report.timings.values()):.2f} s"))
    rows.append(("range calibration", "yes" if report.calibrated else "no"))
    return rows


def reason_groups(report: Report | None, views: Sequence[GraphView]) -> str:
    """Nodes kept FP32 grouped by (step, reason), each group a button that highlights them."""
    if report is None:
        return ""
    ids_by_name: dict[str, list[str]] = defaultdict(list)
    kind: dict[str, str] = {}
    for view in views:
        for node in view.nodes:
            kind[node.id] = node.precision
            if node.name and node.precision not in ("io", "cast", "qdq"):
                ids_by_name[node.name].append(node.id)
    groups: dict[tuple[str, str], list[str]] = defaultdict(list)
    for row in report.fp32_nodes():
        ids = ids_by_name.get(row.name, [])
        if all(kind[i] == "int" for i in ids):
            continue  # shape-only and integer nodes have nothing to paint
        groups[(row.step, row.reason)].extend(ids)
    if not groups:
        return '<h2>Kept FP32</h2><p class="none">no float node kept in FP32</p>'
    items = []
    for (step, reason), ids in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        items.append(
            f'<li><button type="button" class="group" data-nodes="{esc(" ".join(ids))}">'
            f'<b>{len(ids)}</b> <span class="step">[{esc(step)}]</span> {esc(reason)}'
            "</button></li>"
        )
    total = sum(len(ids) for ids in groups.values())
    return f'<h2>Kept FP32: {total} nodes, by reason</h2><ul class="groups">{"".join(items)}</ul>'


#: The validation columns shown, when the outputs carry them.
_VALIDATION_KEYS = ("name", "rel_l2_error", "max_abs_error", "top1_agreement", "passed")


def validation(report: Report | None) -> str:
    """Per-output validation metrics, when the run validated."""
    if report is None or not report.validation:
        return ""
    data = report.validation
    outputs = data.get("outputs") or []
    if not isinstance(outputs, list) or not outputs:
        return ""
    preferred = [k for k in _VALIDATION_KEYS if k in outputs[0]]
    keys = preferred or [k for k, v in outputs[0].items() if not isinstance(v, list | dict)]
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(_fmt(o.get(k)))}</td>" for k in keys) + "</tr>" for o in outputs
    )
    verdict = "passed" if data.get("passed") else "FAILED"
    checks = data.get("checks")  # the rows' readings (each output's rel L2: the table above)
    if isinstance(checks, list):
        checks = [c for c in checks if not (isinstance(c, dict) and c.get("kind") == "rel-l2")]
    return (
        f'<h2>Validation: <span class="v-{verdict.lower()}">{verdict}</span> '
        f"(rtol {esc(_fmt(data.get('rtol')))}, {esc(data.get('kind', ''))})</h2>"
        f'<table class="validation"><tr>{head}</tr>{body}</table>'
        + (f"<h3>Each output read as rows</h3>{_checks_table(checks)}" if checks else "")
    )


#: The accuracy guard's columns: each output, how it was read, and its check.
_GUARD_KEYS = ("output", "reason", "kind", "value", "limit", "rows", "bound", "passed")


def guard_checks(report: Report | None) -> str:
    """How the accuracy guard read each output and what it measured (INT8, weight-only):
    the final checks, each with the reading that chose it."""
    guard = report.guard if report is not None else None
    checks = guard.get("checks") if isinstance(guard, dict) else None
    if not isinstance(checks, list) or not checks:
        return ""
    verdict = "passed" if guard.get("passed") else "FAILED"  # type: ignore[union-attr]
    return (
        f'<h2>Accuracy guard: <span class="v-{verdict.lower()}">{verdict}</span></h2>'
        f"<p>{esc(guard.get('summary', ''))}</p>" + _checks_table(checks)  # type: ignore[union-attr]
    )


def _checks_table(checks: object) -> str:
    """The checks (dicts), a row each: the output, how it was read, and what it measured."""
    rows = [c for c in checks if isinstance(c, dict)] if isinstance(checks, list) else []
    head = "".join(f"<th>{esc(k)}</th>" for k in _GUARD_KEYS)
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(_fmt(c.get(k)))}</td>" for k in _GUARD_KEYS) + "</tr>"
        for c in rows
    )
    return f'<table class="validation"><tr>{head}</tr>{body}</table>'


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def mac_chart(views: Sequence[GraphView]) -> str:
    """Horizontal bars: MACs of each op type, split by precision."""
    by_op: dict[str, Counter[str]] = defaultdict(Counter)
    for view in views:
        for node in view.nodes:
            if node.macs:
                by_op[node.op_type][node.precision] += node.macs
    if not by_op:
        return ""
    top = max(sum(c.values()) for c in by_op.values())
    rows = []
    for op, counts in sorted(by_op.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(counts.values())
        segments = "".join(
            f'<i class="p-{p}" style="width:{100.0 * m / top:.2f}%" '
            f'title="{esc(PRECISION_LABELS.get(p, p))}: {m / 1e6:.2f} M"></i>'
            for p, m in sorted(counts.items())
        )
        rows.append(
            f'<div class="bar"><span class="op">{esc(op)}</span><span class="track">'
            f'{segments}</span><span class="num">{total / 1e6:.1f} M</span></div>'
        )
    return f'<h2>MACs by op type and precision</h2><div class="chart">{"".join(rows)}</div>'


def search_curve(curve: Sequence[tuple[float, float]] | None, labels: tuple[str, str]) -> str:
    """A small line chart of a tuner's search (x, y) points."""
    if not curve:
        return ""
    xs = [float(x) for x, _ in curve]
    ys = [float(y) for _, y in curve]
    x0, x1 = min(xs), max(xs) or 1.0
    y0, y1 = min(ys), max(ys) or 1.0
    w, h, pad = 260.0, 140.0, 24.0

    def px(x: float) -> float:
        return pad + (w - 2 * pad) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.5)

    def py(y: float) -> float:
        return h - pad - (h - 2 * pad) * ((y - y0) / (y1 - y0) if y1 > y0 else 0.5)

    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys, strict=True))
    dots = "".join(
        f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3"><title>{x:.4g}, {y:.4g}</title></circle>'
        for x, y in zip(xs, ys, strict=True)
    )
    return (
        f'<h2>Search</h2><svg class="curve" width="{w:.0f}" height="{h:.0f}">'
        f'<polyline points="{points}"/>{dots}'
        f'<text x="{w / 2:.0f}" y="{h - 4:.0f}">{esc(labels[0])}</text>'
        f'<text x="4" y="12">{esc(labels[1])}</text></svg>'
    )
