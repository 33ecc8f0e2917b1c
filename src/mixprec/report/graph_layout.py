"""Top-to-bottom layered layout of a graph for the HTML report.

Graphviz ``dot`` does the layout when it is installed (Debian package ``graphviz``): it
ranks the nodes, orders each rank to reduce crossings and routes edges as splines around
the nodes, in about a second for two thousand nodes. Without ``dot`` (a plain pip install)
a simpler layered layout is used: ranks by longest path from the inputs, order within a
rank by a few barycenter sweeps, edges as curves from node to node. So is it when ``dot``
fails or runs past its time limit (:func:`dot_time_limit`, which grows with the graph):
a warning and the layout's ``engine`` and ``notes`` say so.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Layout", "dot_time_limit", "layout_graph"]

logger = logging.getLogger(__name__)

#: Points per inch: dot works in inches, the page in CSS pixels (1 px = 1 pt here).
_PT = 72.0
#: Seconds ``dot`` may take on any graph, plus this per node and edge, at most the cap:
#: far above its usual second per two thousand nodes, but never unbounded.
DOT_BASE_S = 10.0
DOT_PER_ITEM_S = 0.01
DOT_MAX_S = 600.0


@dataclass
class Layout:
    """Node centres, edge paths (SVG path data) and the drawing's size, in pixels."""

    x: list[float]
    y: list[float]
    paths: list[str]
    width: float
    height: float
    engine: str
    notes: list[str] = field(default_factory=list)


def dot_time_limit(nodes: int, edges: int) -> float:
    """Seconds ``dot`` gets for a graph of ``nodes`` and ``edges`` before the simple
    layout is used instead."""
    return min(DOT_MAX_S, DOT_BASE_S + DOT_PER_ITEM_S * (nodes + edges))


def layout_graph(
    widths: Sequence[float],
    heights: Sequence[float],
    edges: Sequence[tuple[int, int]],
    *,
    weights: Sequence[int] | None = None,
    engine: str = "auto",
    time_limit: float | None = None,
) -> Layout:
    """Lay out nodes ``0..n-1`` of the given sizes (pixels) and directed ``edges``.

    Args:
        weights: dot's edge weights (heavier edges are kept shorter and straighter).
        engine: "dot" (Graphviz, falling back to "layered" if it fails or runs past its
            time limit), "layered", or "auto": dot when installed, else layered.
        time_limit: seconds dot may take (default: :func:`dot_time_limit` of the graph).
    """
    if engine not in ("auto", "dot", "layered"):
        raise ValueError(f"layout engine must be auto, dot or layered, not {engine!r}")
    if engine == "layered" or shutil.which("dot") is None or not widths:
        return _layered_layout(widths, heights, edges)
    limit = dot_time_limit(len(widths), len(edges)) if time_limit is None else time_limit
    try:
        return _dot_layout(widths, heights, edges, weights, limit)
    except subprocess.TimeoutExpired:
        why = f"took more than {limit:g} s for {len(widths)} nodes"
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        why = f"failed ({exc})"
    logger.warning("graphviz dot %s; using the simple layered layout", why)
    found = _layered_layout(widths, heights, edges)
    found.engine = f"layered (graphviz dot {why})"
    found.notes.append(f"graphviz dot {why}: the simple layered layout is used")
    return found


def _dot_source(
    widths: Sequence[float],
    heights: Sequence[float],
    edges: Sequence[tuple[int, int]],
    weights: Sequence[int] | None,
) -> str:
    lines = [
        "digraph G {",
        "rankdir=TB; nodesep=0.2; ranksep=0.3;",
        'node [shape=box, fixedsize=true, label=""];',
    ]
    lines += [
        f"n{i} [width={w / _PT:.3f}, height={h / _PT:.3f}];"
        for i, (w, h) in enumerate(zip(widths, heights, strict=True))
    ]
    if weights is None:
        lines += [f"n{a} -> n{b};" for a, b in edges]
    else:
        lines += [f"n{a} -> n{b} [weight={w}];" for (a, b), w in zip(edges, weights, strict=True)]
    lines.append("}")
    return "\n".join(lines)


