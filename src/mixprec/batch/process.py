"""One worker process per model (:mod:`mixprec.batch.worker`): started, polled, timed
out or killed, and finished into a row. Both engines use it: the local engine keeps N of
them running from its main thread; a Ray task runs one and waits for it.

The worker writes into a staging folder inside the output folder (so the final rename
stays on one file system); :meth:`WorkerProcess.finish` moves its files into place and
removes the folder whatever happened, so no temporary file outlives a model.

Each worker leads its own process group. When it ends, the group is killed before the
worker is reaped (its pid still names the group then), so a child it left behind (a
layout ``dot``) ends with it; a worker past its grace period is killed with its group.

Before it makes the worker's private folder, the parent starts the worker's janitor
(:mod:`mixprec.batch.janitor`): should the parent die outright at any moment after that
(``kill -9``, a Ray worker killed with its children), the janitor kills the worker's
group and removes both folders.

A timeout counts from the moment the worker starts on its model (it has made its staging
folder), not from the process's start: importing mixprec takes seconds on a loaded
machine, which is not the model's time. A worker that has not started within
:data:`STARTUP_S` more is stopped too.
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
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from mixprec.batch.janitor import DONE, WORKER, alive
from mixprec.batch.jobs import Job
from mixprec.core.config import BATCH_PARENT_ENV, THREADS_ENV
from mixprec.core.errors import MixprecError

__all__ = [
    "GRACE_S",
    "STAGING_PREFIX",
    "STARTUP_S",
    "Janitor",
    "past_timeout",
    "sweep_staging",
]

#: Staging folders in the output folder start with this (and hold the driver's pid).
STAGING_PREFIX = ".mixprec-staging-"
#: Seconds a worker gets to leave after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Seconds a worker with a timeout may take to start on its model (imports), beyond it.
STARTUP_S = 120.0
_JANITOR = Path(__file__).with_name("janitor.py")


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def past_timeout(timeout: float, started: float, began: float | None, now: float) -> bool:
    """Whether a worker started at ``started`` is past ``timeout`` at ``now``: counted
    from ``began`` (when it began its model), or with :data:`STARTUP_S` more from
    ``started`` while it has not begun (None)."""
    if began is not None:
        return now - began > timeout
    return now - started > timeout + STARTUP_S


class Janitor:
    """The janitor of one worker (:mod:`mixprec.batch.janitor`), started and ready.

    Raises:
        MixprecError: it could not be started (it said nothing).
    """

    def __init__(self, folders: list[Path]) -> None:
        readable, self._pipe = os.pipe()
        try:
            first = subprocess.Popen(
                [sys.executable, "-I", str(_JANITOR), str(readable), *map(str, folders)],
                pass_fds=(readable,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                start_new_session=True,  # never in the group a terminal's Ctrl-C reaches
            )
        finally:
            os.close(readable)
        assert first.stdout is not None
        said = first.stdout.readline().split()  # "ready PID", from the process that stays
        first.stdout.close()
        first.wait()
        if len(said) != 2 or said[0] != b"ready":
            os.close(self._pipe)
            raise MixprecError("batch: the worker's janitor did not start")
        #: The janitor's pid (it lives until the worker's parent ends or says done).
        self.pid = int(said[1])

    def watch(self, worker: int) -> None:
        """The worker's pid: its group is killed if the parent dies."""
        self._say(f"{WORKER} {worker}")

    def done(self) -> None:
        """The parent has cleaned up: the janitor leaves without touching anything."""
        self._say(DONE)
        os.close(self._pipe)
        self._pipe = -1

    def _say(self, line: str) -> None:
        if self._pipe >= 0:
            os.write(self._pipe, f"{line}\n".encode())


class WorkerProcess:
    """A worker running ``job`` with ``threads`` ORT threads, writing under ``out_dir``;
    ``clock`` (seconds) times its timeout, the job's ``timeout`` option."""

    def __init__(
        self,
        job: Job,
        out_dir: Path,
        threads: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.out_dir = out_dir
        self.timeout: float | None = job.options.get("timeout")
        self.clock = clock
        self._private = Path(tempfile.gettempdir()) / f"mixprec-batch-{uuid.uuid4().hex[:12]}"
        # The worker creates it once it can clean it up (its SIGTERM handler is in place).
        self.staging = out_dir / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.janitor = Janitor([self._private, self.staging])
        self._private.mkdir(mode=0o700)  # job, result, log
        job_file = self._private / "job.json"
        # The worker's own input, not a user's: plain json.dumps, whose Infinity json.loads
        # reads back as a float (an --rtol of inf stays one; json_text would make it "inf").
        job_file.write_text(
            json.dumps(
                {**job.to_dict(), "staging": str(self.staging), "private": str(self._private)}
            )
        )
        self._result = self._private / "result.json"
        self._log: IO[bytes] = (self._private / "worker.log").open("wb")
        env = {
            **os.environ,
            THREADS_ENV: str(threads),
            "OMP_NUM_THREADS": str(threads),
            BATCH_PARENT_ENV: str(os.getpid()),
        }
        self.started = clock()
        #: When the worker started on its model (made its staging folder), once seen.
        self.began: float | None = None
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
        self.janitor.watch(self._proc.pid)
        self.timed_out = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> bool:
        """Whether the worker has ended (killed first when past its timeout)."""
        if self._ended():
            return True
        if self._past_timeout():
            self.timed_out = True
            self.stop()
            return True
        return False

    def _past_timeout(self) -> bool:
        if self.timeout is None:
            return False
        now = self.clock()
        if self.began is None and self.staging.exists():
            self.began = now
        return past_timeout(self.timeout, self.started, self.began, now)

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
        deadline = self.clock() + GRACE_S
        while not self._ended():
            if self.clock() > deadline:
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
        seconds = round(self.clock() - self.started, 3)
        try:
            row = self._row()
            if row.get("status") in ("ok", "unchecked", "failed"):
                self._move_into_place()
        finally:
            shutil.rmtree(self.staging, ignore_errors=True)
            self._log.close()
            shutil.rmtree(self._private, ignore_errors=True)
            self.janitor.done()
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
