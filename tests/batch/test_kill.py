"""A ``kill -9`` of the batch driver leaves no worker process and no staging file behind,
even while a worker waits on a child that never returns; Ctrl-C (SIGINT) keeps the
finished rows and exits 130; a report layout past its time limit falls back."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_zoo import mlp, slow, write
from procs import alive, stuck_dot, wait_for

import mixprec
from mixprec.batch.process import STAGING_PREFIX
from mixprec.batch.results import read_rows
from mixprec.report import layout
from mixprec.report.layout import DOT_MAX_S, dot_time_limit

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")


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
            90,
        )
        assert started, driver.stderr.read().decode() if driver.poll() is not None else "stuck"
        assert len(_workers_of(driver.pid)) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        # 60 s: the janitor polls; at load 10 on 2 cores 15 s was once too short
        assert wait_for(lambda: not _workers_of(driver.pid), 60), "workers outlived the driver"
        assert list(out.glob(f"{STAGING_PREFIX}*")) == []
        assert not (out / "b_slow.fp16.onnx").exists() and not (out / "c_slow.fp16.onnx").exists()
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _workers_of(driver.pid):
            os.kill(pid, signal.SIGKILL)
    # --resume: the finished model is not redone; the two cut short run again (here
    # into a short timeout, to keep the test short)
    result = mixprec.batch(zoo, out, workers=2, validate=True, resume=True, timeout=2)
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
        assert wait_for(lambda: len(read_rows(out)) == 1, 60), "the quick model never finished"
        driver.send_signal(signal.SIGINT)
        _, err = driver.communicate(timeout=30)
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
        assert wait_for(lambda: pids.read_text().strip() != "", 60), "dot never started"
        children = [int(p) for p in pids.read_text().split()]
        assert len(_workers_of(driver.pid)) == 1 and _private_folders(temp)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert wait_for(lambda: not _workers_of(driver.pid), 15), "the worker outlived the driver"
        assert wait_for(lambda: not any(alive(p) for p in children), 5), "dot outlived it"
        assert list(out.glob(f"{STAGING_PREFIX}*")) == []
        assert _private_folders(temp) == [], "the worker's private temp folder was left"
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in [*_workers_of(driver.pid), *[p for p in children if alive(p)]]:
            os.kill(pid, signal.SIGKILL)


def test_a_layout_past_its_time_limit_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    """``dot`` gets a time limit that grows with the graph; past it, the stand-in is
    killed and the simple layout is used, with a warning and the page's engine line."""
    assert dot_time_limit(10, 9) < dot_time_limit(5000, 8000) < dot_time_limit(10**6, 10**6)
    assert dot_time_limit(10**6, 10**6) == DOT_MAX_S
    env, pids = stuck_dot(tmp_path / "bin")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("STUCK_DOT_PIDS", env["STUCK_DOT_PIDS"])
    monkeypatch.setattr(layout, "DOT_BASE_S", 0.5)  # the default limit, made short
    monkeypatch.setattr(layout, "DOT_PER_ITEM_S", 0.1)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="mixprec.report.layout"):
        found = layout.layout_graph([60.0] * 3, [20.0] * 3, [(0, 1), (1, 2)])
    assert time.monotonic() - start < 8
    assert found.engine == "layered (graphviz dot took more than 1 s for 3 nodes)"
    assert found.notes and "graphviz dot took more than 1 s" in caplog.text
    started = [int(p) for p in pids.read_text().split()]
    assert started and not any(alive(p) for p in started)
    assert len(found.x) == 3 and found.height > 0
