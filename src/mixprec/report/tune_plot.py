"""The tuner's log folder: ``tune.json`` (the result and the search path),
``tune.png``, the metric against the low-precision MAC share along the path, and
``tune.html``, the tuned model's report page (:mod:`mixprec.report.html`) with the tuner's
summary rows and the same search curve.

matplotlib is an optional extra (``pip install mixprec[plot]``), imported only here;
without it the plot is skipped with a note in ``tune.json`` and the log.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.core.jsonio import json_text
from mixprec.io.models import atomic_file, write_text
from mixprec.report.html import write_report_html

if TYPE_CHECKING:
    from mixprec.tune.result import TuneResult

__all__ = ["write_tune_log"]

logger = logging.getLogger(__name__)

JSON_FILE = "tune.json"
PLOT_FILE = "tune.png"
PAGE_FILE = "tune.html"


def _plot(result: TuneResult, path: Path) -> str | None:
    """Draw the search path into ``path``; a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'mixprec[plot]'): no tune.png"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for subset, marker, label in ((False, "o", "full set"), (True, "x", "worst samples")):
        steps = [s for s in result.path if s.subset is subset]
        if steps:
            ax.scatter(
                [100 * s.low_mac_share for s in steps],
                [s.value for s in steps],
                marker=marker,
                label=label,
            )
    ax.plot(
        [100 * s.low_mac_share for s in result.path],
        [s.value for s in result.path],
        color="0.7",
        linewidth=0.8,
        zorder=0,
    )
    if result.budget is not None:
        ax.axhline(result.budget.limit, color="red", linestyle="--", label=result.budget.text)
    if result.metric in ("rel-l2", "max-abs") and all(s.value > 0 for s in result.path):
        ax.set_yscale("log")
    ax.set_xlabel(f"MACs in {result.target} (%)")
    ax.set_ylabel(result.metric)
    ax.set_title(f"mixprec tune: {result.metric} along the search path")
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(fig)
    return None


def _page(result: TuneResult, path: Path) -> None:
    ev = result.evaluations
    extra: dict[str, object] = {
        "tuner budget": result.budget.text if result.budget else "",
        "tuner result": ("passed: " if result.passed else "not met: ") + result.message,
        "tuner evaluations": f"{ev['full']} full-set + {ev['subset']} subset",
        "kept float by the tuner": ", ".join(s.name for s in result.kept_float[:20])
        + (f" (+{len(result.kept_float) - 20})" if len(result.kept_float) > 20 else ""),
    }
    curve = [(s.low_mac_share, s.value) for s in result.path if math.isfinite(s.value)]
    write_report_html(
        result,
        path,
        extra=extra,
        curve=curve,
        curve_labels=(f"MAC share in {result.target}", result.metric),
    )


def write_tune_log(folder: str | os.PathLike[str], result: TuneResult) -> list[str]:
    """Write ``tune.json`` and ``tune.png`` into ``folder``; returns the notes."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    note = _plot(result, out / PLOT_FILE)
    if note is not None:
        logger.warning(note)
        notes.append(note)
    _page(result, out / PAGE_FILE)
    data = result.to_dict()
    data["ranking"] = [s.to_dict() for s in result.ranking]
    data["notes"] = notes
    write_text(out / JSON_FILE, json_text(data, indent=2))
    return notes