def _dot_layout(
    widths: Sequence[float],
    heights: Sequence[float],
    edges: Sequence[tuple[int, int]],
    weights: Sequence[int] | None = None,
    time_limit: float = DOT_MAX_S,
) -> Layout:
    exe = shutil.which("dot") or "dot"
    done = subprocess.run(
        [exe, "-Tplain"],
        input=_dot_source(widths, heights, edges, weights),
        capture_output=True,
        text=True,
        timeout=time_limit,
        check=False,
    )
    if done.returncode != 0:
        raise ValueError((done.stderr.strip().splitlines() or ["exit status"])[0][:200])
    n = len(widths)
    x, y = [0.0] * n, [0.0] * n
    height = 0.0
    width = 0.0
    edge_points: dict[tuple[int, int], list[list[tuple[float, float]]]] = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if not parts:
            continue
        if parts[0] == "graph":
            width, height = float(parts[2]) * _PT, float(parts[3]) * _PT
        elif parts[0] == "node":
            i = int(parts[1][1:])
            x[i] = float(parts[2]) * _PT
            y[i] = height - float(parts[3]) * _PT
        elif parts[0] == "edge":
            a, b, k = int(parts[1][1:]), int(parts[2][1:]), int(parts[3])
            pts = [
                (float(parts[4 + 2 * j]) * _PT, height - float(parts[5 + 2 * j]) * _PT)
                for j in range(k)
            ]
            edge_points.setdefault((a, b), []).append(pts)
    paths = []
    for a, b in edges:
        routes = edge_points.get((a, b))
        if not routes:
            paths.append(_curve(x[a], y[a] + heights[a] / 2, x[b], y[b] - heights[b] / 2))
            continue
        pts = routes.pop(0) if len(routes) > 1 else routes[0]
        paths.append(_spline(pts))
    return Layout(x, y, paths, width, height, "graphviz dot")


def _spline(pts: Sequence[tuple[float, float]]) -> str:
    """SVG path data of dot's B-spline control points (1 + 3k points: cubic pieces)."""
    head = f"M{pts[0][0]:.1f},{pts[0][1]:.1f}"
    rest = pts[1:]
    if len(rest) % 3 != 0:
        return head + "".join(f"L{px:.1f},{py:.1f}" for px, py in rest)
    return head + "C" + " ".join(f"{px:.1f},{py:.1f}" for px, py in rest)


def _curve(x0: float, y0: float, x1: float, y1: float) -> str:
    mid = (y0 + y1) / 2
    return f"M{x0:.1f},{y0:.1f}C{x0:.1f},{mid:.1f} {x1:.1f},{mid:.1f} {x1:.1f},{y1:.1f}"


def _ranks(n: int, edges: Sequence[tuple[int, int]]) -> list[int]:
    """Longest-path rank of each node (edges that close a cycle are ignored)."""
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for a, b in edges:
        if a != b:
            succ[a].append(b)
            indeg[b] += 1
    rank = [0] * n
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in succ[i]:
            rank[j] = max(rank[j], rank[i] + 1)
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return rank


def _barycenter(near: list[int], order: list[float], own: float) -> float:
    return sum(order[j] for j in near) / len(near) if near else own


def _layered_layout(
    widths: Sequence[float], heights: Sequence[float], edges: Sequence[tuple[int, int]]
) -> Layout:
    n = len(widths)
    rank = _ranks(n, edges)
    layers: list[list[int]] = [[] for _ in range(max(rank, default=0) + 1)]
    for i in range(n):
        layers[rank[i]].append(i)
    preds: list[list[int]] = [[] for _ in range(n)]
    succs: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        preds[b].append(a)
        succs[a].append(b)
    order = [0.0] * n
    for layer in layers:
        for k, i in enumerate(layer):
            order[i] = k
    for sweep in range(4):  # barycenter sweeps, down then up
        near = preds if sweep % 2 == 0 else succs
        for layer in layers if sweep % 2 == 0 else reversed(layers):
            ranked = {i: _barycenter(near[i], order, order[i]) for i in layer}
            layer.sort(key=ranked.__getitem__)
            for k, i in enumerate(layer):
                order[i] = k
    gap, rank_gap = 16.0, 26.0
    x, y = [0.0] * n, [0.0] * n
    top = 10.0
    row_widths = [sum(widths[i] for i in layer) + gap * (len(layer) - 1) for layer in layers]
    full = max(row_widths, default=0.0) + 20.0
    for layer, row in zip(layers, row_widths, strict=True):
        left = (full - row) / 2
        tall = max((heights[i] for i in layer), default=0.0)
        for i in layer:
            x[i] = left + widths[i] / 2
            y[i] = top + tall / 2
            left += widths[i] + gap
        top += tall + rank_gap
    paths = [_curve(x[a], y[a] + heights[a] / 2, x[b], y[b] - heights[b] / 2) for a, b in edges]
    return Layout(x, y, paths, full, top, "layered (graphviz not installed)")
