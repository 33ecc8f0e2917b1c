"""``mixprec batch --optimize``: each model of a folder through ``mixprec optimize`` in its
own worker, with real engines: the row and the zoo page name the chosen candidate, its
runtime and its ratio; ``--validate`` runs the written model in the runtime its metadata
names; a model without calibration data is one error row; ``--resume`` keeps what is
still good; bad options are one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from batch_zoo import mlp, write

import mixprec
from guard_models import separable_classifier, separable_samples
from mixprec.batch.optimize_job import NO_DATA
from mixprec.batch.results import read_rows
from mixprec.cli.main import main
from mixprec.io.runtime_fields import HINTS_KEY, RUNTIME_KEY

#: slow: each batch starts worker processes that import mixprec
pytestmark = pytest.mark.slow

pytest.importorskip("openvino", reason="the [openvino] extra (make test installs it)")


def _zoo(root: Path) -> Path:
    """``zoo/cls.onnx`` and ``zoo/sub/mlp.onnx`` with calibration data beside them, and
    ``zoo/nodata.onnx`` without."""
    zoo = root / "zoo"
    write(zoo / "cls.onnx", separable_classifier())
    x = np.stack([s["x"] for s in separable_samples(8, rows=4)])
    np.savez(zoo / "cls.calib.npz", x=x)
    write(zoo / "sub" / "mlp.onnx", mlp())
    rng = np.random.default_rng(0)
    np.savez(zoo / "sub" / "mlp.calib.npz", x=rng.standard_normal((8, 2, 16)).astype(np.float32))
    write(zoo / "nodata.onnx", mlp(seed=2))
    return zoo


def test_each_model_is_optimized_and_the_page_shows_the_choice(tmp_path, capsys) -> None:
    zoo = _zoo(tmp_path)
    out = tmp_path / "out"
    argv = ["batch", str(zoo), "-o", str(out), "--optimize", "--validate", "--workers", "2"]
    assert main([*argv, "--candidates", "fp32-openvino"]) == 1  # nodata.onnx errored
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("mixprec batch: 3 model(s): 2 ok, 0 failed, 1 error")
    assert any("fp32-openvino in openvino, " in line and "x ORT FP32" in line for line in lines)
    rows = {r["model"]: r for r in read_rows(out)}
    assert rows["nodata.onnx"]["status"] == "error"
    assert rows["nodata.onnx"]["error"] == NO_DATA
    for name in ("cls.onnx", "sub/mlp.onnx"):
        row = rows[name]
        assert row["status"] == "ok" and row["dtype"] == "optimized", row
        chosen = row["optimize"]
        assert (chosen["winner"], chosen["runtime"]) == ("fp32-openvino", "openvino")
        assert chosen["hints"] == {"INFERENCE_PRECISION_HINT": "f32"}
        assert chosen["ratio"] > 0 and chosen["accuracy"]
        assert [c["name"] for c in chosen["candidates"]] == ["fp32-ort", "fp32-openvino"]
        written = out / row["output"]
        assert written == out / name.replace(".onnx", ".optimized.onnx")
        props = {p.key: p.value for p in onnx.load(written).metadata_props}
        assert props[RUNTIME_KEY] == "openvino"
        assert json.loads(props[HINTS_KEY]) == {"INFERENCE_PRECISION_HINT": "f32"}
        # --validate ran the written model where its metadata says
        assert row["validation"]["passed"] and row["validation"]["checked_in"] == "openvino"
        page = (out / row["report"]).read_text()
        assert 'class="candidates"' in page and "fp32-openvino" in page
    index = (out / "index.html").read_text()
    for header in ("<th>chosen</th>", "<th>runtime</th>", "<th>vs ORT FP32</th>"):
        assert header in index
    assert index.count(">fp32-openvino<") == 2 and index.count(">openvino (f32)<") == 2
    ratio = rows["cls.onnx"]["optimize"]["ratio"]
    assert f">{ratio:.2f}x<" in index
    # resume: the two ok models are kept, the one without data is tried again
    again = mixprec.batch(zoo, out, optimize=True, candidates="fp32-openvino", validate=True,
                          workers=1, resume=True)  # fmt: skip
    resumed = {r["model"]: bool(r.get("resumed")) for r in again.rows}
    assert resumed == {"cls.onnx": True, "sub/mlp.onnx": True, "nodata.onnx": False}


def test_the_input_unchanged_is_said_and_written_as_is(tmp_path) -> None:
    zoo = _zoo(tmp_path)
    result = mixprec.batch(zoo / "cls.onnx", tmp_path / "out", optimize=True,
                           candidates=["fp32-ort"], workers=1)  # fmt: skip
    (row,) = result.rows
    assert row["status"] == "ok" and row["unchanged"] and row["optimize"]["unchanged"]
    assert row["optimize"]["winner"] == "fp32-ort" and row["optimize"]["hints"] == {}
    out = tmp_path / "out" / row["output"]
    assert out.read_bytes() == (zoo / "cls.onnx").read_bytes()
    assert "(input unchanged)" in (tmp_path / "out" / "index.html").read_text()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--optimize", "--candidates", "fp64-ort"], "unknown candidate 'fp64-ort'"),
        (["--candidates", "fp32-ort"], "--candidates needs --optimize"),
        (["--optimize", "--dtype", "int8"], "--optimize chooses the precision per model"),
        (["--optimize", "--tune"], "optimize and tune are separate jobs"),
        (["--optimize", "--runtime", "ort", "--candidates", "fp32-openvino"], "runs in openvino"),
    ],
)
def test_bad_optimize_options_are_one_line(tmp_path, capsys, extra, message) -> None:
    zoo = _zoo(tmp_path)
    out = tmp_path / "out"
    assert main(["batch", str(zoo), "-o", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mixprec: error: ") and message in err[0], err
    assert not list(out.glob("**/*.onnx"))
