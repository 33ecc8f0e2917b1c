"""What :func:`mixprec.optimize` returns: the winner's model and runtime, and the table."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.io.models import copy_model_file, save_model
from mixprec.io.runtime_fields import fp32_nodes
from mixprec.optimize.candidates import BASELINE
from mixprec.optimize.choice import HeadToHead, Row, accuracy_text
from mixprec.optimize.metadata import runtime_metadata, save_marked
from mixprec.optimize.timing import Timing
from mixprec.runtime.engine import RuntimeOptions

__all__ = ["OptimizeResult", "TimedAt", "format_row"]


@dataclass(frozen=True)
class TimedAt:
    """Where the ratios hold: the input shapes the candidates were timed at (the batch is
    each input's first dim) and the intra-op threads of every session."""

    shapes: dict[str, list[int]]
    threads: int

    @property
    def batch(self) -> int | None:
        """The inputs' common leading dim (None: they differ, or have none)."""
        batches = {v[0] for v in self.shapes.values() if v}
        return batches.pop() if len(batches) == 1 else None

    def text(self) -> str:
        """``ratios timed at image [1, 3, 32, 32] (batch 1), 2 thread(s)``."""
        at = ", ".join(f"{k} {v}" for k, v in self.shapes.items())
        batch = "" if self.batch is None else f" (batch {self.batch})"
        return f"ratios timed at {at}{batch}, {self.threads} thread(s)"

    def to_dict(self) -> dict[str, object]:
        return {"shapes": self.shapes, "batch": self.batch, "threads": self.threads}


@dataclass
class OptimizeResult:
    """The fastest accurate candidate, how to run it, and every candidate's verdict.

    Attributes:
        model_proto: The winner's model; the input as given when nothing beat it (then
            without metadata), else carrying ``mixprec.runtime`` / ``mixprec.runtime_hints``.
        runtime: The runtime options the winner was timed with.
        winner: The winning candidate's name (``"fp32-ort"``: the input unchanged).
        table: Every candidate: latency ratio to the input in ONNX Runtime, accuracy
            against its budget, rounds timed, verdict and the reason it lost.
        summary: One line: who won and how to run it, or that the input stays.
        unchanged: The input is the answer (written byte for byte when given as a file).
        source_file: The input's file (all of it), copied as is when ``unchanged``.
        notes: How the samples were split, where timing ran.
        control: A second session of the input timed beside it like any candidate: this
            run's noise floor (its interval should hold 1); None where nothing was timed.
        timed_at: The shapes and threads the ratios were measured at (they hold there).
        head_to_head: The tie timed again with its two candidates beside each other
            (None: no tie between a later, faster one and the earlier winner).

    Example:
        >>> result = mixprec.optimize("m.onnx", samples)  # doctest: +SKIP
        >>> result.save("m_fast.onnx")                    # doctest: +SKIP
    """

    model_proto: onnx.ModelProto
    runtime: RuntimeOptions
    winner: str
    table: list[Row]
    summary: str
    unchanged: bool
    source_file: str | None = None
    notes: list[str] = field(default_factory=list)
    control: Timing | None = None
    timed_at: TimedAt | None = None
    head_to_head: HeadToHead | None = None

    def save(self, path: str | os.PathLike[str], *, external_data: bool = False) -> list[Path]:
        """Write the winner atomically (a temporary file, then a rename); the input
        unchanged from its own file is copied byte for byte. ``external_data``: weights
        in a file beside the model (as :func:`mixprec.io.models.save_model` writes them).
        A winner with OpenVINO precision marks is written as a pair: its IR beside it
        (``OUT.xml``/``OUT.bin``, :func:`~mixprec.optimize.metadata.save_marked`).
        Returns the model files written (the ONNX model first)."""
        if self.unchanged and self.source_file is not None and not external_data:
            copy_model_file(self.source_file, path)
        elif fp32_nodes(self.model_proto) is not None:
            xml = save_marked(self.model_proto, path, external_data=external_data)
            return [Path(path), xml, xml.with_suffix(".bin")]
        else:
            save_model(ir.from_proto(self.model_proto), path, external_data=external_data)
        return [Path(path)]

    @property
    def metadata(self) -> dict[str, str]:
        """The ``metadata_props`` fields written (none for the input unchanged)."""
        return {} if self.unchanged else runtime_metadata(self.runtime)

    @property
    def versus(self) -> str:
        """The ratio column's heading: ``vs ORT FP32``, or on a GPU device the input
        there (``vs fp32-cuda``), the first row of the table."""
        base = self.table[0].name if self.table else BASELINE
        return "vs ORT FP32" if base == BASELINE else f"vs {base}"

    def format_table(self) -> str:
        """The table, one candidate a line, under a header."""
        head = f"{'candidate':<19} {'runtime':<9} {self.versus:>19} {'rounds':>6}  "
        head += f"{'accuracy':<46} verdict"
        where = [self.timed_at.text()] if self.timed_at is not None else []
        return "\n".join([head, *(format_row(r) for r in self.table), *where])

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict: the winner, its runtime and metadata, and the table."""
        return {
            "winner": self.winner,
            "unchanged": self.unchanged,
            "runtime": self.runtime.name,
            "device": self.runtime.provider or "cpu",
            "metadata": self.metadata,
            "summary": self.summary,
            "candidates": [r.to_dict() for r in self.table],
            "notes": list(self.notes),
            "control": None if self.control is None else dataclasses.asdict(self.control),
            "timed_at": None if self.timed_at is None else self.timed_at.to_dict(),
            "head_to_head": None if self.head_to_head is None else self.head_to_head.to_dict(),
        }


def format_row(row: Row) -> str:
    """``fp32-openvino       openvino        0.74x     15  top-1 1 on 'probs' (...)  wins``."""
    ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
    if row.timing is not None:
        ratio = row.timing.shown
    rounds = "-" if row.timing is None else str(row.timing.rounds)
    accuracy = accuracy_text(row.checks) or "-"
    verdict = f"{row.verdict}: {row.reason}" if row.reason else row.verdict
    return f"{row.name:<19} {row.runtime:<9} {ratio:>19} {rounds:>6}  {accuracy:<46} {verdict}"
