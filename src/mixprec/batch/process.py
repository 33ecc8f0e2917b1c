"""One worker process per model (:mod:`mixprec.batch.worker`): started, polled, timed
out or killed, and finished into a row. Both engines use it: the local engine keeps N of
them running from its main thread; a Ray task runs one and waits for it.

The worker writes into a staging folder inside the output folder (so the final rename
stays on one file system); :meth:`WorkerProcess.finish` moves its files into place and
removes the folder whatever happened, so no temporary file outlives a model.

Each worker leads its own process group. When it ends, the group is killed before the
worker is reaped (its pid still names the group then), so a child it left behind (a
layout ``dot``) ends with it; a worker past its grace period is killed with its group.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from mixprec.batch.janitor import alive
from mixprec.batch.jobs import Job
from mixprec.core.config import BATCH_PARENT_ENV, THREADS_ENV

__all__ = ["STAGING_PREFIX", "WorkerProcess", "sweep_staging"]

#: Staging folders in the output folder start with this (and hold the driver's pid).
STAGING_PREFIX = ".mixprec-staging-"
#: Seconds a worker gets to leave after SIGTERM before SIGKILL.
GRACE_S = 5.0


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class WorkerProcess:
    """A worker running ``job`` with ``threads`` ORT threads, writing under ``out_dir``."""

    def __init__(self, job: Job, out_dir: Path, threads: int, timeout: float | None) -> None:
        self.job = job
        self.out_dir = out_dir
        self.timeout = timeout
        self._private = Path(tempfile.mkdtemp(prefix="mixprec-batch-"))  # job, result, log
        # The worker creates it once it can clean it up (its SIGTERM handler is in place).
        self.staging = out_dir / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        job_file = self._private / "job.json"
        job_file.write_text(
            json.dumps(
                {**job.to_dict(), "staging": str(self.staging), "private": str(self._private)}
            )
        )
        self._result = self._private / "result.json"
        self._log = (self._private / "worker.log").open("wb")
        env = {
            **os.environ,
            THREADS_ENV: str(threads),
            "OMP_NUM_THREADS": str(threads),
            BATCH_PARENT_ENV: str(os.getpid()),
        }
        self.started = time.monotonic()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "mixprec.batch.worker", str(job_file), str(self._result)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            # its own session and process group: Ctrl-C reaches the driver, which stops
            # the workers; the group is how a worker's children are ended with it
            start_new_session=True,
        )
        self.timed_out = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> bool:
        """Whether the worker has ended (killed first when past its timeout)."""
        if self._ended():
            return True
        if self.timeout is not None and time.monotonic() - self.started > self.timeout:
            self.timed_out = True
            self.stop()
            return True
        return False

    def wait(self) -> None:
        """Block until the worker ends or passes its timeout."""
        while not self.poll():
            time.sleep(0.05)

    def terminate(self) -> None:
        """Ask the worker to leave (SIGTERM); it removes its staging folder and exits."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its group after :data:`GRACE_S`; returns once it is
        gone, with its children."""
        self.terminate()
        deadline = time.monotonic() + GRACE_S
        while not self._ended():
            if time.monotonic() > deadline:
                self._kill_group()
                self._proc.wait()
                return
            time.sleep(0.05)

    def _ended(self) -> bool:
        """Whether the worker has exited; its group is killed before it is reaped."""
        if self._proc.returncode is not None:
            return True
        try:
            flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
            if os.waitid(os.P_PID, self._proc.pid, flags) is None:
                return False
        except ChildProcessError:  # reaped already: nothing names the group any more
            self._proc.poll()
            return True
        self._kill_group()  # a zombie leader: its pid cannot name another group yet
        self._proc.wait()
        return True

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)

    def finish(self) -> dict[str, Any]:
        """The job's row; the files of an ``ok`` or ``unchecked`` model (and the report
        page of a ``failed`` one) moved into the output folder."""
        seconds = round(time.monotonic() - self.started, 3)
        try:
            row = self._row()
            if row.get("status") in ("ok", "unchecked", "failed"):
                self._move_into_place()
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._log.close()
            shutil.rmtree(self._private, ignore_errors=True)
        return {
            "model": self.job.name,
            "source": self.job.source,
            **row,
            "seconds": seconds,
            "dtype": self.job.options["dtype"],
            "data": dict(self.job.data),
            "key": self.job.key,
            "host": socket.gethostname(),
        }

    def _row(self) -> dict[str, Any]:
        if self.timed_out:
            return {"status": "timeout", "error": f"stopped after the {self.timeout:g} s timeout"}
        code = self._proc.returncode
        if self._result.exists():
            row: dict[str, Any] = json.loads(self._result.read_text())
            return row
        if code is not None and code < 0:
            name = _signal_name(code)
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return {"status": "error", "error": f"worker died of {name}{hint}"}
        return {"status": "error", "error": f"worker exited {code}: {self._last_log_line()}"}

    def _last_log_line(self) -> str:
        self._log.flush()
        try:
            text = (self._private / "worker.log").read_text(errors="replace")
        except OSError:
            return "no output"
        lines = text.strip().splitlines()
        return lines[-1] if lines else "no output"

    def _move_into_place(self) -> None:
        for path in sorted(self.staging.rglob("*")):
            if path.is_file():
                target = self.out_dir / path.relative_to(self.staging)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)


def sweep_staging(out_dir: Path) -> None:
    """Remove staging folders left by a driver that no longer runs (a ``kill -9`` between
    a worker's exit and the move)."""
    for path in out_dir.glob(f"{STAGING_PREFIX}*"):
        pid = path.name[len(STAGING_PREFIX) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
