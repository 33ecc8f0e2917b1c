"""``mixprec batch --engine ray`` against a real local Ray head (``ray start --head`` in a
fixture, ``ray stop`` after): one Ray task per model, the same rows and files as the
local engine, results checked against the FP32 models in ONNX Runtime."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from batch_zoo import feeds, make_zoo, slow, write

import mixprec
from helpers import assert_close, run_ort, sha256_of
from mixprec.batch.process import STAGING_PREFIX
from mixprec.batch.results import read_rows

# Not imported here: mixprec sets Ray's auth mode before Ray's first import.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="the [ray] extra is not installed (make test installs it)",
)

RAY = Path(sys.executable).with_name("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real Ray head on this machine; its address."""
    port = _free_port()
    command = [
        str(RAY if RAY.exists() else shutil.which("ray")),
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=2",
        "--disable-usage-stats",
        "--include-dashboard=false",
    ]
    started = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if started.returncode != 0:
        pytest.fail(f"ray start failed: {started.stderr.strip()[-2000:]}")
    yield f"127.0.0.1:{port}"
    subprocess.run([command[0], "stop", "--force"], capture_output=True, timeout=120)


def test_ray_engine_runs_one_task_per_model(tmp_path, ray_head):
    zoo = make_zoo(tmp_path)
    out = tmp_path / "out"
    result = mixprec.batch(zoo, out, engine="ray", ray_address=ray_head, validate=True, workers=2)
    rows = {r["model"]: r for r in result.rows}
    assert result.exit_code == 1 and rows["broken.onnx"]["status"] == "error"
    assert {r["engine"] for r in read_rows(out)} == {"ray"}
    for name in ("vision/conv.onnx", "text/mlp.onnx", "mlp2.onnx"):
        assert rows[name]["status"] == "ok", rows[name]
        converted = out / rows[name]["output"]
        inputs = feeds(zoo / name)
        ref, got = run_ort(zoo / name, inputs), run_ort(converted, inputs)
        for key in ref:
            assert_close(ref[key], got[key], "fp16", name=f"{name}:{key}")
    assert list(out.glob(f"{STAGING_PREFIX}*")) == []
    # the local engine on the same zoo: the same statuses and the same bytes
    local = mixprec.batch(zoo, tmp_path / "local", validate=True, workers=2)
    assert {r["model"]: r["status"] for r in local.rows} == {
        r["model"]: r["status"] for r in result.rows
    }
    for row in local.rows:
        if row["status"] == "ok":
            assert sha256_of(tmp_path / "local" / row["output"]) == sha256_of(out / row["output"])


def test_ray_timeout_is_a_row_and_resume_skips_what_is_done(tmp_path, ray_head):
    zoo = tmp_path / "zoo"
    write(zoo / "slow.onnx", slow())
    make_zoo(tmp_path)  # adds the others beside it
    out = tmp_path / "out"
    first = mixprec.batch(zoo, out, engine="ray", ray_address=ray_head, timeout=4, workers=2)
    rows = {r["model"]: r for r in first.rows}
    assert rows["slow.onnx"]["status"] == "timeout"
    assert rows["mlp2.onnx"]["status"] == "ok"
    again = mixprec.batch(
        zoo, out, engine="ray", ray_address=ray_head, timeout=4, workers=2, resume=True
    )
    resumed = {r["model"] for r in again.rows if r.get("resumed")}
    assert resumed == {"mlp2.onnx", "text/mlp.onnx", "vision/conv.onnx"}
    assert list(out.glob(f"{STAGING_PREFIX}*")) == []


def test_an_address_nothing_answers_at_is_one_error_at_once(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", slow(10))
    port = _free_port()  # bound and released: nothing listens there
    with pytest.raises(mixprec.MixprecError, match=f"nothing answers at 127.0.0.1:{port}"):
        mixprec.batch(zoo, tmp_path / "out", engine="ray", ray_address=f"127.0.0.1:{port}")
