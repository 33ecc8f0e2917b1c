"""A batch worker's janitor: cleans up after a worker whose parent died.

The parent of a worker (the local engine's driver, or the Ray worker that runs a task)
removes the worker's staging and private folders when the worker ends. When the parent
itself is killed outright (``kill -9`` of the driver; a Ray task cancelled by force, whose
Ray worker SIGKILLs its children and exits), nobody would. So the parent starts this
janitor before it makes the private folder or the worker
(``python -I janitor.py FD PRIVATE STAGING``, run by path: standard library only, no
import of mixprec, so it is up in a few tens of milliseconds).

The janitor leaves its parent's family at once: it forks, the first process exits, and the
second (reparented to init) is not among the parent's children, which Ray kills by parent
pid. It says ``ready PID`` on standard output, then reads the pipe ``FD``, whose write end
only the parent holds: ``worker PID`` once the worker runs, ``done`` once the parent has
cleaned up itself. End-of-file without ``done`` means the parent is gone: the janitor then
kills the worker's process group (the worker leads its own: its children, a layout
``dot``, go with it), removes both folders and exits. Nothing here waits on a clock: the
parent's end is the event, and a worker that started before the parent died is killed
whatever it was doing (still importing, before it could set up any handler of its own).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys

#: What the parent writes: the worker's pid, and that it has cleaned up itself.
WORKER, DONE = "worker", "done"


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie still does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_messages(fd: int) -> tuple[int | None, bool]:
    """Reads the pipe ``fd`` to its end: (the worker's pid, whether the parent said done)."""
    worker, done, pending = None, False, b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except InterruptedError:
            continue
        if not chunk:
            return worker, done
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            word, _, value = line.decode("ascii", "replace").partition(" ")
            if word == WORKER and value.isdigit():
                worker = int(value)
            done = done or word == DONE


def kill_group(worker: int) -> None:
    """SIGKILL to the process group ``worker`` leads (never a group it does not lead)."""
    try:
        if os.getpgid(worker) != worker:
            return
        os.killpg(worker, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    fd, folders = int(argv[0]), argv[1:]
    if os.fork() != 0:
        os._exit(0)  # the parent reaps this one; the second process lives on, under init
    os.write(1, f"ready {os.getpid()}\n".encode())
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):  # nothing of the parent's kept open
        os.dup2(devnull, std)
    worker, done = read_messages(fd)
    if done:
        return 0
    if worker is not None:
        kill_group(worker)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
