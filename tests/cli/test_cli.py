"""The ``mixprec`` command line: bad input ends in one stderr line and exit 2, good input
writes valid models, reports, logs; environment variables and their priority.

Every error case runs twice: in-process through ``mixprec.cli.main.main`` and as
``python -m mixprec`` in a subprocess (what a user sees, tracebacks included).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.shape_inference
import pytest

import mixprec
from helpers import assert_close, make_model, run_ort, sha256_of, strict_json
from mixprec.cli.main import main
from text_models import filled_model

MODES = ["inproc", "subproc"]


def _init(name: str, arr: np.ndarray) -> str:
    dims = ",".join(str(d) for d in arr.shape)
    return f"float[{dims}] {name} = {{{', '.join(f'{v:.7g}' for v in arr.ravel())}}}"


def small_model_text(batch: str | int = 1) -> str:
    """Conv -> Relu -> MatMul -> Softmax with initializers, opset 17."""
    rng = np.random.default_rng(0)
    w = (0.3 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32)
    b = (0.1 * rng.standard_normal(4)).astype(np.float32)
    k = (0.3 * rng.standard_normal((8, 4))).astype(np.float32)
    return f"""
    <ir_version: 8, opset_import: ["" : 17]>
    small (float[{batch},3,8,8] x) => (float[{batch},4,8,4] y)
    <{_init("w", w)}, {_init("b", b)}, {_init("k", k)}>
    {{
        c = Conv <pads = [1, 1, 1, 1]> (x, w, b)
        r = Relu (c)
        m = MatMul (r, k)
        y = Softmax <axis = -1> (m)
    }}
    """


@dataclass(frozen=True)
class Paths:
    root: Path
    inp: Path  # input models; never modified
    small: Path
    sym: Path
    sym_fp16: Path
    string: Path
    new_opset: Path
    truncated: Path
    text: Path
    empty: Path
    shape_warning: Path  # onnx_ir's shape inference fails (logs a traceback); converts fine
    large_outputs: Path  # outputs ~100: fp16 misses a tiny --rtol by more than atol


def shape_warning_model_text() -> str:
    """Valid ONNX whose declared output shape only data propagation finds wrong.

    ``Reshape(z, Shape(x))`` is [1,6] at run time, the output declares [2,3]: the checker
    (no data propagation) accepts it, onnx_ir's ``ShapeInferencePass(data_prop=True)`` fails
    and logs a warning with the exception's traceback.
    """
    return """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,6] x, float[2,3] z) => (float[2,3] y)
    {
        s = Shape (x)
        t = Reshape (z, s)
        y = Relu (t)
    }
    """


def large_outputs_model_text() -> str:
    k = (30 * np.random.default_rng(2).standard_normal((16, 16))).astype(np.float32)
    return f"""
    <ir_version: 8, opset_import: ["" : 17]>
    large (float[1,16] x) => (float[1,16] y) <{_init("k", k)}> {{ y = MatMul (x, k) }}
    """


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Paths:
    root = tmp_path_factory.mktemp("cli")
    inp = root / "in"
    inp.mkdir()
    small = make_model(small_model_text())
    onnx.save(small, inp / "small.onnx")
    sym = make_model(small_model_text("N"))
    onnx.save(sym, inp / "sym.onnx")
    mixprec.convert(sym, "fp16").save(inp / "sym_fp16.onnx")
    string = make_model(
        '<ir_version: 8, opset_import: ["" : 17]> g (string[1] s) => (string[1] t) '
        "{ t = Identity(s) }"
    )
    onnx.save(string, inp / "string.onnx")
    newer = onnx.ModelProto()
    newer.CopyFrom(small)
    newer.opset_import[0].version = 99
    onnx.save(newer, inp / "new_opset.onnx")
    data = (inp / "small.onnx").read_bytes()
    (inp / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (inp / "text.onnx").write_text("this is a text file, not an ONNX model\n")
    (inp / "empty.onnx").write_bytes(b"")
    onnx.save(make_model(shape_warning_model_text()), inp / "shape_warning.onnx")
    onnx.save(make_model(large_outputs_model_text()), inp / "large_outputs.onnx")
    return Paths(
        root,
        inp,
        inp / "small.onnx",
        inp / "sym.onnx",
        inp / "sym_fp16.onnx",
        inp / "string.onnx",
        inp / "new_opset.onnx",
        inp / "truncated.onnx",
        inp / "text.onnx",
        inp / "empty.onnx",
        inp / "shape_warning.onnx",
        inp / "large_outputs.onnx",
    )


@dataclass
class Result:
    rc: int
    out: str
    err: str


def _clean_env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIXPREC_")}
    env.update(extra or {})
    return env


def cli(
    args: Sequence[str],
    mode: str = "inproc",
    *,
    env: Mapping[str, str] | None = None,
    monkeypatch: pytest.MonkeyPatch | None = None,
    cwd: Path | None = None,
) -> Result:
    """Run ``mixprec ARGS`` in-process (``main``) or as ``python -m mixprec``."""
    args = [str(a) for a in args]
    if mode == "subproc":
        proc = subprocess.run(
            [sys.executable, "-m", "mixprec", *args],
            capture_output=True,
            text=True,
            env=_clean_env(env),
            cwd=cwd,
            timeout=120,
            check=False,
        )
        return Result(proc.returncode, proc.stdout, proc.stderr)
    assert monkeypatch is not None, "in-process runs need monkeypatch for the environment"
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    if cwd is not None:
        monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(args)
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 2
    for key in env or {}:
        monkeypatch.delenv(key)
    return Result(rc, out.getvalue(), err.getvalue())


def _snapshot(folder: Path) -> dict[str, str]:
    return {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file()}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Bad:
    """One bad invocation: args from the paths, env, what stderr must name."""

    make: Callable[[Paths, Path], list[str]]
    expect: str
    env: Mapping[str, str] | None = None
    argparse: bool = False


def _convert(model: Callable[[Paths], Path], *extra: str) -> Callable[[Paths, Path], list]:
    return lambda p, out: ["convert", model(p), "-o", out / "out.onnx", *extra]


BAD: dict[str, Bad] = {
    "missing-file": Bad(
        lambda p, out: ["convert", p.inp / "nope.onnx", "-o", out / "o.onnx"], "no such file"
    ),
    "text-file": Bad(_convert(lambda p: p.text), "not a valid ONNX file"),
    "truncated": Bad(_convert(lambda p: p.truncated), "not a valid ONNX file"),
    "empty-file": Bad(_convert(lambda p: p.empty), "not an ONNX model"),
    "directory": Bad(_convert(lambda p: p.inp), "is a directory"),
    "unknown-dtype": Bad(_convert(lambda p: p.small, "--dtype", "fp8"), "'fp8'"),
    "unknown-op": Bad(_convert(lambda p: p.small, "--allow-add", "NotAnOp"), "'NotAnOp'"),
    "env-bad-bool": Bad(
        _convert(lambda p: p.small), "MIXPREC_FORCE_ALL", env={"MIXPREC_FORCE_ALL": "maybe"}
    ),
    "env-unknown-var": Bad(
        _convert(lambda p: p.small), "MIXPREC_FROBNICATE", env={"MIXPREC_FROBNICATE": "1"}
    ),
    "bad-regex": Bad(_convert(lambda p: p.small, "--exclude", "(["), "'(['"),
    "shape-rank": Bad(_convert(lambda p: p.small, "--shape", "x=1,3,8"), "rank"),
    "shape-name": Bad(_convert(lambda p: p.small, "--shape", "z=1,3,8,8"), "'z'"),
    "shape-syntax": Bad(
        _convert(lambda p: p.small, "--shape", "x:1,3,8,8"), "NAME=D0", argparse=True
    ),
    "shape-not-int": Bad(
        _convert(lambda p: p.small, "--shape", "x=1,a,8,8"), "integers", argparse=True
    ),
    "output-folder-missing": Bad(
        lambda p, out: ["convert", p.small, "-o", out / "no" / "such" / "o.onnx"],
        "does not exist",
    ),
    "output-is-input": Bad(lambda p, out: ["convert", p.small, "-o", p.small], "overwrite"),
    "opset-too-new": Bad(_convert(lambda p: p.new_opset), "opset 99"),
    "string-input": Bad(_convert(lambda p: p.string), "string"),
    "keep-failed-alone": Bad(_convert(lambda p: p.small, "--keep-failed"), "needs --validate"),
    "calibration-data-missing": Bad(
        _convert(lambda p: p.small, "--calibration-data", "nope.npz"), "does not exist"
    ),
    "calibration-data-and-inputs": Bad(
        _convert(lambda p: p.small, "--calibration-data", "a.npz", "--inputs", "b.npz"),
        "not allowed with argument",
        argparse=True,
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, mode: str
) -> None:
    bad = BAD[case]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = _snapshot(models.inp)
    res = cli(bad.make(models, out_dir), mode, env=bad.env, monkeypatch=monkeypatch)

    assert res.rc == 2, (res.rc, res.out, res.err)
    assert "Traceback" not in res.err
    lines = res.err.strip().splitlines()
    if bad.argparse:  # argparse: usage lines, then one "error:" line
        assert lines[-1].startswith("mixprec convert: error:"), res.err
    else:
        assert len(lines) == 1, res.err
        assert lines[0].startswith("mixprec: error: "), res.err
    assert bad.expect in lines[-1], res.err
    assert res.out == ""
    assert _snapshot(models.inp) == before, "an input file changed"
    assert _leftovers(out_dir) == [], "output or temporary files left behind"


@pytest.mark.parametrize("mode", MODES)
def test_output_in_read_only_folder(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("this user (root?) can write into a 0o555 folder")
        before = _snapshot(models.inp)
        res = cli(["convert", models.small, "-o", ro / "o.onnx"], mode, monkeypatch=monkeypatch)
        assert res.rc == 2 and "Traceback" not in res.err
        assert len(res.err.strip().splitlines()) == 1 and "not writable" in res.err
        assert _snapshot(models.inp) == before
        assert _leftovers(ro) == []
    finally:
        ro.chmod(0o755)


# --------------------------------------------------------------------------- success


def _converted(path: Path) -> onnx.ModelProto:
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, strict_mode=True)
    return model


def _init_types(model: onnx.ModelProto) -> set[int]:
    return {t.data_type for t in model.graph.initializer}


@pytest.mark.parametrize("mode", MODES)
def test_convert_writes_valid_fp16_model(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    out = tmp_path / "small_fp16.onnx"
    before = sha256_of(models.small)
    res = cli(["convert", models.small, "-o", out], mode, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert f"wrote {out}" in res.out
    model = _converted(out)
    assert onnx.TensorProto.FLOAT16 in _init_types(model)
    assert sha256_of(models.small) == before
    assert _leftovers(tmp_path) == ["small_fp16.onnx"]
    x = np.random.default_rng(1).random((1, 3, 8, 8), dtype=np.float32)
    assert_close(run_ort(models.small, {"x": x})["y"], run_ort(out, {"x": x})["y"], "float16")


def test_output_file_mode_follows_umask(models: Paths, tmp_path: Path) -> None:
    mask = os.umask(0o022)
    os.umask(mask)
    out = tmp_path / "o.onnx"
    assert main(["convert", str(models.small), "-o", str(out), "-q"]) == 0
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


def test_convert_json_report(models: Paths, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    res = cli(["convert", models.small, "-o", out, "--json"], "subproc")
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    summary = data["summary"]
    for key in (
        "nodes",
        "low_nodes",
        "low_node_share",
        "macs",
        "low_mac_share",
        "casts_inserted",
        "casts_after",
        "param_bytes_before",
        "param_bytes_after",
    ):
        assert key in summary, key
    assert summary["nodes"] == 4 and summary["low_nodes"] == 4
    assert summary["low_mac_share"] == 1.0
    assert data["output"] == str(out)
    assert {n["op_type"] for n in data["nodes"]} == {"Conv", "Relu", "MatMul", "Softmax"}
    assert out.is_file()


@pytest.mark.parametrize("mode", MODES)
def test_inspect_prints_counts_and_writes_nothing(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    before = _snapshot(models.inp)
    res = cli(["inspect", models.small, "--all-nodes"], mode, monkeypatch=monkeypatch, cwd=tmp_path)
    assert res.rc == 0, res.err
    assert "float nodes painted" in res.out and "4 (100.0%)" in res.out
    assert all(op in res.out for op in ("Conv", "Relu", "MatMul", "Softmax"))
    assert _snapshot(models.inp) == before
    assert _leftovers(tmp_path) == []


def _scale_weights(model: onnx.ModelProto, factor: float) -> onnx.ModelProto:
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    for t in broken.graph.initializer:
        arr = onnx.numpy_helper.to_array(t)
        if arr.dtype.kind == "f":
            t.CopyFrom(onnx.numpy_helper.from_array((arr * factor).astype(arr.dtype), t.name))
    return broken


@pytest.mark.parametrize("mode", MODES)
def test_validate_good_and_broken(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    good = tmp_path / "good.onnx"
    mixprec.convert(models.small, "fp16").save(good)
    res = cli(["validate", models.small, good], mode, monkeypatch=monkeypatch)
    assert res.rc == 0, res.out + res.err
    assert "PASSED" in res.out and "y" in res.out

    broken = tmp_path / "broken.onnx"
    onnx.save(_scale_weights(onnx.load(good), 2.0), broken)
    res = cli(["validate", models.small, broken], mode, monkeypatch=monkeypatch)
    assert res.rc == 1, res.out + res.err
    assert "Traceback" not in res.err
    assert "FAILED" in res.out
    assert any(
        line.startswith("y ") and line.rstrip().endswith("NO") for line in res.out.splitlines()
    ), res.out


def test_validate_json_stays_strict_on_a_non_finite_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A converted model whose output is inf where FP32's is finite: its rel L2 and its
    worst channel's rel L2 are inf, written as "inf" (the channel check wrote Infinity,
    which strict JSON parsers refuse)."""
    text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[8, 2] x) => (float[8, 2] box) <float[2] s> { box = Mul (x, s) }
    """
    original, converted = tmp_path / "fp32.onnx", tmp_path / "inf.onnx"
    onnx.save(filled_model(text, s=np.array([1000.0, 1.0])), original)
    onnx.save(filled_model(text, s=np.array([np.inf, 1.0])), converted)
    x = np.random.default_rng(0).uniform(1, 2, (1, 8, 2)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    args = ["validate", original, converted, "--inputs", tmp_path / "x.npz", "--json"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 1, res.out + res.err
    report = strict_json(res.out)
    assert isinstance(report, dict) and report["passed"] is False
    assert report["outputs"][0]["rel_l2_error"] == "inf", report
    closeness, check = report["checks"]
    assert closeness["kind"] == "rel-l2" and closeness["value"] == "inf", closeness
    assert check["kind"] == "channels" and check["value"] == "inf", check


def test_log_dir(models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    logs = tmp_path / "logs"
    res = cli(
        ["convert", models.small, "-o", tmp_path / "o.onnx", "--log-dir", logs, "-q"],
        monkeypatch=monkeypatch,
    )
    assert res.rc == 0, res.err
    names = {p.name for p in logs.iterdir()}
    expected = {
        "before.onnx",
        "after.onnx",
        "before.txt",
        "after.txt",
        "paint_buckets.json",
        "paint_buckets.txt",
    }
    assert expected <= names, names
    onnx.checker.check_model(onnx.load(logs / "after.onnx"), full_check=True)
    buckets = json.loads((logs / "paint_buckets.json").read_text())
    assert "Conv" in buckets["buckets"]["low"]
    assert "Conv" in (logs / "before.txt").read_text()


def test_lists_markdown() -> None:
    res = cli(["lists", "--markdown"], "subproc")
    assert res.rc == 0, res.err
    lines = res.out.splitlines()
    assert lines[0].startswith("| list |") and lines[1].startswith("|---")
    for name in ("ALLOW", "DENY", "INFER", "CLEAR"):
        assert any(line.startswith(f"| {name} |") for line in lines), name
    allow = next(line for line in lines if line.startswith("| ALLOW |"))
    assert "MatMul" in allow and "Conv" in allow
    assert any(line.startswith("| ai.onnx::") for line in lines), "no rule table"


# --------------------------------------------------------------------------- environment


def _precisions(stdout: str) -> dict[str, str]:
    return {n["op_type"]: n["precision"] for n in json.loads(stdout)["nodes"]}


@pytest.mark.parametrize("mode", MODES)
def test_env_dtype_and_cli_override(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    env = {"MIXPREC_DTYPE": "bf16"}
    bf = tmp_path / "bf.onnx"
    res = cli(["convert", models.small, "-o", bf, "-q"], mode, env=env, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    types = _init_types(_converted(bf))
    assert onnx.TensorProto.BFLOAT16 in types and onnx.TensorProto.FLOAT16 not in types

    fp = tmp_path / "fp.onnx"
    res = cli(
        ["convert", models.small, "-o", fp, "-q", "--dtype", "fp16"],
        mode,
        env=env,
        monkeypatch=monkeypatch,
    )
    assert res.rc == 0, res.err
    types = _init_types(_converted(fp))
    assert onnx.TensorProto.FLOAT16 in types and onnx.TensorProto.BFLOAT16 not in types


def test_env_denylist_keeps_relu_fp32(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["convert", models.small, "-o", tmp_path / "o.onnx", "--json"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 0 and _precisions(res.out)["Relu"] == "low"
    res = cli(args, env={"MIXPREC_DENYLIST_ADD": "Relu"}, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert _precisions(res.out)["Relu"] == "fp32"
    assert _precisions(res.out)["Conv"] == "low"


@pytest.mark.parametrize("override", [["--allow-add", "Relu"], ["--deny-remove", "Relu"]])
def test_cli_list_options_override_env_denylist(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, override: list[str]
) -> None:
    args = ["convert", models.small, "-o", tmp_path / "o.onnx", "--json", *override]
    res = cli(args, env={"MIXPREC_DENYLIST_ADD": "Relu"}, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    relu = next(n for n in json.loads(res.out)["nodes"] if n["op_type"] == "Relu")
    if override[0] == "--allow-add":
        assert relu["precision"] == "low" and relu["op_class"] == "allow", relu
    else:
        # Removed from DENY after the env added it: in no list, so it keeps FP32 (documented).
        assert relu["precision"] == "fp32" and relu["reason"] == "Relu is in no list", relu


# --------------------------------------------------------------------------- atomic write


def test_failed_save_keeps_old_output_and_leaves_no_temp(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "o.onnx"
    out.write_bytes(b"previous output, must survive")
    before = sha256_of(out)

    def broken_save(model, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"\x08\x07partial")
        raise OSError(28, "No space left on device")

    import mixprec.io.models

    monkeypatch.setattr(mixprec.io.models, "_write_streaming", broken_save)
    res = cli(["convert", models.small, "-o", out, "-q"], monkeypatch=monkeypatch)
    assert res.rc == 2, res.err
    assert "Traceback" not in res.err and len(res.err.strip().splitlines()) == 1
    assert "cannot write" in res.err
    assert sha256_of(out) == before
    assert _leftovers(tmp_path) == ["o.onnx"]


# --------------------------------------------------------------------------- the terminal


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _onnx_ir_shape_inference_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the pipeline call onnx_ir's own ShapeInferencePass before it corrects the
    declared shapes: on ``shape_warning`` that pass fails and logs the failure with
    exc_info and an unfilled ``%s`` (mixprec's own inference pass reports failures in its
    result instead, so a plain conversion no longer triggers the library's warning)."""
    import onnx_ir.passes.common as common

    import mixprec.passes.shapes

    real = mixprec.passes.shapes.ReconcileDeclaredShapesPass.call

    def call(self, model):
        common.ShapeInferencePass()(model)
        return real(self, model)

    monkeypatch.setattr(mixprec.passes.shapes.ReconcileDeclaredShapesPass, "call", call)


