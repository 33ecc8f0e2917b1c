"""Processes of a batch as ``/proc`` shows them (Linux), for the tests that kill a driver:
its workers and their janitors, whether a pid still runs, and a stand-in ``dot`` that
never returns."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

#: A stand-in for Graphviz ``dot`` whose layout never returns and that ignores SIGTERM;
#: each one started appends its pid to the file ``$STUCK_DOT_PIDS`` names.
STUCK_DOT = """#!/bin/sh
if [ "$1" = "-V" ]; then echo "dot - graphviz version 0.0 (stand-in)" >&2; exit 0; fi
echo $$ >> "$STUCK_DOT_PIDS"
trap '' TERM
exec sleep 3600
"""


#: How long a test waits for something it expects within seconds, before it fails saying
#: what never happened: a safety net against a hang, never the thing under test.
SAFETY_S = 300.0


def wait_for(condition: Callable[[], object], seconds: float) -> bool:
    """Whether ``condition()`` became true within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().split(") ")[1][0]
    except OSError:
        return False
    return state != "Z"


def workers_writing_to(out: Path) -> dict[int, Path]:
    """The live batch workers whose staging folder is in ``out`` (whoever started them:
    the local engine or a Ray worker), each with its private folder."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = _argv(entry)
            if "mixprec.batch.worker" not in argv or not alive(int(entry.name)):
                continue
            job_file = Path(argv[argv.index("mixprec.batch.worker") + 1])
            staging = Path(json.loads(job_file.read_text())["staging"])
        except (OSError, ValueError, IndexError, KeyError):
            continue
        if staging.parent == out:
            found[int(entry.name)] = job_file.parent
    return found


def _argv(entry: Path) -> list[str]:
    return (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")


def janitors_of(*folders: Path) -> list[int]:
    """Pids of the live batch janitors that watch any of ``folders`` (a worker's private
    or staging folder)."""
    wanted = {str(f) for f in folders}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = _argv(entry)
        except OSError:
            continue
        is_janitor = len(argv) > 2 and argv[2].endswith("janitor.py")
        if is_janitor and wanted & set(argv[3:]) and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def janitors_done(*folders: Path) -> None:
    """Waits until no janitor watches ``folders`` (each ends once its worker's parent is
    gone and it has cleaned up); fails past :data:`SAFETY_S`."""
    left = lambda: not janitors_of(*folders)  # noqa: E731
    assert wait_for(left, SAFETY_S), f"janitors {janitors_of(*folders)} never ended"


def stuck_dot(folder: Path) -> tuple[dict[str, str], Path]:
    """An environment whose PATH finds :data:`STUCK_DOT` first, and the file where each
    started stand-in writes its pid."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "dot"
    exe.write_text(STUCK_DOT)
    exe.chmod(0o755)
    pids = folder / "pids"
    pids.touch()
    env = {**os.environ, "PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}
    return {**env, "STUCK_DOT_PIDS": str(pids)}, pids
