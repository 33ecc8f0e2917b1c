"""The ``ray`` engine: one Ray task per model on a Ray cluster (an existing one at
``address``, or a local one started for the batch). Each task runs the same worker
process as the local engine on its node, so rows and files are the same; the output
folder must be on storage that every node sees.

Every path a task gets (the model, its data, the output folder) is absolute: a Ray worker
runs in a folder of Ray's own. ``ray.init`` installs a SIGTERM handler of its own; the one
in force before (the batch's: SIGTERM stops the batch as Ctrl-C does) is put back. A task
cancelled by force, or whose driver died, loses its Ray worker process: the batch worker
it started then removes its private folder and ends with its children
(:mod:`mixprec.batch.worker`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec.batch.jobs import Job
from mixprec.batch.pool import OnRow, Plan
from mixprec.batch.process import WorkerProcess
from mixprec.core.errors import MixprecError

__all__ = ["RayEngine", "memory_estimate"]

#: A worker's memory: the interpreter and ORT, plus a few copies of the model.
_BASE_MEMORY = 400 * 2**20
_MODEL_COPIES = 6


def memory_estimate(job: Job) -> int:
    """Bytes a worker for ``job`` is expected to need (Ray's ``memory`` resource)."""
    return _BASE_MEMORY + _MODEL_COPIES * Path(job.source).stat().st_size


def _ray_task(job: dict[str, Any], out_dir: str, threads: int) -> dict:
    """One model on a Ray node: the same worker process as the local engine."""
    folder = Path(out_dir)
    if not (folder.is_dir() and os.access(folder, os.W_OK)):
        return {
            "model": job["name"],
            "source": job["source"],
            "status": "error",
            "error": f"the Ray worker on {socket.gethostname()} cannot write {out_dir}: "
            "the output folder must be on storage every node sees",
            "key": job["key"],
        }
    worker = WorkerProcess(Job(**job), folder, threads)
    worker.wait()
    return worker.finish()


def _ray(address: str | None) -> Any:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network call from a batch
    _token_mode_for(address)  # read when Ray starts: before the import
    try:
        import ray
    except ImportError as exc:
        raise MixprecError("--engine ray needs Ray: pip install 'mixprec[ray]'") from exc
    return ray


def _token_mode_for(address: str | None) -> None:
    """Ray (2.5x) sends its auth token to an explicit address only with RAY_AUTH_MODE=token,
    although ``ray start`` turns token auth on whenever ~/.ray/auth_token exists: without
    this, ``--ray-address HOST:PORT`` fails where ``auto`` connects (a cluster without
    auth accepts a token too)."""
    if not address or address == "auto" or "RAY_AUTH_MODE" in os.environ:
        return
    token = os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
    if token or (Path.home() / ".ray" / "auth_token").is_file():
        os.environ["RAY_AUTH_MODE"] = "token"


def _reachable(address: str) -> None:
    """A ``HOST:PORT`` address that nothing answers at fails at once (Ray itself retries
    for minutes)."""
    host, _, port = address.rpartition(":")
    if address.startswith("ray://") or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise MixprecError(
            f"Ray: nothing answers at {address} ({exc.strerror or exc}); start a head with "
            "'ray start --head' or give --ray-address auto"
        ) from exc


def _connect(ray: Any, address: str | None, cpus: int) -> None:
    """``ray.init``, with the SIGTERM handler that was in force before it put back."""
    if address:
        _reachable(address)
    handler = signal.getsignal(signal.SIGTERM)
    options = {"log_to_driver": False, "configure_logging": False}
    try:
        if address:
            ray.init(address=address, **options)
        else:
            # "local": a new cluster for this batch, even where another one runs
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise MixprecError(
            f"Ray: cannot connect to {address or 'a new local cluster'}: "
            f"{str(exc).strip().splitlines()[0]}"
        ) from exc
    finally:
        if handler is not None and signal.getsignal(signal.SIGTERM) is not handler:
            # (ValueError: not the main thread, where ray.init left it alone too)
            with contextlib.suppress(ValueError):
                signal.signal(signal.SIGTERM, handler)


class RayEngine:
    """One Ray task per job (``num_cpus`` = the plan's threads, ``memory`` from the
    model's size); a local cluster of ``workers * threads`` CPUs when no ``address``."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address

    def run(self, jobs: Sequence[Job], out_dir: Path, plan: Plan, on_row: OnRow) -> None:
        ray = _ray(self.address)
        out_dir = out_dir.absolute()
        _connect(ray, self.address, plan.workers * plan.threads)
        try:
            limit = float(ray.cluster_resources().get("memory", 0)) or None
            task = ray.remote(_ray_task)
            refs: dict[Any, Job] = {}
            for job in jobs:
                memory = memory_estimate(job)
                if limit is not None:
                    memory = min(memory, int(limit * 0.9))  # never a task no node can take
                options = {"num_cpus": plan.threads, "memory": memory, "max_retries": 0}
                args = (job.to_dict(), str(out_dir), plan.threads)
                refs[task.options(**options).remote(*args)] = job
            _collect(ray, refs, out_dir, on_row)
        finally:
            ray.shutdown()


def _collect(ray: Any, refs: dict[Any, Job], out_dir: Path, on_row: OnRow) -> None:
    try:
        while refs:
            # a short timeout: the driver's signal handlers run between the waits
            done, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            for ref in done:
                job = refs.pop(ref)
                on_row(_ray_row(ray, ref, job, out_dir))
    finally:
        for ref in refs:  # interrupted: the killed Ray workers take their processes along
            ray.cancel(ref, force=True)


def _ray_row(ray: Any, ref: Any, job: Job, out_dir: Path) -> dict[str, Any]:
    base = {"model": job.name, "source": job.source, "key": job.key, "data": dict(job.data)}
    try:
        row: dict[str, Any] = ray.get(ref)
    except ray.exceptions.RayError as exc:
        first = str(exc).strip().splitlines()
        return {**base, "status": "error", "error": f"Ray: {first[0] if first else exc}"}
    output = row.get("output")
    written = row.get("status") in ("ok", "unchecked")
    if written and output and not (out_dir / output).is_file():
        row.update(
            status="error",
            error=f"{row.get('host')} wrote {output}, which is not in {out_dir} here: "
            "the output folder must be on storage every node sees",
        )
    return row
