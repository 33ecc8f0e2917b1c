"""One model of a batch, in its own process: ``python -m mixprec.batch.worker JOB RESULT``.

The worker converts, quantizes, tunes or optimizes (:mod:`mixprec.batch.optimize_job`)
the job's model through :mod:`mixprec.api`,
validates it when asked, and writes the model and its report page into its staging
folder (inside the output folder, same file system); the parent moves them into place
(:mod:`mixprec.batch.process`). It writes its row as JSON to ``RESULT``.

It dies with its parent: on Linux the kernel sends it SIGHUP when the parent exits
(``PR_SET_PDEATHSIG``), and a watchdog thread checks the parent everywhere; either way it
removes its staging folder before it exits. The worker leads its own process group (the
parent starts it in a new session): when the parent is gone it also removes its private
folder (job, log) and kills the whole group, itself and any child it waits on (Graphviz
``dot``), so a ``kill -9`` of the driver leaves no process and no file behind, even while
the worker is blocked in a child or in an ONNX Runtime run. A worker killed outright
(SIGKILL: a Ray worker cancelled by force kills its children so) along with its parent, or
one whose parent dies before it could set any of this up (while it imports), is cleaned
up after by the janitor its parent started (:mod:`mixprec.batch.janitor`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import resource
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mixprec.api.convert import convert
from mixprec.api.quantize import quantize
from mixprec.api.tune import tune
from mixprec.api.validate import validate
from mixprec.batch.jobs import model_bytes
from mixprec.batch.optimize_job import optimize_row
from mixprec.batch.results import validation_summary
from mixprec.core.config import BATCH_PARENT_ENV
from mixprec.core.errors import MixprecError
from mixprec.core.jsonio import json_text
from mixprec.inputs.feeds import iter_calibration_npz
from mixprec.io.models import load_model
from mixprec.report.html import write_report_html

__all__ = ["UNCHECKED", "main", "real_data", "run_job"]

#: Why an ``unchecked`` row is not ``ok``.
UNCHECKED = (
    "INT8 not checked on real data: calibrated and checked on generated inputs only; "
    "put NAME.calib.npz or NAME.eval.npz beside the model (or give --calibration-data, "
    "--eval-data, or --inputs with --validate)"
)

_PR_SET_PDEATHSIG = 1
#: The signal the kernel sends the worker when its parent dies (not SIGTERM, which is how
#: a live parent stops it): the worker then also takes its private folder and its group.
_PARENT_GONE = signal.SIGHUP


def _samples(path: str | None, model: str) -> list[dict[str, Any]] | None:
    return None if not path else list(iter_calibration_npz(path, load_model(model)))


def _stream(path: str | None, model: str) -> Iterator[dict[str, Any]] | None:
    """Calibration samples read one at a time (as ``--calibration-data``)."""
    return None if not path else iter_calibration_npz(path, load_model(model))


def _result(job: dict[str, Any]) -> tuple[Any, bool]:
    """The converted model and whether its own check (tune budget, INT8 guard) passed."""
    opts, source = job["options"], job["source"]
    calib = opts["calibration_data"]
    if opts["tune"]:
        data = calib or opts["inputs"]
        tuned = tune(
            source,
            opts["dtype"],
            _samples(data, source),
            metric=opts["metric"],
            budget=opts["budget"],
            **opts["policy"],
        )
        return tuned, bool(tuned.passed)
    if opts["dtype"] == "int8":
        result = quantize(
            source,
            _stream(calib, source),
            eval_data=opts["eval_data"] or None,
            runtime=opts["runtime"],
            **opts["policy"],
        )
        guard = result.report.guard
        return result, guard is None or bool(guard.get("passed"))
    result = convert(
        source, opts["dtype"], calibration_data=_stream(calib, source), **opts["policy"]
    )
    return result, True


def _validation(job: dict[str, Any], result: Any) -> dict[str, Any] | None:
    opts = job["options"]
    if not opts["validate"]:
        return None
    report = validate(
        job["source"],
        result.model,
        inputs=_samples(opts["inputs"], job["source"]),
        shapes=result.report.input_shapes,
        rtol=opts["rtol"],
        runtime=opts["runtime"],
    )
    result.report.validation = {**report.to_dict(), "table": report.format_table()}
    return validation_summary(report)


def real_data(options: dict[str, Any]) -> bool:
    """Whether the model's checks ran on real samples: calibration or eval data (the INT8
    guard's), or validation or tuning on given inputs."""
    checked_inputs = options["inputs"] and (options["validate"] or options["tune"])
    return bool(options["calibration_data"] or options["eval_data"] or checked_inputs)


def _status(job: dict[str, Any], passed: bool) -> str:
    """``ok``; ``failed``; ``unchecked`` for an INT8 model that passed checks made on
    generated inputs only (calibrated on one synthetic sample: nobody knows its accuracy)."""
    if not passed:
        return "failed"
    unchecked = job["options"]["dtype"] == "int8" and not real_data(job["options"])
    return "unchecked" if unchecked else "ok"


