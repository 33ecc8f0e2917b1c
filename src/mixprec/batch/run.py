""":func:`batch`: convert, quantize, tune or optimize every model that the sources name, each in its
own worker process, on a local pool or a Ray cluster; resumable; rows appended to
``OUTDIR/results.jsonl`` as models finish; the zoo page ``OUTDIR/index.html``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mixprec.batch.jobs import OPTION_NAMES, Job, find_jobs
from mixprec.batch.local import LocalEngine
from mixprec.batch.page import write_page
from mixprec.batch.pool import Engine, Plan
from mixprec.batch.process import sweep_staging
from mixprec.batch.ray_engine import RayEngine
from mixprec.batch.results import BatchResult, append_row, latest, read_rows, still_good
from mixprec.core.errors import MixprecError

__all__ = ["ENGINES", "batch", "cpu_count"]

#: Engine name -> its class (constructed with the cluster address, or None).
ENGINES: dict[str, Callable[[str | None], Engine]] = {"local": LocalEngine, "ray": RayEngine}


def cpu_count() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM to the driver ends the batch the way Ctrl-C does."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave SIGTERM alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _checked(engine: str, workers: int | None, timeout: float | None) -> int:
    if engine not in ENGINES:
        raise MixprecError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    if workers is not None and workers < 1:
        raise MixprecError(f"workers must be >= 1 (got {workers})")
    if timeout is not None and timeout <= 0:
        raise MixprecError(f"timeout must be > 0 seconds (got {timeout})")
    return workers or cpu_count()


def _out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """The output folder, made if needed, as an absolute path (workers may run in another
    folder, or on other nodes)."""
    given = Path(out_dir)
    folder = given.absolute()
    if folder.exists() and not folder.is_dir():
        raise MixprecError(f"{given}: exists and is not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MixprecError(f"{given}: cannot create the output folder ({exc.strerror})") from exc
    if not os.access(folder, os.W_OK):
        raise MixprecError(f"{given}: the output folder is not writable")
    return folder


def batch(
    sources: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    workers: int | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    resume: bool = False,
    timeout: float | None = None,
    progress: Callable[[dict[str, Any], int, int], None] | None = None,
    allow_unchecked: bool = False,
    **options: Any,
) -> BatchResult:
    """Convert (fp16/bf16), quantize (int8), tune or optimize every model ``sources`` name.

    Args:
        sources: ``.onnx`` files, folders (searched recursively) and TOML manifests
            (format: :mod:`mixprec.batch.jobs`).
        out_dir: each model's result goes to its relative path here
            (``sub/name.fp16.onnx``, its report page ``sub/name.fp16.html`` beside it),
            with ``results.jsonl`` and the zoo page ``index.html``.
        workers: models at a time (default: the cores); each worker's ONNX Runtime gets
            cores / workers threads, so the workers never oversubscribe the cores.
        engine: "local" (a process pool here) or "ray" (one Ray task per model).
        ray_address: the Ray cluster ("auto", "ray://host:port"); None starts a local one.
        resume: skip the models whose last row is ``ok`` for the same source bytes, data
            and options (and whose output is still there); redo the rest.
        timeout: seconds a model may take, counted from when its worker starts on it; past
            it, its worker is killed (a ``timeout`` row). A manifest entry's ``timeout``
            overrides it for that model.
        progress: called with each row as it arrives, the rows done and the total.
        allow_unchecked: an INT8 model checked on no real data (no calibration, eval or
            validation samples: calibrated on one generated sample) is an ``unchecked``
            row, which makes the exit code 1 unless this is set.
        **options: ``dtype`` ("fp16", "bf16", "int8"), ``validate``, ``rtol``, ``tune``,
            ``budget``, ``metric``, ``calibration_data``, ``inputs``, ``eval_data``,
            ``external_data``, ``runtime``, ``exclude`` (node-name regexes) and ``policy``
            (a dict of :func:`mixprec.convert` or :func:`mixprec.quantize` options); or
            ``optimize=True`` with ``candidates`` (names, or one comma-separated string):
            each model through :func:`mixprec.optimize` (``NAME.optimized.onnx``; see
            :mod:`mixprec.batch.optimize_job`). Per model, a manifest entry and the data
            found beside the model override them.

    Returns:
        A :class:`BatchResult`; ``exit_code`` 0 when every model is ``ok``, 1 when some
        failed, errored, timed out or went unchecked (unless allowed), 130 when
        interrupted (the rows so far are kept).
    """
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise MixprecError(
            f"unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTION_NAMES)}"
        )
    count = _checked(engine, workers, timeout)
    runner = ENGINES[engine](ray_address)
    folder = _out_dir(out_dir)
    sweep_staging(folder)
    paths = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    given = options if timeout is None else {**options, "timeout": timeout}
    jobs = find_jobs(paths, given, folder)
    plan = Plan(workers=count, threads=max(1, cpu_count() // count))
    result = _run(jobs, folder, (engine, runner), plan, resume, progress)
    result.allow_unchecked = allow_unchecked
    return result


def _run(
    jobs: list[Job],
    folder: Path,
    engine: tuple[str, Engine],
    plan: Plan,
    resume: bool,
    progress: Callable[[dict[str, Any], int, int], None] | None,
) -> BatchResult:
    earlier = latest(read_rows(folder)) if resume else {}
    rows: dict[str, dict[str, Any]] = {}
    result = BatchResult(folder)

    def on_row(row: dict[str, Any]) -> None:
        if not row.get("resumed"):
            row["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            row["engine"] = engine[0]
            append_row(folder, row)
        rows[row["model"]] = row
        if progress is not None:
            progress(row, len(rows), len(jobs))

    for job in jobs:
        if still_good(job, earlier.get(job.name), folder):
            on_row({**earlier[job.name], "resumed": True})
    todo = [j for j in jobs if j.name not in rows]
    try:
        with _sigterm_interrupts():
            engine[1].run(todo, folder, plan, on_row)
    except KeyboardInterrupt:
        result.interrupted = True
    result.rows = [rows[j.name] for j in jobs if j.name in rows]
    title = f"mixprec batch: {len(jobs)} model(s) in {folder.name or folder}"
    result.page = write_page(folder, result.rows, title)
    return result
