"""``results.jsonl``: one JSON object per model, appended as each finishes, never
rewritten; what ``--resume`` reads back; and :class:`BatchResult`, a batch's rows."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.batch.jobs import Job
from mixprec.core.jsonio import json_text

__all__ = [
    "RESULTS",
    "STATUSES",
    "WRITTEN",
    "BatchResult",
    "append_row",
    "read_rows",
    "still_good",
    "validation_summary",
]

RESULTS = "results.jsonl"
#: ``failed``: validation, the accuracy guard or the tune budget missed; ``unchecked``: an
#: INT8 model written without any check on real data (no calibration, eval or validation
#: samples): not ``ok`` unless the batch allows it.
STATUSES = ("ok", "failed", "error", "timeout", "unchecked")
#: The statuses of a written model, that ``--resume`` keeps.
WRITTEN = ("ok", "unchecked")


def append_row(out_dir: Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one line of strict JSON (a non-finite figure as ``"inf"`` or
    ``"nan"``), in one write, flushed to disk."""
    line = json_text(row, sort_keys=True) + "\n"
    with (out_dir / RESULTS).open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_rows(out_dir: Path) -> list[dict[str, Any]]:
    """Every row written so far (a last line cut short by a killed driver is skipped)."""
    path = out_dir / RESULTS
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "model" in row:
            rows.append(row)
    return rows


def latest(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Model -> its last row."""
    return {row["model"]: row for row in rows}


def still_good(job: Job, row: dict[str, Any] | None, out_dir: Path) -> bool:
    """Whether ``row`` is an ``ok`` (or ``unchecked``: the same data gives the same) result
    of this very job whose output is still there."""
    return (
        row is not None
        and row.get("status") in WRITTEN
        and row.get("key") == job.key
        and bool(row.get("output"))
        and (out_dir / str(row["output"])).is_file()
    )


@dataclass
class BatchResult:
    """A batch's rows (this run's and the ones ``--resume`` kept), in job order.

    Attributes:
        out_dir: the output folder.
        rows: one per model; a kept row has ``"resumed": True``.
        interrupted: the batch was stopped (Ctrl-C, SIGTERM) before every model ran.
        page: the zoo page (``index.html``).
        allow_unchecked: ``unchecked`` rows count as ``ok`` for :attr:`ok` and
            :attr:`exit_code`.
    """

    out_dir: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    page: Path | None = None
    allow_unchecked: bool = False

    @property
    def counts(self) -> dict[str, int]:
        found = Counter(row["status"] for row in self.rows)
        return {status: found.get(status, 0) for status in STATUSES}

    @property
    def ok(self) -> bool:
        """Every model ran and is ``ok`` (or ``unchecked``, where allowed)."""
        good = WRITTEN if self.allow_unchecked else ("ok",)
        return not self.interrupted and all(row["status"] in good for row in self.rows)

    @property
    def exit_code(self) -> int:
        """0 every model ok, 1 some failed, errored, timed out or (unless allowed) went
        unchecked, 130 interrupted."""
        if self.interrupted:
            return 130
        return 0 if self.ok else 1

    def summary(self) -> str:
        """The last line: counts by status and where the page is."""
        resumed = Counter(row["status"] for row in self.rows if row.get("resumed"))
        parts = [
            f"{n} {status}" + (f" ({resumed[status]} resumed)" if resumed[status] else "")
            for status, n in self.counts.items()
        ]
        where = f" -> {self.page}" if self.page is not None else ""
        stopped = "; interrupted" if self.interrupted else ""
        return f"mixprec batch: {len(self.rows)} model(s): {', '.join(parts)}{stopped}{where}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "counts": self.counts,
            "interrupted": self.interrupted,
            "page": None if self.page is None else str(self.page),
            "rows": self.rows,
        }


def validation_summary(report: Any) -> dict[str, Any]:
    """A row's ``validation``: whether the written model passed ``--validate`` (a
    :class:`mixprec.ValidationReport`), where it was checked, its worst errors."""
    outputs = report.outputs
    return {
        "passed": report.passed,
        "checked_in": report.kind,
        "worst_rel_l2": max((o.rel_l2_error for o in outputs), default=0.0),
        "max_abs": max((o.max_abs_error for o in outputs), default=0.0),
    }
