"""``mixprec report``'s page: one self-contained HTML file of the painted graph.

The graph is laid out here (:mod:`mixprec.report.graph_layout`) and drawn as static SVG, one box per
node with its precision as a CSS class and its decision in a tooltip; the page's own
script (``report_assets/report.js``, embedded) adds pan and zoom, search, the FP32 filter
and the detail panel. Nothing is fetched when the page opens: no network, no server.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any

import onnx_ir as ir

from mixprec.io.models import write_text
from mixprec.pipeline.report import Report
from mixprec.report.graph_layout import Layout, layout_graph
from mixprec.report.graph_view import PRECISION_LABELS, GraphView, NodeView, build_views
from mixprec.report.html_parts import (
    esc,
    guard_checks,
    mac_chart,
    reason_groups,
    search_curve,
    summary_rows,
    validation,
)

__all__ = ["render_page", "write_report_html"]

_NODE_H = 34.0
_SMALL_W, _SMALL_H = 34.0, 16.0
_CHAR_W = 6.6


def _asset(name: str) -> str:
    return resources.files("mixprec").joinpath("report_assets", name).read_text("utf-8")


def _short(text: str, limit: int = 26) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _node_width(node: NodeView) -> float:
    if node.small:
        return _SMALL_W
    chars = max(len(node.label), min(len(node.name), 26))
    return max(70.0, chars * _CHAR_W + 18.0)


def _tooltip(node: NodeView) -> str:
    d = node.detail
    lines = [f"{d.get('op', node.label)} {node.name}".strip(), f"precision: {d.get('precision')}"]
    if "reason" in d:
        step = f"[{d['step']}] " if d.get("step") else ""
        lines.append(f"{step}{d['reason']}")
    if d.get("list_class") not in (None, "none"):
        lines.append(f"list class: {d['list_class']}")
    if d.get("macs"):
        lines.append(f"MACs: {d['macs'] / 1e6:.3f} M")
    for out in d.get("outputs", [])[:1]:
        if out.get("shape") is not None:
            lines.append(f"output: {out['dtype']} [{', '.join(map(str, out['shape']))}]")
    return "\n".join(lines)


def _svg(view: GraphView, lay: Layout, widths: list[float], hidden: bool) -> str:
    parts = [
        f'<svg class="graph" id="svg-{view.id}" data-graph="{view.id}"'
        f'{" hidden" if hidden else ""} data-w="{lay.width:.0f}" data-h="{lay.height:.0f}">'
        '<g class="vp">'
    ]
    for (a, b, kind), path in zip(view.edges, lay.paths, strict=True):
        parts.append(f'<path class="e e-{kind}" data-a="{a}" data-b="{b}" d="{path}"/>')
    for i, node in enumerate(view.nodes):
        w, h = widths[i], _SMALL_H if node.small else _NODE_H
        x, y = lay.x[i], lay.y[i]
        second = _short(node.name) if node.name and node.name != node.label else ""
        if node.small:
            label = '<text class="nm" y="3">const</text>'
        elif second:
            label = f'<text y="-3">{esc(_short(node.label))}</text>'
            label += f'<text class="nm" y="11">{esc(second)}</text>'
        else:
            label = f'<text y="4">{esc(_short(node.label))}</text>'
        parts.append(
            f'<g class="n p-{node.precision}" id="{node.id}" data-i="{i}" '
            f'transform="translate({x:.1f},{y:.1f})">'
            f"<title>{esc(_tooltip(node))}</title>"
            f'<rect x="{-w / 2:.1f}" y="{-h / 2:.1f}" width="{w:.1f}" height="{h:.0f}" rx="5"/>'
            f"{label}</g>"
        )
    parts.append("</g></svg>")
    return "".join(parts)


def _legend() -> str:
    items = "".join(
        f'<span class="lg"><i class="sw p-{key}"></i>{esc(label)}</span>'
        for key, label in PRECISION_LABELS.items()
    )
    edges = "".join(
        f'<span class="lg"><i class="ln e-{k}"></i>{label}</span>'
        for k, label in (
            ("f32", "float32"),
            ("f16", "float16"),
            ("bf16", "bfloat16"),
            ("i8", "int8/uint8"),
            ("other", "other"),
        )
    )
    return f'<div class="legend">{items}<span class="sep"></span>{edges}</div>'


def render_page(
    model: ir.Model,
    report: Report | None = None,
    *,
    title: str = "mixprec report",
    converted: bool = False,
    extra: dict[str, object] | None = None,
    curve: Sequence[tuple[float, float]] | None = None,
    curve_labels: tuple[str, str] = ("share of nodes in low precision", "error"),
    engine: str = "auto",
    top: str = "",
) -> str:
    """The report page for ``model`` (annotated or converted) as one HTML string.

    Args:
        model: the model to draw: annotated (``mixprec report``) or converted.
        report: the run's report (summary, reasons, validation); None reads the
            decisions from ``node.meta``.
        converted: whether ``model`` is the written result (casts and bytes "after").
        extra: more summary rows (label -> value), e.g. from a tuner.
        curve: points (x, y) of a search curve, drawn as a small chart.
        engine: layout engine for :func:`mixprec.report.graph_layout.layout_graph`.
        top: a section of HTML (escaped by its maker) shown full width above the graph,
            e.g. ``mixprec optimize``'s candidate table.
    """
    views = build_views(model, report)
    t0 = time.perf_counter()
    svgs, data, engines = [], {}, set()
    for k, view in enumerate(views):
        widths = [_node_width(n) for n in view.nodes]
        heights = [_SMALL_H if n.small else _NODE_H for n in view.nodes]
        edges = [(a, b) for a, b, _ in view.edges]
        lay = layout_graph(widths, heights, edges, weights=view.weights, engine=engine)
        engines.add(lay.engine)
        svgs.append(_svg(view, lay, widths, hidden=k > 0))
        data[view.id] = {
            "title": view.title,
            "nodes": [n.detail for n in view.nodes],
            "ids": [n.id for n in view.nodes],
            "edges": [[a, b] for a, b, _ in view.edges],
        }
    layout_s = time.perf_counter() - t0
    rows = summary_rows(report, views, converted)
    rows.append(("layout", f"{', '.join(sorted(engines))} ({layout_s:.2f} s)"))
    rows += [(str(k), str(v)) for k, v in (extra or {}).items()]
    payload = json.dumps({"graphs": data}, separators=(",", ":"), default=str)
    options = "".join(
        f'<option value="{v.id}">{esc(v.title)} ({len(v.nodes)} nodes)</option>' for v in views
    )
    summary = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows)
    side = [
        f'<table class="summary">{summary}</table>',
        reason_groups(report, views),
        validation(report),
        guard_checks(report),
        mac_chart(views),
        search_curve(curve, curve_labels),
    ]
    return _PAGE.format(
        title=esc(title),
        css=_asset("report.css"),
        js=_asset("report.js"),
        data=payload.replace("<", "\\u003c"),  # no "</script>" or "<!--" inside the script
        legend=_legend(),
        side="".join(side),
        options=options,
        svgs="".join(svgs),
        top=top,
    )


def write_report_html(
    result_or_model: Any,
    path: str | os.PathLike[str],
    *,
    report: Report | None = None,
    title: str | None = None,
    converted: bool | None = None,
    extra: dict[str, object] | None = None,
    curve: Sequence[tuple[float, float]] | None = None,
    curve_labels: tuple[str, str] = ("share of nodes in low precision", "error"),
) -> None:
    """Write the report page of a :class:`~mixprec.ConversionResult` (or an ``onnx_ir``
    model and its :class:`Report`) to ``path``, atomically.

    Example:
        >>> result = mixprec.convert("model.onnx", "fp16")           # doctest: +SKIP
        >>> write_report_html(result, "report.html")                 # doctest: +SKIP
    """
    model = getattr(result_or_model, "model", result_or_model)
    if not isinstance(model, ir.Model):
        raise TypeError(f"expected a ConversionResult or onnx_ir.Model, not {type(model)}")
    if report is None:
        report = getattr(result_or_model, "report", None)
    if converted is None:
        converted = hasattr(result_or_model, "report")
    name = title or f"mixprec report: {model.graph.name or 'model'}"
    page = render_page(
        model,
        report,
        title=name,
        converted=converted,
        extra=extra,
        curve=curve,
        curve_labels=curve_labels,
    )
    write_text(path, page)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style></head>
<body>
<header><h1>{title}</h1>{legend}</header>{top}
<div id="main">
<aside id="side">{side}</aside>
<section id="view">
<div class="tools">
<select id="graph-select" title="graph to show">{options}</select>
<input id="search" type="search" placeholder="search node name or op type" autocomplete="off">
<span id="search-count"></span>
<label><input id="fp32-only" type="checkbox"> only FP32 nodes and their neighbours</label>
<button id="fit" type="button">fit</button>
</div>
<div id="canvas">{svgs}</div>
</section>
<aside id="detail"><p class="hint">Click a node for its details.</p></aside>
</div>
<script type="application/json" id="mp-data">{data}</script>
<script>{js}</script>
</body></html>
"""