def run_job(job: dict[str, Any], staging: Path) -> dict[str, Any]:
    """Run ``job``; its files go under ``staging`` at their output paths; its row."""
    if job["options"].get("optimize"):
        return optimize_row(job, staging)
    start = time.perf_counter()
    result, own_check = _result(job)
    validation = _validation(job, result)
    passed = own_check and (validation is None or validation["passed"])
    report = result.report
    output = staging / job["output"]
    output.parent.mkdir(parents=True, exist_ok=True)
    page = output.with_suffix(".html")
    title = f"mixprec batch: {job['name']}"
    write_report_html(result.model, page, report=report, title=title, converted=True)
    row: dict[str, Any] = {
        "status": _status(job, passed),
        "real_data": real_data(job["options"]),
        "report": Path(job["output"]).with_suffix(".html").as_posix(),
        "low_mac_share": round(report.low_mac_share, 6),
        "casts": report.casts_after,
        "casts_inserted": report.casts_inserted,
        "bytes_before": model_bytes(Path(job["source"])),
        "unchanged": report.unchanged,
        "validation": validation,
    }
    if report.guard is not None:
        row["guard"] = {
            "passed": report.guard.get("passed"),
            "summary": report.guard.get("summary"),
        }
    if passed:
        result.save(output, external_data=bool(job["options"]["external_data"]))
        row["output"] = job["output"]
        row["bytes_after"] = model_bytes(output)
        if row["status"] == "unchecked":
            row["error"] = UNCHECKED
    else:
        row["error"] = _why_failed(row, result)
    row["convert_seconds"] = round(time.perf_counter() - start, 3)
    return row


def _why_failed(row: dict[str, Any], result: Any) -> str:
    if row.get("guard") and not row["guard"]["passed"]:
        return f"accuracy guard missed: {row['guard']['summary']}"
    if row["validation"] is not None and not row["validation"]["passed"]:
        return f"validation failed: worst rel L2 {row['validation']['worst_rel_l2']:.3g}"
    return f"tune budget missed ({getattr(result, 'metric', 'metric')})"


def _leave(staging: Path, private: Path | None, parent_gone: bool) -> None:
    """Remove the staging folder and exit; when the parent is gone, also remove the
    private folder and kill the worker's process group (its children, then itself)."""
    shutil.rmtree(staging, ignore_errors=True)
    if parent_gone:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        if os.getpgrp() == os.getpid():  # never the group of whoever ran us by hand
            os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(143)


def _die_with_parent(parent: int, staging: Path, private: Path | None) -> None:
    """SIGTERM (the parent stops the worker), :data:`_PARENT_GONE` (Linux: sent by the
    kernel when the parent dies) and a watchdog thread all end the worker (:func:`_leave`)."""

    leaving = threading.Lock()

    def leave(gone: bool) -> None:
        leaving.acquire()  # one thread cleans up and exits; a second one waits for that
        _leave(staging, private, gone or os.getppid() != parent)

    signal.signal(signal.SIGTERM, lambda *_: leave(False))
    signal.signal(_PARENT_GONE, lambda *_: leave(True))
    # A parent that blocked these in its thread hands the mask down: undo that.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, _PARENT_GONE])
    # The handlers themselves run in the main thread, which may sit in a long ONNX
    # Runtime run or wait on a child; the wakeup fd gets the signal's number at once,
    # from whichever thread took it, and a thread that waits on it leaves right away.
    readable, writable = os.pipe()
    os.set_blocking(writable, False)
    signal.set_wakeup_fd(writable)

    def on_signal() -> None:
        while (got := os.read(readable, 1)[0]) not in (signal.SIGTERM, _PARENT_GONE):
            pass
        leave(got == _PARENT_GONE)

    threading.Thread(target=on_signal, daemon=True, name="mixprec-sigterm").start()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, _PARENT_GONE, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        leave(True)

    if os.getppid() != parent:
        leave(True)
    threading.Thread(target=watch, daemon=True, name="mixprec-parent-watch").start()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    if isinstance(exc, MixprecError):
        return text[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class _Warnings(logging.Handler):
    """The model's warnings (mixprec's and the libraries'), one line each, for its row."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip().splitlines()
        line = text[0] if text else record.levelname
        if line not in self.lines and len(self.lines) < 20:
            self.lines.append(line)


def main(argv: list[str] | None = None) -> int:
    job_path, result_path = (argv if argv is not None else sys.argv[1:])[:2]
    job = json.loads(Path(job_path).read_text())
    staging = Path(job["staging"])
    private = Path(job["private"]) if job.get("private") else None
    parent = int(os.environ.get(BATCH_PARENT_ENV, os.getppid()))
    _die_with_parent(parent, staging, private)
    staging.mkdir()
    said = _Warnings()
    logging.getLogger().addHandler(said)
    logging.captureWarnings(True)  # warnings.warn calls become log records too
    try:
        row = run_job(job, staging)
    except MemoryError:
        row = {"status": "error", "error": "out of memory"}
    except Exception as exc:
        traceback.print_exc()
        row = {"status": "error", "error": _one_line(exc)}
    if said.lines:
        row["warnings"] = said.lines
    row["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json_text(row))  # the row as results.jsonl and --resume will hold it
    tmp.replace(result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
