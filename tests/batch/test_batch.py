"""``mixprec batch`` on the local engine: a zoo folder converted by real worker processes,
each result checked against the FP32 model in ONNX Runtime; rows, page, resume, isolation
(a crashed or timed-out worker is one row) and no leftovers."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from batch_zoo import feeds, make_zoo, manifest, mlp, slow, write
from procs import SAFETY_S, wait_for

import mixprec
from helpers import assert_close, run_ort, sha256_of
from mixprec.batch.jobs import find_jobs
from mixprec.batch.process import STAGING_PREFIX, STARTUP_S, WorkerProcess, past_timeout
from mixprec.batch.results import read_rows
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError

#: slow: each batch starts worker processes that import mixprec
pytestmark = pytest.mark.slow


def _leftovers(out: Path) -> list[str]:
    return [
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.name.startswith((STAGING_PREFIX, ".")) or p.suffix == ".tmp"
    ]


def test_a_zoo_folder_is_converted_one_worker_per_model(tmp_path, capsys):
    zoo = make_zoo(tmp_path)
    out = tmp_path / "out"
    code = main(
        ["batch", str(zoo), "-o", str(out), "--dtype", "fp16", "--validate", "--workers", "2"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 1, lines  # broken.onnx errored, the rest went on
    assert lines[-1].startswith("mixprec batch: 4 model(s): 3 ok, 0 failed, 1 error")
    rows = {r["model"]: r for r in read_rows(out)}
    assert set(rows) == {"vision/conv.onnx", "text/mlp.onnx", "mlp2.onnx", "broken.onnx"}
    assert rows["broken.onnx"]["status"] == "error"
    assert "\n" not in rows["broken.onnx"]["error"] and rows["broken.onnx"]["error"]
    for name in ("vision/conv.onnx", "text/mlp.onnx", "mlp2.onnx"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["validation"]["passed"] and row["low_mac_share"] == 1.0
        assert row["bytes_after"] < row["bytes_before"] and row["peak_rss_mb"] > 0
        converted = out / row["output"]
        assert converted == out / name.replace(".onnx", ".fp16.onnx")
        assert (out / row["report"]).is_file()
        inputs = feeds(zoo / name)
        ref, got = run_ort(zoo / name, inputs), run_ort(converted, inputs)
        for key in ref:
            assert_close(ref[key], got[key], "fp16", name=f"{name}:{key}")
    page = (out / "index.html").read_text()
    for name in rows:
        assert name in page
    assert 'href="vision/conv.fp16.html"' in page and "<svg" in page
    assert _leftovers(out) == []


def test_resume_redoes_only_what_changed(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "a.onnx", mlp(0))
    write(zoo / "b.onnx", mlp(1))
    out = tmp_path / "out"
    first = mixprec.batch(zoo, out, workers=2)
    assert first.exit_code == 0 and len(read_rows(out)) == 2
    write(zoo / "b.onnx", mlp(2))  # new weights: new content, same name
    again = mixprec.batch(zoo, out, workers=2, resume=True)
    assert again.exit_code == 0
    assert [r.get("resumed", False) for r in again.rows] == [True, False]
    assert len(read_rows(out)) == 3  # appended, never rewritten
    other = mixprec.batch(zoo, out, workers=2, resume=True, dtype="bf16")  # new options
    assert not any(r.get("resumed") for r in other.rows)
    assert (out / "a.bf16.onnx").is_file()


def test_a_timeout_and_a_crash_are_rows_and_the_batch_goes_on(tmp_path):
    """A model past its timeout (one that never ends: nothing else can end its worker) is
    a ``timeout`` row and the next model runs; no other model has a timeout, so no clock
    decides the outcome. A worker that crashes is an ``error`` row."""
    zoo = tmp_path / "zoo"
    write(zoo / "slow.onnx", slow())
    write(zoo / "quick.onnx", mlp())
    entries = {"zoo/slow.onnx": {"timeout": 1}, "zoo/quick.onnx": {}}
    listed = manifest(tmp_path / "zoo.toml", entries)
    out = tmp_path / "out"
    result = mixprec.batch(listed, out, workers=1, validate=True)
    rows = {r["model"]: r for r in result.rows}
    assert rows["zoo/slow.onnx"]["status"] == "timeout"
    assert rows["zoo/slow.onnx"]["error"] == "stopped after the 1 s timeout"
    assert rows["zoo/quick.onnx"]["status"] == "ok"
    assert result.exit_code == 1 and _leftovers(out) == []

    job = find_jobs([zoo / "slow.onnx"], {"validate": True}, out)[0]
    worker = WorkerProcess(job, out, threads=1)
    assert wait_for(worker.staging.exists, SAFETY_S), "the worker never began its model"
    os.kill(worker.pid, signal.SIGSEGV)
    worker.wait()
    row = worker.finish()
    assert row["status"] == "error" and row["error"] == "worker died of SIGSEGV", row
    assert _leftovers(out) == []


class _Clock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_timeout_counts_from_when_the_worker_begins_its_model(tmp_path):
    """Through an injected clock, on a worker that never ends by itself: once it has
    begun its model (made its staging folder), the timeout counts from when that was
    first seen; its time before (importing) does not count."""
    zoo = tmp_path / "zoo"
    write(zoo / "slow.onnx", slow())
    out = tmp_path / "out"
    out.mkdir()
    (job,) = find_jobs([zoo / "slow.onnx"], {"timeout": 10}, out)
    clock = _Clock()
    worker = WorkerProcess(job, out, threads=1, clock=clock)
    try:
        assert wait_for(worker.staging.exists, SAFETY_S), "the worker never began its model"
        clock.now += 50  # importing took long: not the model's time
        assert not worker.poll() and worker.began == clock.now
        clock.now += 10
        assert not worker.poll()
        clock.now += 0.5
        assert worker.poll() and worker.timed_out
        row = worker.finish()
        assert row["status"] == "timeout" and row["error"] == "stopped after the 10 s timeout"
        assert _leftovers(out) == []
    finally:
        worker.stop()


def test_a_worker_that_never_begins_is_stopped_past_the_start_up_allowance():
    assert not past_timeout(10, started=0, began=None, now=10 + STARTUP_S)
    assert past_timeout(10, started=0, began=None, now=10.5 + STARTUP_S)
    assert not past_timeout(10, started=0, began=300, now=310)
    assert past_timeout(10, started=0, began=300, now=310.5)


def test_manifest_options_and_data_beside_the_model(tmp_path):
    zoo = tmp_path / "zoo"
    model = write(zoo / "m.onnx", mlp())
    before = sha256_of(model)
    rng = np.random.default_rng(0)
    np.savez(zoo / "m.calib.npz", x=rng.standard_normal((6, 2, 16)).astype(np.float32))
    (tmp_path / "zoo.toml").write_text(
        '[defaults]\nvalidate = true\n\n[[models]]\npath = "zoo/m.onnx"\ndtype = "bf16"\n'
    )
    result = mixprec.batch(tmp_path / "zoo.toml", tmp_path / "out", workers=1)
    (row,) = result.rows
    assert row["status"] == "ok" and row["dtype"] == "bf16", row
    assert row["data"]["calibration_data"] == "m.calib.npz (beside the model)"
    assert row["data"]["inputs"] == "none"
    assert (tmp_path / "out" / "zoo" / "m.bf16.onnx").is_file()
    assert sha256_of(model) == before  # the input is never modified


def test_runtime_option_reaches_the_workers_checks(tmp_path):
    """``runtime = "openvino"`` in a manifest: each row's check ran in OpenVINO (a bf16
    model, on real bf16 kernels where the CPU has them, else emulated and said so)."""
    pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")
    from mixprec.runtime.engines import ENGINES

    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    (tmp_path / "zoo.toml").write_text(
        '[defaults]\nvalidate = true\nruntime = "openvino"\ndtype = "bf16"\n\n'
        '[[models]]\npath = "zoo/m.onnx"\n'
    )
    result = mixprec.batch(tmp_path / "zoo.toml", tmp_path / "out", workers=1)
    (row,) = result.rows
    assert row["status"] == "ok" and row["validation"]["passed"], row
    want = "openvino" if ENGINES["openvino"].computes_bf16() else "emulated"
    assert row["validation"]["checked_in"] == want, row
    bad = tmp_path / "bad.toml"
    bad.write_text('[defaults]\nruntime = "tensorrt"\n\n[[models]]\npath = "zoo/m.onnx"\n')
    with pytest.raises(mixprec.MixprecError, match="unknown runtime 'tensorrt'"):
        mixprec.batch(bad, tmp_path / "out2", workers=1)


def test_int8_rows_carry_the_guard_and_its_warnings(tmp_path):
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    rng = np.random.default_rng(0)
    np.savez(zoo / "m.calib.npz", x=rng.standard_normal((3, 2, 16)).astype(np.float32))
    result = mixprec.batch(zoo, tmp_path / "out", dtype="int8", workers=1, validate=True)
    (row,) = result.rows
    assert row["status"] in ("ok", "failed") and row["guard"]["summary"], row
    # 3 samples are too few to hold any out: the check ran in-sample, and the row says so
    assert any("too few to hold any out" in w for w in row.get("warnings", [])), json.dumps(row)
    if row["unchanged"]:  # kept float: the output is the input's bytes
        assert (tmp_path / "out" / row["output"]).read_bytes() == (zoo / "m.onnx").read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nowhere"], "nowhere: no such model, folder or manifest"),
        (["ZOO", "--workers", "0"], "workers must be >= 1"),
        (["ZOO", "--timeout", "-1"], "timeout must be > 0"),
        (["ZOO", "--dtype", "fp8"], "unknown --dtype 'fp8'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    argv = ["batch", *[str(zoo) if a == "ZOO" else a for a in args], "-o", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_bad_manifest_option_names_the_known_ones(tmp_path):
    write(tmp_path / "m.onnx", mlp())
    (tmp_path / "z.toml").write_text('[[models]]\npath = "m.onnx"\nspeed = "fast"\n')
    with pytest.raises(MixprecError, match=r"unknown option.*speed.*known: dtype"):
        mixprec.batch(tmp_path / "z.toml", tmp_path / "o")


def test_json_lines_on_stdout(tmp_path, capsys):
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    write(zoo / "n.onnx", mlp(1))
    assert main(["batch", str(zoo), "-o", str(tmp_path / "o"), "--json", "--workers", "1"]) == 0
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    assert [row["model"] for row in lines[:2]] == ["m.onnx", "n.onnx"]
    assert lines[-1]["batch"]["counts"]["ok"] == 2
    assert captured.err.strip().splitlines()[-1].startswith("mixprec batch: 2 model(s): 2 ok")


def test_an_int8_model_checked_on_no_real_data_is_unchecked_not_ok(tmp_path, capsys):
    """No calibration, eval or validation data beside ``m.onnx``: its INT8 model is
    written, but the row is ``unchecked`` (exit 1 unless ``--allow-unchecked``), and the
    zoo page says which models were checked on real data."""
    zoo = tmp_path / "zoo"
    write(zoo / "m.onnx", mlp())
    write(zoo / "n.onnx", mlp(1))
    rng = np.random.default_rng(0)
    np.savez(zoo / "n.calib.npz", x=rng.standard_normal((10, 2, 16)).astype(np.float32))
    out = tmp_path / "out"
    assert main(["batch", str(zoo), "-o", str(out), "--dtype", "int8", "--workers", "1"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1 unchecked" in last, last
    rows = {r["model"]: r for r in read_rows(out)}
    m, n = rows["m.onnx"], rows["n.onnx"]
    assert m["status"] == "unchecked" and m["real_data"] is False, m
    assert "not checked on real data" in m["error"] and (out / m["output"]).is_file()
    assert n["status"] in ("ok", "failed") and n["real_data"] is True, n
    page = (out / "index.html").read_text()
    assert "Checked on real data (calibration, eval or validation samples): 1 of 2" in page
    assert '<td class="s" style="color:#8d6e63">unchecked</td><td>int8</td><td>no</td>' in page
    # allowed: exit 0; --resume keeps the unchecked row (the same data gives the same)
    argv = ["batch", str(zoo / "m.onnx"), "-o", str(out), "--dtype", "int8", "--resume"]
    assert main([*argv, "--allow-unchecked"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "0 ok, 0 failed, 0 error, 0 timeout, 1 unchecked (1 resumed)" in last, last
    result = mixprec.batch(zoo / "m.onnx", out, dtype="int8", resume=True)
    assert result.counts["unchecked"] == 1 and result.rows[0].get("resumed")
    assert result.exit_code == 1
