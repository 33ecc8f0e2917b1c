"""The ``local`` engine: a pool of worker processes on this machine, driven from the main
thread (a parent-death signal is tied to the thread that started the child, so workers
are never started from a helper thread)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from mixprec.batch.jobs import Job
from mixprec.batch.pool import OnRow, Plan
from mixprec.batch.process import WorkerProcess
from mixprec.core.errors import MixprecError

__all__ = ["LocalEngine"]


class LocalEngine:
    """``plan.workers`` worker processes at a time until every job has its row."""

    def __init__(self, address: str | None = None) -> None:
        if address:
            raise MixprecError("--ray-address needs --engine ray")

    def run(self, jobs: Sequence[Job], out_dir: Path, plan: Plan, on_row: OnRow) -> None:
        pending = list(reversed(jobs))
        running: list[WorkerProcess] = []
        try:
            while pending or running:
                while pending and len(running) < plan.workers:
                    job = pending.pop()
                    running.append(WorkerProcess(job, out_dir, plan.threads))
                for worker in [w for w in running if w.poll()]:
                    running.remove(worker)
                    on_row(worker.finish())
                time.sleep(0.05)
        finally:
            for worker in running:  # interrupted: stop them all, then wait for each
                worker.terminate()
            for worker in running:
                worker.stop()
                worker.finish()
