"""A batch worker's janitor: cleans up after a worker that was killed outright.

A worker cleans up after itself when it is stopped (SIGTERM) or its parent dies
(:mod:`mixprec.batch.worker`), but not when it is killed with SIGKILL, and a Ray worker
that is cancelled by force, or whose driver died, SIGKILLs its children on its way out.
So each worker starts this janitor (``python -I janitor.py FD PARENT STAGING [PRIVATE]``,
run by path: standard library only, no import of mixprec) in the worker's process group,
with the read end of a pipe whose write end only the worker holds. When the worker ends, for
whatever reason, the janitor reads end-of-file; if the worker's parent is gone then too
(or goes within :data:`WAIT_S`), nobody else will clean up: it removes the staging and
private folders and kills the process group, the worker's children (a layout ``dot``) and
itself. While the parent lives, the parent cleans up (and kills the group, janitor
included).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

#: Seconds the janitor waits, once the worker is gone, for its parent to go too.
WAIT_S = 30.0


def alive(pid: int) -> bool:
    """Whether ``pid`` exists (a zombie still does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_the_end(fd: int) -> None:
    """Block until every write end of the pipe ``fd`` is closed (the worker ended)."""
    while True:
        try:
            if not os.read(fd, 1):
                return
        except InterruptedError:
            continue


def clean_up(parent: int, folders: list[str], worker: int) -> bool:
    """Once the worker is gone: whether its parent went too (within :data:`WAIT_S`), in
    which case ``folders`` are removed and the worker's process group is killed."""
    deadline = time.monotonic() + WAIT_S
    while alive(parent):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    if os.getpgrp() == worker:  # never the group of whoever ran the worker by hand
        os.killpg(worker, signal.SIGKILL)
    return True


def main(argv: list[str]) -> int:
    fd, parent, folders = int(argv[0]), int(argv[1]), argv[2:]
    worker = os.getppid()
    wait_for_the_end(fd)
    clean_up(parent, folders, worker)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
