"""``index.html``: the zoo page of a batch. Self-contained and offline (inline CSS, script
and SVG): counts by status, bytes saved, which models were checked on real data, the
slowest models, a chart of error against low-precision share, and a table of every model
(click a header to sort) linking to each model's own report page; for ``--optimize`` rows,
the chosen candidate, its runtime and its latency ratio to ONNX Runtime FP32."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec.io.models import write_text

__all__ = ["PAGE", "chosen_cells", "error_of", "real_data_of", "write_page"]

PAGE = "index.html"
_COLORS = {
    "ok": "#2e7d32",
    "failed": "#c62828",
    "error": "#6a1b9a",
    "timeout": "#ef6c00",
    "unchecked": "#8d6e63",
}
_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222}
h1{font-size:20px} .cards{display:flex;gap:12px;flex-wrap:wrap;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:90px}
.card b{display:block;font-size:20px}
table{border-collapse:collapse;margin-top:12px} th,td{padding:4px 8px;border-bottom:1px solid #eee;
text-align:right} th{cursor:pointer;background:#f6f6f6;position:sticky;top:0}
td:first-child,th:first-child,td.t{text-align:left} .s{font-weight:600}
"""
_SCRIPT = """
document.querySelectorAll('th').forEach((th, i) => th.addEventListener('click', () => {
  const body = th.closest('table').tBodies[0];
  const up = th.dataset.dir !== 'up'; th.dataset.dir = up ? 'up' : 'down';
  const key = r => { const c = r.cells[i]; const v = c.dataset.v ?? c.textContent;
    const n = parseFloat(v); return isNaN(n) ? v : n; };
  [...body.rows].sort((a, b) => { const x = key(a), y = key(b);
    return (x < y ? -1 : x > y ? 1 : 0) * (up ? 1 : -1); }).forEach(r => body.appendChild(r));
}));
"""


def error_of(row: dict[str, Any]) -> float | None:
    """The row's worst relative L2 against FP32 (validation), when it was measured; a
    row's JSON holds a non-finite one as ``"inf"`` or ``"nan"`` (:mod:`mixprec.core.jsonio`)."""
    validation = row.get("validation") or {}
    value = validation.get("worst_rel_l2")
    if value in ("inf", "-inf", "nan"):
        return float(value)
    return float(value) if isinstance(value, int | float) else None


def real_data_of(row: dict[str, Any]) -> str:
    """``yes`` when the row's checks ran on real samples, ``no`` when on generated inputs
    only, empty when the worker gave no row of its own (an error, a timeout)."""
    if "real_data" not in row:
        return ""
    return "yes" if row["real_data"] else "no"


def _mb(n: object) -> str:
    return f"{n / 2**20:.1f}" if isinstance(n, int | float) else ""


def _cell(text: object, value: object = None, cls: str = "") -> str:
    attr = f' data-v="{html.escape(str(value))}"' if value is not None else ""
    klass = f' class="{cls}"' if cls else ""
    return f"<td{attr}{klass}>{html.escape(str(text))}</td>"


def chosen_cells(row: dict[str, Any]) -> tuple[str, str, float | None]:
    """An optimize row's chosen candidate, its runtime (with its precision hint) and its
    latency ratio to ONNX Runtime FP32; empty for other rows."""
    summary = row.get("optimize") or {}
    if not summary:
        return "", "", None
    runtime = str(summary.get("runtime", ""))
    hint = (summary.get("hints") or {}).get("INFERENCE_PRECISION_HINT")
    if hint:
        runtime += f" ({hint})"
    ratio = summary.get("ratio")
    winner = str(summary.get("winner", ""))
    if summary.get("unchanged"):
        winner += " (input unchanged)"
    return winner, runtime, float(ratio) if isinstance(ratio, int | float) else None


def _row_html(row: dict[str, Any], optimized: bool = False) -> str:
    name = html.escape(row["model"])
    link = row.get("report")
    model = f'<td><a href="{html.escape(link)}">{name}</a></td>' if link else f"<td>{name}</td>"
    status = row["status"]
    share = row.get("low_mac_share")
    err = error_of(row)
    color = _COLORS.get(status, "#222")
    chosen = []
    if optimized:
        winner, runtime, ratio = chosen_cells(row)
        shown = "" if ratio is None else f"{ratio:.2f}x"
        chosen = [_cell(winner, cls="t"), _cell(runtime, cls="t"), _cell(shown, ratio)]
    return (
        "<tr>"
        + "".join(
            [
                model,
                f'<td class="s" style="color:{color}">{status}</td>',
                _cell(row.get("dtype", "")),
                *chosen,
                _cell(real_data_of(row)),
                _cell("" if share is None else f"{share:.0%}", share),
                _cell("" if err is None else f"{err:.3g}", err),
                _cell(row.get("casts", "")),
                _cell(_mb(row.get("bytes_before")), row.get("bytes_before")),
                _cell(_mb(row.get("bytes_after")), row.get("bytes_after")),
                _cell(f"{row.get('seconds', 0):.1f}", row.get("seconds")),
                _cell(row.get("peak_rss_mb", "")),
                _cell(row.get("error", "") or ("resumed" if row.get("resumed") else ""), cls="t"),
            ]
        )
        + "</tr>"
    )