def test_wrong_declared_shape_converts_with_a_quiet_terminal(models: Paths, tmp_path: Path):
    out = tmp_path / "o.onnx"
    res = cli(["convert", models.shape_warning, "-o", out], "subproc")
    assert res.rc == 0, res.err
    assert res.err == ""
    assert "declaration corrected (in the input model)" in res.out, res.out
    assert out.is_file()


def test_library_warning_with_traceback_is_one_line(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnx_ir logs its shape inference failure with exc_info and an unfilled ``%s``."""
    _onnx_ir_shape_inference_first(monkeypatch)
    out = tmp_path / "o.onnx"
    res = cli(["convert", models.shape_warning, "-o", out], monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert "Traceback" not in res.err and "File " not in res.err
    assert _lines(res.err), "the warning is expected on stderr"
    assert all(line.startswith("mixprec:") for line in _lines(res.err)), res.err
    warning = next(line for line in _lines(res.err) if "Shape inference failed" in line)
    assert warning.startswith("mixprec: warning: onnx_ir: "), warning
    assert "%s" not in warning and "InferenceError" in warning, warning
    assert out.is_file()


def test_quiet_hides_library_warnings_log_dir_keeps_them(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _onnx_ir_shape_inference_first(monkeypatch)
    logs = tmp_path / "logs"
    args = ["convert", models.shape_warning, "-o", tmp_path / "o.onnx", "-q", "--log-dir", logs]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert res.err == ""
    log = (logs / "mixprec.log").read_text()
    assert "Shape inference failed" in log and "Traceback" in log, log
    assert not (logs / "error.txt").exists()


def test_debug_shows_library_tracebacks(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _onnx_ir_shape_inference_first(monkeypatch)
    args = ["convert", models.shape_warning, "-o", tmp_path / "o.onnx", "--debug"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert "Traceback" in res.err and "InferenceError" in res.err


def test_library_records_and_warnings_are_one_line(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Library records with a multi-line message and exc_info or stack_info, and a
    ``warnings.warn``, in the middle of a conversion: one line each, no traceback.

    (Arguments that do not fit the format are tested on the formatter in test_errors.py:
    pytest's own log capture handler raises on them.)"""
    import logging
    import warnings

    import mixprec.cli.convert

    real = mixprec.cli.convert.convert

    def noisy(*args, **kwargs):
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            logging.getLogger("onnx_ir.fake").warning("bad %s\nline 2", "one", exc_info=True)
        logging.getLogger("onnxruntime").error("stack here", stack_info=True)
        warnings.warn("a library warning\nwith two lines", UserWarning, stacklevel=1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mixprec.cli.convert, "convert", noisy)
    res = cli(["convert", models.small, "-o", tmp_path / "o.onnx"], monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    lines = _lines(res.err)
    assert len(lines) == 3, res.err
    assert all(line.startswith("mixprec: ") for line in lines), res.err
    assert lines[0] == "mixprec: warning: onnx_ir: bad one (ValueError: boom)", lines[0]
    assert lines[1] == "mixprec: error: onnxruntime: stack here", lines[1]
    assert "UserWarning: a library warning" in lines[2], lines[2]
    assert "Traceback" not in res.err and "Stack" not in res.err

    res = cli(["convert", models.small, "-o", tmp_path / "o.onnx", "-q"], monkeypatch=monkeypatch)
    assert res.rc == 0
    assert _lines(res.err) == ["mixprec: error: onnxruntime: stack here"], res.err


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("model", "expect"),
    [
        ("truncated", "not a valid ONNX file"),
        ("text", "not a valid ONNX file"),
        ("string", "string"),
    ],
)
def test_quiet_bad_input_one_line_exit_2(
    models: Paths,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    model: str,
    expect: str,
) -> None:
    args = ["convert", getattr(models, model), "-o", tmp_path / "o.onnx", "-q"]
    res = cli(args, mode, monkeypatch=monkeypatch)
    assert res.rc == 2, (res.rc, res.err)
    assert len(res.err.splitlines()) == 1, res.err
    assert res.err.startswith("mixprec: error: ") and expect in res.err, res.err
    assert res.out == ""
    assert _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- internal errors


def _raise_in_convert(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    import mixprec.cli.convert

    def broken(*args, **kwargs):
        raise exc

    monkeypatch.setattr(mixprec.cli.convert, "convert", broken)  # what the command calls


@pytest.mark.parametrize(
    ("exc", "expect"),
    [
        (
            mixprec.InternalError("the converted model fails onnx.checker: x", stage="check"),
            "mixprec: internal error in stage 'check': the converted model fails onnx.checker: x",
        ),
        (
            TypeError("unsupported operand\nmore detail"),
            "mixprec: internal error in convert: TypeError: unsupported operand",
        ),
    ],
)
def test_internal_error_one_line_exit_3(
    models: Paths,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    exc: Exception,
    expect: str,
) -> None:
    _raise_in_convert(monkeypatch, exc)
    res = cli(["convert", models.small, "-o", tmp_path / "o.onnx"], monkeypatch=monkeypatch)
    assert res.rc == 3, res.err
    assert len(res.err.splitlines()) == 1 and "Traceback" not in res.err, res.err
    assert res.err.startswith(expect), res.err
    assert "please report this bug" in res.err and "--debug" in res.err
    assert _leftovers(tmp_path) == []


def test_internal_error_with_log_dir_writes_error_txt(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _raise_in_convert(monkeypatch, ZeroDivisionError("division by zero"))
    logs = tmp_path / "no" / "such" / "logs"
    args = ["convert", models.small, "-o", tmp_path / "o.onnx", "--log-dir", logs]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 3, res.err
    assert len(res.err.splitlines()) == 1, res.err
    assert res.err.rstrip().endswith(f"please report this bug; details in {logs / 'error.txt'}")
    text = (logs / "error.txt").read_text()
    assert f"command: mixprec convert {models.small}" in text
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError" in text
    assert (logs / "mixprec.log").is_file()


def test_user_error_with_log_dir_writes_error_txt(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    logs = tmp_path / "logs"
    args = ["convert", models.truncated, "-o", tmp_path / "o.onnx", "--log-dir", logs]
    res = cli(args, env={"MIXPREC_LOG_PATH": str(tmp_path / "unused")}, monkeypatch=monkeypatch)
    assert res.rc == 2 and len(res.err.splitlines()) == 1, res.err
    assert "not a valid ONNX file" in (logs / "error.txt").read_text()
    assert not (tmp_path / "unused").exists(), "--log-dir wins over MIXPREC_LOG_PATH"


def test_error_txt_follows_env_log_path(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _raise_in_convert(monkeypatch, RuntimeError("bug"))
    logs = tmp_path / "env-logs"
    args = ["convert", models.small, "-o", tmp_path / "o.onnx"]
    res = cli(args, env={"MIXPREC_LOG_PATH": str(logs)}, monkeypatch=monkeypatch)
    assert res.rc == 3, res.err
    assert f"details in {logs / 'error.txt'}" in res.err
    assert "RuntimeError: bug" in (logs / "error.txt").read_text()


def test_error_txt_cannot_be_written_still_one_line(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _raise_in_convert(monkeypatch, RuntimeError("bug"))
    blocker = tmp_path / "file"
    blocker.write_text("a file where the log folder should be")
    args = ["convert", models.small, "-o", tmp_path / "o.onnx", "--log-dir", blocker / "logs"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 3, res.err
    assert len(res.err.splitlines()) == 1 and "error.txt" not in res.err, res.err


@pytest.mark.parametrize("position", ["global", "command"])
def test_debug_prints_the_traceback(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, position: str
) -> None:
    _raise_in_convert(monkeypatch, KeyError("missing"))
    args = ["convert", models.small, "-o", tmp_path / "o.onnx"]
    args = ["--debug", *args] if position == "global" else [*args, "--debug"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 3
    assert "Traceback (most recent call last)" in res.err and "in broken" in res.err
    assert _lines(res.err)[-1].startswith("mixprec: internal error in convert: KeyError")


# --------------------------------------------------------------------------- --validate


@pytest.mark.parametrize("mode", MODES)
def test_convert_validate_failure_writes_nothing(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    out = tmp_path / "o.onnx"
    args = ["convert", models.large_outputs, "-o", out, "--validate", "--rtol", "1e-12"]
    res = cli(args, mode, monkeypatch=monkeypatch)
    assert res.rc == 1, res.out + res.err
    assert "Traceback" not in res.err
    assert "FAILED" in res.out and "wrote" not in res.out
    last = _lines(res.err)[-1]
    assert last.startswith("mixprec: validation FAILED (output 'y': rel L2 "), last
    assert last.endswith(f"> rtol 1e-12): {out} not written"), last
    assert _leftovers(tmp_path) == [], "no model and no temporary file"


def test_convert_validate_failure_keeps_existing_output(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "o.onnx"
    out.write_bytes(b"an earlier result")
    before = sha256_of(out)
    args = ["convert", models.large_outputs, "-o", out, "--validate", "--rtol", "1e-12", "--json"]
    res = cli(args, monkeypatch=monkeypatch)
    assert res.rc == 1
    data = json.loads(res.out)
    assert data["output"] is None and data["validation"]["passed"] is False
    assert sha256_of(out) == before
    assert _leftovers(tmp_path) == ["o.onnx"]


def test_convert_validate_keep_failed(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "o.onnx"
    args = ["convert", models.large_outputs, "-o", out, "--validate", "--rtol", "1e-12"]
    res = cli([*args, "--keep-failed"], monkeypatch=monkeypatch)
    assert res.rc == 1
    assert _lines(res.err)[-1].endswith(
        f"{out} not written; the failed model is in {tmp_path / 'o.failed.onnx'}"
    )
    assert _leftovers(tmp_path) == ["o.failed.onnx"]
    _converted(tmp_path / "o.failed.onnx")


@pytest.mark.parametrize("mode", MODES)
def test_convert_validate_success_writes_and_says_so(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    out = tmp_path / "o.onnx"
    res = cli(["convert", models.small, "-o", out, "--validate"], mode, monkeypatch=monkeypatch)
    assert res.rc == 0, res.err
    assert "PASSED" in res.out
    assert _lines(res.out)[-1] == f"wrote {out} (validated: passed)"
    assert _leftovers(tmp_path) == ["o.onnx"]
    _converted(out)


def test_convert_with_calibration_data_npz_and_folder(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--calibration-data: an .npz with a leading sample axis, or a folder of samples."""
    rng = np.random.default_rng(7)
    stacked = tmp_path / "calib.npz"
    np.savez(stacked, x=rng.random((3, 2, 3, 8, 8)).astype(np.float32))
    folder = tmp_path / "samples"
    folder.mkdir()
    for k, batch in enumerate([1, 4]):  # shapes may differ between files
        np.savez(folder / f"s{k}.npz", x=rng.random((batch, 3, 8, 8)).astype(np.float32))
    for source, count, shape in ((stacked, 3, [2, 3, 8, 8]), (folder, 2, [1, 3, 8, 8])):
        out = tmp_path / f"{source.stem}_fp16.onnx"
        res = cli(
            ["convert", models.sym, "-o", out, "--calibration-data", source, "--json"],
            monkeypatch=monkeypatch,
        )
        assert res.rc == 0, res.err
        report = json.loads(res.out)
        assert any(f"calibrated on {count} sample(s)" in n for n in report["notes"]), report
        assert report["input_shapes"] == {"x": shape}, report["input_shapes"]
        x = rng.random(shape).astype(np.float32)
        assert_close(run_ort(models.sym, {"x": x})["y"], run_ort(out, {"x": x})["y"], "fp16")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=rng.random((3, 8, 8)).astype(np.float32))  # no sample axis
    res = cli(
        ["convert", models.sym, "-o", tmp_path / "o.onnx", "--calibration-data", bad],
        monkeypatch=monkeypatch,
    )
    assert res.rc == 2 and "leading sample axis" in res.err, res.err
    assert len(res.err.strip().splitlines()) == 1, res.err


def test_validate_and_convert_use_the_same_shapes_for_symbolic_dims(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rule for symbolic dims: no --shape, both succeed, both state the same shapes."""
    out = tmp_path / "sym_fp16.onnx"
    converted = cli(["convert", models.sym, "-o", out, "--json"], monkeypatch=monkeypatch)
    assert converted.rc == 0, converted.err
    convert_shapes = json.loads(converted.out)["input_shapes"]
    validated = cli(["validate", models.sym, out, "--json"], monkeypatch=monkeypatch)
    assert validated.rc == 0, validated.err
    report = json.loads(validated.out)
    assert report["passed"] is True, report
    assert report["input_shapes"] == convert_shapes == {"x": [1, 3, 8, 8]}, report
    assert any("dim 0 (N) is symbolic: used 1" in n for n in report["notes"]), report
    table = cli(["validate", models.sym, out], monkeypatch=monkeypatch)
    assert "inputs: x [1, 3, 8, 8]" in table.out, table.out


# --------------------------------------------------------------------------- seams (issue 16)


@pytest.mark.parametrize("command", ["convert", "quantize"])
def test_output_with_a_trailing_slash_is_an_error_and_writes_nothing(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """``-o new.onnx/`` used to write a file ``new.onnx``."""
    target = tmp_path / "new.onnx"
    res = cli([command, models.small, "-o", f"{target}/"], monkeypatch=monkeypatch)
    assert res.rc == 2, (res.rc, res.err)
    assert res.err.strip().splitlines() == [
        f"mixprec: error: {target}/: names a folder (trailing slash), not a file"
    ], res.err
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_quiet_prints_only_what_was_written(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``-q`` used to print the whole summary table."""
    out = tmp_path / "q.onnx"
    loud = cli(["convert", models.small, "-o", out], monkeypatch=monkeypatch)
    assert loud.rc == 0 and len(loud.out.splitlines()) > 2, loud.out
    quiet = cli(["convert", models.small, "-o", out, "-q"], monkeypatch=monkeypatch)
    assert quiet.rc == 0, quiet.err
    assert quiet.out.splitlines() == [f"wrote {out}"], quiet.out
    page = tmp_path / "r.html"
    report = cli(["report", models.small, "-o", page, "-q"], monkeypatch=monkeypatch)
    assert report.rc == 0 and report.out.splitlines()[0].startswith(f"wrote {page} "), report.out
    assert len(report.out.splitlines()) == 1, report.out


@pytest.mark.parametrize("spelling", ["int8", "I8"])
def test_every_command_takes_the_same_int8_spellings(
    models: Paths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    """``report --dtype i8`` used to be refused while ``tune --dtype i8`` was accepted."""
    page = tmp_path / "r.html"
    report = cli(["report", models.small, "-o", page, "--dtype", spelling], monkeypatch=monkeypatch)
    assert report.rc == 0, report.err
    assert "INT8" in page.read_text()
    inspect = cli(["inspect", models.small, "--dtype", spelling, "--json"], monkeypatch=monkeypatch)
    assert inspect.rc == 0 and json.loads(inspect.out)["target"] == "int8", inspect.err
    for bad in ("u8", "fp8"):
        res = cli(["report", models.small, "-o", page, "--dtype", bad], monkeypatch=monkeypatch)
        assert res.rc == 2 and len(res.err.strip().splitlines()) == 1, res.err
        assert f"unknown --dtype '{bad}'" in res.err and "i8" in res.err, res.err


def test_onnxruntime_log_lines_stay_off_the_users_screen(tmp_path: Path) -> None:
    """With a home folder ORT cannot write (as an unprivileged user has), ORT warns while it
    is imported; a failing command still prints exactly its own one line, and a run that
    fails inside ORT prints only mixprec's line too."""
    model = tmp_path / "m.onnx"
    onnx.save(make_model(small_model_text()), model)
    home = {"HOME": os.devnull}
    failed = cli(["convert", model, "-o", tmp_path / "no" / "such" / "x.onnx"], "subproc", env=home)
    assert failed.rc == 2 and len(failed.err.strip().splitlines()) == 1, failed.err
    assert failed.err.startswith("mixprec: error: "), failed.err
    # ORT refuses the run (wrong rank): no [E:onnxruntime ...] line beside mixprec's own
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{name: np.zeros((2, 2, 2, 2, 2), np.float32) for name in _input_names(model)})
    ran = cli(["convert", model, "-o", tmp_path / "x.onnx", "--inputs", bad], "subproc", env=home)
    assert ran.rc == 2 and "onnxruntime:" not in ran.err.replace("onnxruntime failed", ""), ran.err
    assert len(ran.err.strip().splitlines()) == 1, ran.err


def _input_names(path: Path) -> list[str]:
    return [i.name for i in onnx.load(path).graph.input]


def test_version_prints_the_version() -> None:
    done = cli(["--version"], "subproc")
    assert done.rc == 0 and done.out.strip() == f"mixprec {mixprec.__version__}", done
