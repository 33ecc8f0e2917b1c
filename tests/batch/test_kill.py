"""A ``kill -9`` of the batch driver leaves no worker process and no staging file behind,
even while a worker waits on a child that never returns; Ctrl-C (SIGINT) keeps the
finished rows and exits 130; a report layout past its time limit falls back."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from batch_zoo import mlp, slow, write
from procs import SAFETY_S, alive, janitors_done, stuck_dot, wait_for

import mixprec
from mixprec.batch.process import STAGING_PREFIX
from mixprec.batch.results import read_rows
from mixprec.report import graph_layout
from mixprec.report.graph_layout import DOT_MAX_S, dot_time_limit

pytestmark = [
    pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)"),
    pytest.mark.slow,  # drivers and workers in their own processes, killed and awaited
]


def _workers_of(driver: int) -> list[int]:
    """Pids of the live batch workers started by ``driver``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        mine = f"MIXPREC_BATCH_PARENT={driver}".encode() in environ
        if b"mixprec.batch.worker" in cmdline and mine and state != "Z":
            found.append(int(entry.name))
    return found


def _start(zoo: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mixprec",
            "batch",
            str(zoo),
            "-o",
            str(out),
            "--workers",
            "2",
            "--validate",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_kill_9_of_the_driver_takes_its_workers_then_resume_redoes_only_the_rest(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "a_quick.onnx", mlp())
    write(zoo / "b_slow.onnx", slow())
    write(zoo / "c_slow.onnx", slow())
    out = tmp_path / "out"
    driver = _start(zoo, out)
    try:
        # a_quick done, and both slow models running in their workers (staging made)
        started = wait_for(
            lambda: len(read_rows(out)) == 1 and len(list(out.glob(f"{STAGING_PREFIX}*"))) == 2,
            SAFETY_S,
        )
        assert started, driver.stderr.read().decode() if driver.poll() is not None else "stuck"
        assert len(_workers_of(driver.pid)) == 2
        staged = list(out.glob(f"{STAGING_PREFIX}*"))
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        # each worker's janitor ends once it has killed the worker and cleaned up
        janitors_done(*staged)
        assert not _workers_of(driver.pid), "workers outlived the driver and its janitors"
        assert list(out.glob(f"{STAGING_PREFIX}*")) == []
        assert not (out / "b_slow.fp16.onnx").exists() and not (out / "c_slow.fp16.onnx").exists()
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _workers_of(driver.pid):
            os.kill(pid, signal.SIGKILL)
    # --resume: the finished model is not redone; the two cut short run again (here
    # into a short timeout: they never end by themselves)
    result = mixprec.batch(zoo, out, workers=2, validate=True, resume=True, timeout=1)
    statuses = {r["model"]: (r["status"], bool(r.get("resumed"))) for r in result.rows}
    assert statuses == {
        "a_quick.onnx": ("ok", True),
        "b_slow.onnx": ("timeout", False),
        "c_slow.onnx": ("timeout", False),
    }
    assert [r["model"] for r in read_rows(out)].count("a_quick.onnx") == 1


def test_ctrl_c_keeps_finished_rows_and_exits_130(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "a_quick.onnx", mlp())
    write(zoo / "b_slow.onnx", slow())
    out = tmp_path / "out"
    driver = _start(zoo, out)
    try:
        done = lambda: len(read_rows(out)) == 1  # noqa: E731
        assert wait_for(done, SAFETY_S), "the quick model never finished"
        driver.send_signal(signal.SIGINT)
        _, err = driver.communicate(timeout=SAFETY_S)
        assert driver.returncode == 130, err.decode()
        rows = read_rows(out)
        assert [r["model"] for r in rows] == ["a_quick.onnx"] and rows[0]["status"] == "ok"
        assert not _workers_of(driver.pid)
        assert list(out.glob(f"{STAGING_PREFIX}*")) == []
        assert (out / "index.html").is_file() and (out / "a_quick.fp16.onnx").is_file()
    finally:
        if driver.poll() is None:
            driver.kill()


def _private_folders(temp: Path) -> list[Path]:
    """The workers' private folders (job, log) in ``temp`` (ONNX Runtime leaves a file of
    its own there)."""
    return list(temp.glob("mixprec-batch-*"))


def test_kill_9_of_the_driver_takes_a_worker_stuck_in_a_child_and_the_child(tmp_path):
    """The worker is blocked in the report's layout (a ``dot`` that never returns and
    ignores SIGTERM): a ``kill -9`` of the driver still ends the worker and its child
    within seconds, and leaves no staging folder and no private temp folder."""
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    out, temp = tmp_path / "out", tmp_path / "temp"
    temp.mkdir()
    env, pids = stuck_dot(tmp_path / "bin")
    env["TMPDIR"] = str(temp)
    driver = subprocess.Popen(
        [sys.executable, "-m", "mixprec", "batch", str(zoo), "-o", str(out), "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    children: list[int] = []
    try:
        assert wait_for(lambda: pids.read_text().strip() != "", SAFETY_S), "dot never started"
        children = [int(p) for p in pids.read_text().split()]
        assert len(_workers_of(driver.pid)) == 1 and _private_folders(temp)
        staged = [*_private_folders(temp), *out.glob(f"{STAGING_PREFIX}*")]
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        janitors_done(*staged)
        assert not _workers_of(driver.pid), "the worker outlived the driver"
        assert wait_for(lambda: not any(alive(p) for p in children), SAFETY_S), "dot outlived it"
        assert list(out.glob(f"{STAGING_PREFIX}*")) == []
        assert _private_folders(temp) == [], "the worker's private temp folder was left"
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in [*_workers_of(driver.pid), *[p for p in children if alive(p)]]:
            os.kill(pid, signal.SIGKILL)


#: A parent of one worker, as a Ray task is: it starts the worker and says its pid.
_PARENT = """
import sys, time
from pathlib import Path
from mixprec.batch.jobs import find_jobs
from mixprec.batch.process import WorkerProcess
(job,) = find_jobs([sys.argv[1]], {}, Path(sys.argv[2]))
worker = WorkerProcess(job, Path(sys.argv[2]), 1)
print(worker.pid, flush=True)
time.sleep(3600)
"""


def test_a_parent_killed_while_its_worker_starts_leaves_no_folder(tmp_path):
    """A Ray task cancelled by force: its Ray worker SIGKILLs its children (the batch
    worker) and exits. Here both die at once, right after the worker was started, while
    it is still importing (before any handler of its own is set up): the janitor the
    parent started removes the private folder and the staging folder's place stays empty.
    (The full suite's Ray SIGTERM test once found the private folder left this way.)"""
    model = write(tmp_path / "zoo" / "m.onnx", slow())
    out, temp = tmp_path / "out", tmp_path / "temp"
    out.mkdir()
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(model), str(out)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        staged = _private_folders(temp)
        assert len(staged) == 1, staged
        os.kill(worker, signal.SIGKILL)
        parent.kill()
        parent.wait()
        janitors_done(*staged)
        assert wait_for(lambda: not alive(worker), SAFETY_S), "the worker outlived its parent"
        assert _private_folders(temp) == [], "the worker's private temp folder was left"
        assert list(out.iterdir()) == []
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_layout_past_its_time_limit_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    """``dot`` gets a time limit that grows with the graph; past it, the stand-in is
    killed and the simple layout is used, with a warning and the page's engine line."""
    assert dot_time_limit(10, 9) < dot_time_limit(5000, 8000) < dot_time_limit(10**6, 10**6)
    assert dot_time_limit(10**6, 10**6) == DOT_MAX_S
    env, pids = stuck_dot(tmp_path / "bin")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("STUCK_DOT_PIDS", env["STUCK_DOT_PIDS"])
    monkeypatch.setattr(graph_layout, "DOT_BASE_S", 0.5)  # the default limit, made short
    monkeypatch.setattr(graph_layout, "DOT_PER_ITEM_S", 0.1)
    with caplog.at_level(logging.WARNING, logger="mixprec.report.graph_layout"):
        found = graph_layout.layout_graph([60.0] * 3, [20.0] * 3, [(0, 1), (1, 2)])
    # only the limit's timeout ends the stand-in (it sleeps an hour): the layout is back
    assert found.engine == "layered (graphviz dot took more than 1 s for 3 nodes)"
    assert found.notes and "graphviz dot took more than 1 s" in caplog.text
    started = [int(p) for p in pids.read_text().split()]
    assert started and not any(alive(p) for p in started)
    assert len(found.x) == 3 and found.height > 0