def _chart(rows: Sequence[dict[str, Any]]) -> str:
    """Error (log scale) against low-precision MAC share, one dot per model measured with
    a finite error (an inf one is in the table, not on a log axis)."""
    measured = [r for r in rows if r.get("low_mac_share") is not None and error_of(r) is not None]
    points = [
        (float(r["low_mac_share"]), err, r)
        for r in measured
        if (err := error_of(r)) is not None and math.isfinite(err)
    ]
    if not points and measured:
        return "<p>No model has a finite error to chart: see the rel L2 column.</p>"
    if not points:
        return "<p>No model was validated: run with --validate for the error chart.</p>"
    logs = [math.log10(max(e, 1e-9)) for _, e, _ in points if e is not None]
    lo, hi = min(logs) - 0.5, max(logs) + 0.5
    w, h, pad = 480, 240, 40
    dots = []
    for share, err, row in points:
        assert err is not None
        x = pad + share * (w - 2 * pad)
        y = h - pad - (math.log10(max(err, 1e-9)) - lo) / (hi - lo) * (h - 2 * pad)
        tip = html.escape(f"{row['model']}: {share:.0%} low, rel L2 {err:.3g}")
        color = _COLORS.get(row["status"], "#222")
        dots.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"><title>{tip}</title></circle>'
        )
    axes = (
        f'<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="#888"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="#888"/>'
        f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">low-precision MAC share</text>'
        f'<text x="12" y="{pad - 12}">rel L2 (log; 1e{lo:.1f} .. 1e{hi:.1f})</text>'
    )
    return f'<svg width="{w}" height="{h}" role="img">{axes}{"".join(dots)}</svg>'


def _summary(rows: Sequence[dict[str, Any]]) -> str:
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in _COLORS}
    saved = sum(
        r["bytes_before"] - r["bytes_after"]
        for r in rows
        if r["status"] == "ok" and "bytes_after" in r and "bytes_before" in r
    )
    cards = [
        f'<div class="card">{s}<b style="color:{_COLORS[s]}">{n}</b></div>'
        for s, n in counts.items()
    ]
    cards.append(f'<div class="card">bytes saved<b>{saved / 2**20:.1f} MB</b></div>')
    checked = [r["model"] for r in rows if r.get("real_data")]
    ran = [r for r in rows if "real_data" in r]
    real = (
        f"<p>Checked on real data (calibration, eval or validation samples): {len(checked)} "
        f"of {len(ran)} converted model(s)"
        + (f": {html.escape(', '.join(checked))}" if 0 < len(checked) <= 10 else "")
        + ". The others were checked on generated inputs only, if at all.</p>"
    )
    slow = sorted(rows, key=lambda r: -float(r.get("seconds") or 0))[:5]
    slowest = ", ".join(
        f"{html.escape(r['model'])} ({float(r.get('seconds') or 0):.1f} s)" for r in slow
    )
    return f'<div class="cards">{"".join(cards)}</div>{real}<p>Slowest: {slowest}</p>'


def write_page(out_dir: Path, rows: Sequence[dict[str, Any]], title: str) -> Path:
    """Write ``out_dir/index.html`` for ``rows`` (atomically); its path."""
    optimized = any(r.get("optimize") for r in rows)
    headers = [
        "model",
        "status",
        "dtype",
        *(["chosen", "runtime", "vs ORT FP32"] if optimized else []),
        "real data",
        "low MACs",
        "rel L2",
        "casts",
        "MB before",
        "MB after",
        "seconds",
        "peak RSS MB",
        "note",
    ]
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join(_row_html(r, optimized) for r in rows)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"{_summary(rows)}<h2>Error against low-precision share</h2>{_chart(rows)}"
        f"<h2>Models</h2><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        f"<script>{_SCRIPT}</script></body></html>"
    )
    path = out_dir / PAGE
    write_text(path, page)
    return path
