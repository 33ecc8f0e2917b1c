"""What every API call does around its pipeline: say "loading", load the input and time
it, then put the load time first in the report's timings and write the log dir. One home
for :func:`~mixprec.convert`, :func:`~mixprec.quantize` and its ``weights=`` face."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir

from mixprec.io.models import ModelLike, load_input
from mixprec.pipeline.report import Report
from mixprec.report.logdir import write_log_dir

__all__ = ["finish", "load"]


def load(
    model: ModelLike,
    base_dir: str | os.PathLike[str] | None,
    progress: Callable[[str], None] | None,
) -> tuple[ir.Model, str, float]:
    """The input loaded (:func:`~mixprec.io.models.load_input`), its kind and the seconds
    it took, "loading" said first."""
    t0 = time.perf_counter()
    if progress is not None:
        progress("loading")
    work, kind = load_input(model, base_dir)
    return work, kind, time.perf_counter() - t0


def finish(
    report: Report,
    load_s: float,
    log_dir: Path | None,
    before: onnx.ModelProto | None,
    after: ir.Model,
) -> None:
    """The load time first in ``report.timings``; the log dir written (``log_dir`` given,
    with the input as it was, ``before``)."""
    report.timings = {"load": load_s, **report.timings}
    if log_dir is not None and before is not None:
        write_log_dir(log_dir, before, after, report)
