"""``mixprec optimize --report PAGE.html``: the report page of the chosen model, with the
candidate table above its graph.

The table is the one the command's last lines print (:meth:`OptimizeResult.format_table`):
each candidate's runtime and hints, latency ratio to the input in ONNX Runtime, rounds
timed, accuracy against its budget, verdict and why it lost; then the summary line and
the notes. The graph below is the written model's, drawn as ``mixprec report`` draws any
model (:func:`mixprec.report.html.render_page`), and the page is written atomically.
"""

from __future__ import annotations

import json
import os

import onnx_ir as ir

from mixprec.checks.outputs import reading_lines
from mixprec.io.models import write_text
from mixprec.optimize.choice import Row, accuracy_text
from mixprec.optimize.result import OptimizeResult
from mixprec.report.html import render_page
from mixprec.report.html_parts import esc

__all__ = ["candidates_html", "write_optimize_html"]

_HEAD = ("candidate", "runtime", "hints", "vs ORT FP32", "ms", "rounds", "accuracy", "verdict")


def _row(row: Row) -> str:
    t = row.timing
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
    ms = "-" if t is None else f"{t.ms:.3g}"
    rounds = "-" if t is None else f"{t.rounds}{' (pruned)' if t.pruned else ''}"
    hints = json.dumps(row.hints, sort_keys=True) if row.hints else ""
    verdict = f"{row.verdict}: {row.reason}" if row.reason else row.verdict
    cells = [
        f"<td>{esc(row.name)}</td>",
        f"<td>{esc(row.runtime)}</td>",
        f"<td>{esc(hints)}</td>",
        f'<td class="num">{esc(ratio)}</td>',
        f'<td class="num">{ms}</td>',
        f'<td class="num">{rounds}</td>',
        f"<td>{esc(accuracy_text(row.checks) or '-')}</td>",
        f'<td class="verdict-{esc(row.verdict)}">{esc(verdict)}</td>',
    ]
    klass = ' class="wins"' if row.verdict == "wins" else ""
    return f"<tr{klass}>{''.join(cells)}</tr>"


def candidates_html(result: OptimizeResult) -> str:
    """The candidate table, the summary line and the notes, as one HTML section."""
    names = [result.versus if h == "vs ORT FP32" else h for h in _HEAD]
    head = "".join(f"<th>{h}</th>" for h in names)
    body = "".join(_row(r) for r in result.table)
    notes = "".join(f"<li>{esc(n)}</li>" for n in result.notes)
    checked = next((r.checks for r in result.table if r.checks), ())
    read = reading_lines([c.to_dict() for c in checked])
    reads = "".join(f"<li>{esc(line)}</li>" for line in read)
    return (
        '<section class="top"><h2>Candidates</h2>'
        f'<table class="candidates"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        f'<p class="summary-line">{esc(result.summary)}</p>'
        + (f"<p>{esc(result.timed_at.text())}</p>" if result.timed_at is not None else "")
        + (f'<h3>How each output was read</h3><ul class="readings">{reads}</ul>' if reads else "")
        + (f"<ul>{notes}</ul>" if notes else "")
        + "</section>"
    )


def write_optimize_html(
    result: OptimizeResult, path: str | os.PathLike[str], *, title: str | None = None
) -> None:
    """Write ``result``'s page to ``path`` atomically (a temporary file, then a rename).

    Example:
        >>> result = mixprec.optimize("m.onnx", samples)                  # doctest: +SKIP
        >>> write_optimize_html(result, "optimize.html")                  # doctest: +SKIP
    """
    model = ir.from_proto(result.model_proto)
    extra: dict[str, object] = {"chosen": result.winner, "runtime": result.runtime.name}
    extra.update(result.metadata)
    name = title or f"mixprec optimize: {model.graph.name or 'model'}"
    top = candidates_html(result)
    page = render_page(model, None, title=name, converted=True, extra=extra, top=top)
    write_text(path, page)
