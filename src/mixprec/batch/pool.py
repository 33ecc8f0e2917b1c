"""The engine interface of ``mixprec batch``: where the worker processes run.

An engine gets the jobs, the output folder, a :class:`Plan` and a callback; it runs one
:class:`~mixprec.batch.process.WorkerProcess` per job and hands each row to the callback
as it arrives. When interrupted (``KeyboardInterrupt``) it stops every running worker
before it re-raises; the models those workers held get no row, so ``--resume`` redoes
them. A new engine (Dask, Slurm) is one module with one class of this shape, added to
:data:`mixprec.batch.run.ENGINES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mixprec.batch.jobs import Job

__all__ = ["Engine", "OnRow", "Plan"]

OnRow = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Plan:
    """How many models run at a time, ORT threads per worker (a job's own options say
    how long it may take)."""

    workers: int
    threads: int


class Engine(Protocol):
    """Runs the jobs; each finished row goes to ``on_row``."""

    def run(self, jobs: Sequence[Job], out_dir: Path, plan: Plan, on_row: OnRow) -> None: ...
