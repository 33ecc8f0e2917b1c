"""A batch's ``optimize`` job (``mixprec batch --optimize``): one model through
:func:`mixprec.optimize`, in its worker process, on the data found for it.

The row says which candidate won, in which runtime, with which hints, at what latency
ratio to ONNX Runtime FP32 and accuracy; the zoo page shows those columns. The model is
written with its ``mixprec.runtime`` fields, its page is the optimize report page (the
candidate table above the chosen model's graph), and ``--validate`` checks the written
model in the runtime its fields name. A model without calibration data is an ``error``
row: optimize builds, checks and times every candidate on it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mixprec.api.optimize import optimize
from mixprec.api.validate import validate
from mixprec.batch.jobs import model_bytes
from mixprec.batch.results import validation_summary
from mixprec.core.errors import MixprecError
from mixprec.optimize.choice import accuracy_text
from mixprec.optimize.result import OptimizeResult
from mixprec.report.optimize_page import write_optimize_html

__all__ = ["NO_DATA", "optimize_row", "summary_of"]

#: Why an optimize job without calibration data cannot run.
NO_DATA = (
    "optimize needs calibration data: put NAME.calib.npz (or NAME.calib/) beside the model, "
    "or give --calibration-data"
)


def summary_of(result: OptimizeResult) -> dict[str, Any]:
    """What the row keeps of ``result``: the winner, its runtime, hints, ratio and
    accuracy, the last line, and each candidate's verdict and ratio."""
    won = next(r for r in result.table if r.name == result.winner)
    return {
        "winner": result.winner,
        "runtime": result.runtime.name,
        "hints": dict(won.hints) if not result.unchanged else {},
        "ratio": won.ratio,
        "accuracy": accuracy_text(won.checks),
        "unchanged": result.unchanged,
        "summary": result.summary,
        "candidates": [
            {"name": r.name, "verdict": r.verdict, "ratio": r.ratio, "reason": r.reason}
            for r in result.table
        ],
    }


def _validation(job: dict[str, Any], model: Any) -> dict[str, Any] | None:
    """``--validate``: the written model against the source, in the runtime its fields
    name (or the batch's ``runtime``)."""
    opts = job["options"]
    if not opts["validate"]:
        return None
    report = validate(
        job["source"], model, inputs=opts["inputs"] or None, rtol=opts["rtol"],
        runtime=opts["runtime"],
    )  # fmt: skip
    return validation_summary(report)


def optimize_row(job: dict[str, Any], staging: Path) -> dict[str, Any]:
    """Run ``job`` through optimize; its model and page go under ``staging`` at their
    output paths; its row."""
    start = time.perf_counter()
    opts = job["options"]
    if not opts["calibration_data"]:
        raise MixprecError(NO_DATA)
    result = optimize(
        job["source"],
        opts["calibration_data"],
        eval_data=opts["eval_data"] or None,
        runtime=opts["runtime"] or "auto",
        candidates=opts["candidates"],
    )
    validation = _validation(job, result.model_proto)
    passed = validation is None or bool(validation["passed"])
    output = staging / job["output"]
    output.parent.mkdir(parents=True, exist_ok=True)
    write_optimize_html(result, output.with_suffix(".html"), title=f"mixprec batch: {job['name']}")
    row: dict[str, Any] = {
        "status": "ok" if passed else "failed",
        "real_data": True,
        "report": Path(job["output"]).with_suffix(".html").as_posix(),
        "bytes_before": model_bytes(Path(job["source"])),
        "unchanged": result.unchanged,
        "optimize": summary_of(result),
        "validation": validation,
    }
    if passed:
        result.save(output, external_data=bool(opts["external_data"]))
        row["output"] = job["output"]
        row["bytes_after"] = model_bytes(output)
    else:
        worst = validation["worst_rel_l2"] if validation else 0.0
        row["error"] = f"validation failed: worst rel L2 {worst:.3g}"
    row["convert_seconds"] = round(time.perf_counter() - start, 3)
    return row
