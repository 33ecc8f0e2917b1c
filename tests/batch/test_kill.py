"""A ``kill -9`` of the batch driver leaves no worker process and no staging file behind;
Ctrl-C (SIGINT) keeps the finished rows and exits 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batch_zoo import mlp, slow, write

import mixprec
from mixprec.batch.process import STAGING_PREFIX
from mixprec.batch.results import read_rows

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


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_kill_9_of_the_driver_takes_its_workers_then_resume_redoes_only_the_rest(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "a_quick.onnx", mlp())
    write(zoo / "b_slow.onnx", slow())
    write(zoo / "c_slow.onnx", slow())
    out = tmp_path / "out"
    driver = _start(zoo, out)
    try:
        # a_quick done, and both slow models running in their workers (staging made)
        started = _wait_for(
            lambda: len(read_rows(out)) == 1 and len(list(out.glob(f"{STAGING_PREFIX}*"))) == 2,
            90,
        )
        assert started, driver.stderr.read().decode() if driver.poll() is not None else "stuck"
        assert len(_workers_of(driver.pid)) == 2
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert _wait_for(lambda: not _workers_of(driver.pid), 15), "workers outlived the driver"
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
        assert _wait_for(lambda: len(read_rows(out)) == 1, 60), "the quick model never finished"
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
