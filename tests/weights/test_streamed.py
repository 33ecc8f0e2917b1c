"""Weight-only quantization of a model over 2 GB in bounded memory (issue 28): the
weights read from the memory-mapped data file a slice at a time, the FP32 reference run
in pieces (:mod:`mixprec.runtime.pieces`), and the big test's peak RSS measured in a
child process. The >2 GB data file is sparse: its size is set with ``truncate`` and only
a few real rows are written, so it costs a few MB of disk."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.api.weight_only import quantize_weights
from mixprec.cli.main import main
from mixprec.core.metrics import rel_l2_error
from mixprec.runtime import pieces
from mixprec.runtime.pieces import plan_pieces, run_in_pieces
from mixprec.weights import mixed_bits, slices, stats
from mixprec.weights.blocks import BlockSpec, quantize_rtn
from mixprec.weights.slices import quantize_in_slices

RNG = np.random.default_rng(28)
_ALIGN = 4096


def _external(name: str, shape: tuple[int, ...], location: str, offset: int) -> TensorProto:
    """A float32 initializer whose bytes are at ``offset`` of the data file ``location``."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    tensor.data_location = TensorProto.EXTERNAL
    nbytes = 4 * int(np.prod(shape))
    for key, value in (("location", location), ("offset", offset), ("length", nbytes)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def write_branches(
    folder: Path, k0: int, hidden: int, n: int, branches: int, rows: int
) -> tuple[Path, dict[str, np.ndarray]]:
    """``y = sum_i (x @ w0) @ w_i``: ``w0 [k0, hidden]`` dense, each ``w_i [hidden, n]``
    real in its first ``rows`` rows and zero below, in a data file written sparse (only
    the real bytes; the rest is a hole). Returns the model path and the real arrays."""
    path, data = folder / "big.onnx", folder / "big.onnx.data"
    real = {"w0": (RNG.standard_normal((k0, hidden)) * 0.2).astype(np.float32)}
    shapes = {"w0": (k0, hidden)}
    for i in range(1, branches + 1):
        real[f"w{i}"] = (RNG.standard_normal((rows, n)) * 0.05).astype(np.float32)
        shapes[f"w{i}"] = (hidden, n)
    tensors, offset = [], 0
    with open(data, "wb") as fh:
        for name, shape in shapes.items():
            tensors.append(_external(name, shape, data.name, offset))
            fh.seek(offset)
            fh.write(real[name].tobytes())
            offset += -(-4 * int(np.prod(shape)) // _ALIGN) * _ALIGN
        fh.truncate(offset)
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0")]
    total = None
    for i in range(1, branches + 1):
        nodes.append(helper.make_node("MatMul", ["h", f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        if total is not None:
            nodes.append(helper.make_node("Add", [total, f"y{i}"], [f"s{i}"], name=f"add{i}"))
        total = f"s{i}" if total is not None else f"y{i}"
    nodes.append(helper.make_node("Relu", [total], ["y"], name="relu"))
    graph = helper.make_graph(
        nodes,
        "branches",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, k0])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, n])],
        initializer=tensors,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save_model(model, path)
    return path, real


def reference(real: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The FP32 output from the real rows only (the rest of each weight is zero)."""
    h = x.astype(np.float64) @ real["w0"]
    total = sum(h[..., : w.shape[0]] @ w for name, w in real.items() if name != "w0")
    return np.maximum(total, 0.0)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


# --- small: the pieces and the slices give what the whole model gives ------------------------


def test_slices_give_the_codes_of_the_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = RNG.standard_normal((100, 77)).astype(np.float32)
    spec = BlockSpec(4, 32, symmetric=False)
    whole = quantize_rtn(weight, spec)
    released = []
    parts = quantize_in_slices(
        lambda w: quantize_rtn(w, spec), weight.T.T, lambda: released.append(1), max_bytes=4000
    )
    assert len(released) == len(slices.column_slices(100, 77, 4000)) > 1
    for field in ("codes", "scales", "zero_points"):
        np.testing.assert_array_equal(getattr(parts, field), getattr(whole, field))


def _if_model() -> onnx.ModelProto:
    """MatMul -> If (its branches read an outer weight and value) -> MatMul."""
    w1, w2, w3 = (RNG.standard_normal((16, 16)).astype(np.float32) for _ in range(3))
    then = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w2"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["a"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["b"], then_branch=then, else_branch=other),
        helper.make_node("MatMul", ["b", "w3"], ["y"]),
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in (("w1", w1), ("w2", w2), ("w3", w3))]
    inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16]),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 16]),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_pieces_run_the_model_as_one_session_does() -> None:
    model = _if_model()
    sizes = {"w1": 1024, "w2": 1024, "w3": 1024}
    pieces = plan_pieces(model.graph, sizes, 1024)
    assert len(pieces) == 3  # w1, ReduceSum, Greater | If (w2 read by its branch) | w3
    assert pieces[1].initializers == ["w2"] and pieces[1].inputs == ["a", "c"]
    assert pieces[0].outputs == ["a", "c"] and pieces[1].outputs == ["b"]
    feeds = [{"x": RNG.standard_normal((2, 16)).astype(np.float32)} for _ in range(2)]
    got = run_in_pieces(ir.from_proto(model), feeds, threads=1, max_bytes=1024)
    for f, out in zip(feeds, got, strict=True):
        want = run_ort(model, f)
        np.testing.assert_allclose(out["y"], want["y"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["a"], want["a"])


@pytest.mark.parametrize("past", [0, 5])
def test_a_kv_cache_decoder_in_many_pieces_gives_one_sessions_outputs(past: int) -> None:
    """Pieces of 20 KB of weights cut the tiny decoder into dozens of models: shape
    arithmetic, masks (int64, bool) and the empty cache cross their boundaries."""
    from llm_models import DecoderConfig, decoder_feeds, tiny_decoder

    cfg = DecoderConfig()
    model = tiny_decoder(cfg, seed=3)
    feeds = [decoder_feeds(cfg, past=past, seed=s) for s in (1, 2)]
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    assert len(plan_pieces(model.graph, sizes, 20 << 10)) > 10
    got = run_in_pieces(ir.from_proto(model), feeds, threads=1, max_bytes=20 << 10)
    for f, out in zip(feeds, got, strict=True):
        want = run_ort(model, f)
        assert out.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(out[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_streamed_run_writes_what_the_in_memory_run_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = write_branches(tmp_path, 16, 256, 320, branches=3, rows=256)
    monkeypatch.setattr(slices, "SLICE_BYTES", 64 << 10)  # slices of the 327 KB weights
    streamed = quantize_weights(str(path), weights="int4", stream=True)
    whole = quantize_weights(str(path), weights="int4", stream=False)
    assert any(note.startswith("streamed:") for note in streamed.report.notes)
    assert not any(note.startswith("streamed:") for note in whole.report.notes)
    a, b = (
        {n: v.const_value.numpy() for n, v in r.model.graph.initializers.items()}
        for r in (streamed, whole)
    )
    assert a.keys() == b.keys() and any(n.endswith("_q4") for n in a)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert streamed.report.guard["passed"] and whole.report.guard["passed"]
    checks, others = streamed.report.guard["checks"], whole.report.guard["checks"]
    assert [(c["output"], c["kind"]) for c in checks] == [(o["output"], o["kind"]) for o in others]
    for check, other in zip(checks, others, strict=True):  # the same readings, the same values
        assert check["value"] == pytest.approx(other["value"], rel=1e-4, abs=1e-6), check
        assert check["rel_l2"] == pytest.approx(other["rel_l2"], rel=1e-4)


def test_cli_stream_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--stream puts a small model on the streamed path; without --weights, one line."""
    path, _ = write_branches(tmp_path, 16, 64, 64, branches=2, rows=64)
    out = tmp_path / "out.onnx"
    assert (
        main(["quantize", str(path), "-o", str(out), "--weights", "int4", "--stream", "--json"])
        == 0
    )
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any(n.startswith("streamed:") for n in notes), notes
    assert main(["quantize", str(path), "-o", str(out), "--stream"]) == 2
    assert "--stream/--no-stream needs --weights" in capsys.readouterr().err


def test_streamed_layer_statistics_equal_one_sessions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """X^T X of every layer input, tapped from the model run in pieces of one weight each,
    equals the sums one ONNX Runtime session fetches (float32 sums in another order)."""
    path, _ = write_branches(tmp_path, 16, 64, 48, branches=3, rows=64)
    model = ir.load(str(path))
    monkeypatch.setattr(pieces, "PIECE_BYTES", 64 * 48 * 4)  # one branch per piece
    widths = {"x": 16, "h": 64}
    samples = [{"x": RNG.standard_normal((1, 8, 16)).astype(np.float32)} for _ in range(3)]
    seen: list[str] = []
    consume = lambda i, name, array: seen.append(name)  # noqa: E731
    pieces.tap_in_pieces(model, samples, pieces.Taps(frozenset(widths), consume), threads=1)
    assert sorted(seen) == ["h"] * 3 + ["x"] * 3
    streamed = stats.collect_hessians(model, samples, widths, streamed=True)
    whole = stats.collect_hessians(model, samples, widths)
    assert streamed.rows == whole.rows == {"x": 24, "h": 24} and streamed.samples == 3
    for name in widths:
        np.testing.assert_allclose(streamed.means[name], whole.means[name], rtol=1e-5, atol=1e-6)
    x = np.concatenate([s["x"] for s in samples]).reshape(-1, 16).astype(np.float64)
    np.testing.assert_allclose(whole.means["x"], x.T @ x / 24, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_data_aware_methods_quantize_a_streamed_model_as_a_whole_one(
    tmp_path: Path, method: str
) -> None:
    """GPTQ and AWQ on a streamed model (its statistics tapped from pieces) write the
    codes they write for the same model in one session: the two results answer alike in
    ONNX Runtime, and the report says which method ran on the layer statistics."""
    path, _ = write_branches(tmp_path, 16, 64, 64, branches=2, rows=64)
    samples = [{"x": RNG.standard_normal((1, 8, 16)).astype(np.float32)} for _ in range(6)]
    results = {
        stream: quantize_weights(
            str(path), samples, weights="int4", weight_method=method, stream=stream, guard=False
        )
        for stream in (True, False)
    }
    notes = results[True].report.notes
    assert any(n.startswith("streamed:") for n in notes), notes
    assert any(n.startswith("layer statistics: X^T X of 2 MatMul inputs") for n in notes), notes
    assert results[True].report.quantization["method"] == method
    x = {"x": RNG.standard_normal((1, 8, 16)).astype(np.float32)}
    outs = {}
    for stream, result in results.items():
        out = tmp_path / f"out-{stream}.onnx"
        result.save(out)
        outs[stream] = run_ort(str(out), x)["y"]
    np.testing.assert_allclose(outs[True], outs[False], rtol=1e-5, atol=1e-6)


# --- big: over 2 GB, sparse, in a child process whose peak RSS is read -----------------------

#: Child: quantize with the CLI, then write its own VmHWM (peak resident set, the
#: memory-mapped data file's resident pages included) to argv[1].
_CHILD = """
import sys
from mixprec.cli.main import main
try:
    code = main(sys.argv[2:])
finally:
    status = open("/proc/self/status").read()
    peak = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")]
    open(sys.argv[1], "w").write(peak[0])
sys.exit(code)
"""


@pytest.fixture
def big_folder(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, its model files removed afterwards (pytest keeps recent tmp folders:
    the quantized model is 366 MB)."""
    yield tmp_path
    for path in tmp_path.glob("*.onnx*"):
        path.unlink()


@pytest.mark.slow
def test_a_model_over_2_gb_is_quantized_in_half_its_size_plus_1_gb(big_folder: Path) -> None:
    """``mixprec quantize big.onnx -o out.onnx --weights int4 --calibration-data DIR`` in a
    child process, on x[1, 8, 64] @ w0 [64, 512] then 4 branches [512, 278528] summed:
    2.28 GB of float32 in a sparse data file. With calibration data "auto" is AWQ, whose
    layer statistics (X^T X of x and of h) are tapped from the model run in
    pieces. Measured: the child's VmHWM (its peak resident set, the
    memory-mapped data file's resident pages included) against half the data file's size
    plus 1 GiB; the input files' sha256 before and after; out.onnx run in ONNX Runtime
    against a float64 numpy reference of the FP32 model."""
    tmp_path = big_folder
    path, real = write_branches(tmp_path, 64, 512, 278528, branches=4, rows=96)
    data = tmp_path / "big.onnx.data"
    size = data.stat().st_size
    assert size > 2 << 30
    before = {p.name: _sha256(p) for p in (path, data)}
    out, peak_file = tmp_path / "out.onnx", tmp_path / "peak"
    calib = tmp_path / "calib"
    calib.mkdir()
    for i in range(4):
        np.savez(calib / f"{i}.npz", x=RNG.standard_normal((1, 8, 64)).astype(np.float32))
    args = [str(path), "-o", str(out), "--weights", "int4", "--json"]
    args += ["--calibration-data", str(calib)]
    clock = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(peak_file), "quantize", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    seconds = time.perf_counter() - clock
    assert child.returncode == 0, child.stderr[-2000:]
    peak = int(peak_file.read_text()) * 1024  # VmHWM is in kB
    budget = size // 2 + (1 << 30)
    print(f"data {size / 2**30:.2f} GiB, peak RSS {peak / 2**30:.2f} GiB, budget "
          f"{budget / 2**30:.2f} GiB, {seconds:.0f} s")  # fmt: skip
    assert peak <= budget, f"peak RSS {peak / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB"
    assert {p.name: _sha256(p) for p in (path, data)} == before  # the input is unchanged

    written = json.loads(child.stdout)
    notes = written["notes"]
    assert any(n.startswith("streamed:") for n in notes), notes
    assert any("auto -> awq" in n for n in notes), notes
    assert any(n.startswith("layer statistics: X^T X of 2 MatMul inputs") for n in notes), notes
    x = RNG.standard_normal((1, 8, 64)).astype(np.float32)
    got = run_ort(str(out), {"x": x})["y"]
    want = reference(real, x)
    rel = rel_l2_error(want, got)
    assert rel < 0.15, rel  # int4 blocks of 32 with int8 activations (accuracy_level 4)


@pytest.mark.slow
def test_a_streamed_language_model_is_guarded_and_repaired(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tiny decoder with its weights in a data file, streamed: AWQ reads its layer
    statistics from the pieces and folds its scales as in one session (the first model's
    measures equal the whole model's), the next-token guard's FP32 reference comes from
    the pieces, a KL budget that int4 misses is repaired, ranked by the output error on
    calibration windows the run's mixed choice recorded, and the written model's
    measures are recomputed here from ONNX Runtime runs."""
    pytest.importorskip("tokenizers", reason="the [llm] extra (tokenizers) is missing")
    from guard.test_language_guard import CFG, _folder, _numpy_guard
    from llm_models import tiny_decoder
    from mixprec.checks.guard_samples import WINDOWS_HELD_OUT_SHARE, held_out_indices
    from mixprec.inputs.text import TextSamples

    path = _folder(tmp_path, tiny_decoder(CFG, seed=3))
    onnx.save(onnx.load(str(path)), str(path), save_as_external_data=True, size_threshold=1024)
    budget = {"guard_kl": 0.004, "guard_drop": 0.5, "guard_perplexity": 0.5}
    # a default size budget with room for every layer at 8 bits
    monkeypatch.setattr(mixed_bits, "DEFAULT_RATIO", 0.0)
    monkeypatch.setattr(mixed_bits, "DEFAULT_MOST_LAYERS", 1.0)
    calib = tmp_path / "calib.txt"
    runs = {
        stream: mixprec.quantize(
            path,
            calib,
            weights="int4",
            text_window=64,
            stream=stream,
            **budget,
        )
        for stream in (True, False)
    }
    guard, whole = runs[True].report.guard, runs[False].report.guard
    assert guard["passed"] and guard["repair"] and guard["first"]["kl"] > 0.004 >= guard["kl"]
    # the FP32 reference from the pieces is one session's; the layer statistics agree to
    # 1e-7 (float32 sums in another order), which can still move AWQ's alpha between
    # near-equal errors on this random decoder: the int4 measures agree within 2 tokens
    assert guard["first"]["perplexity_fp32"] == pytest.approx(
        whole["first"]["perplexity_fp32"], rel=1e-4
    )
    assert abs(guard["first"]["agreement"] - whole["first"]["agreement"]) <= 2 / 252
    for key in ("kl", "perplexity"):
        assert guard["first"][key] == pytest.approx(whole["first"][key], rel=0.05), key
    # ranked by the scores the run's mixed choice computed on the calibration windows
    assert all("the run's ranking: output error" in why for _, why in guard["promoted"].values())
    notes = runs[True].report.notes  # the repaired model's report carries the run's notes
    assert any(n.startswith("streamed:") for n in notes)
    assert any("auto -> awq" in n for n in notes), notes
    assert any(n.startswith("activation-aware scaling") for n in notes), notes
    held = list(TextSamples(calib, path, tmp_path / "tokenizer.json", window=64))
    out = tmp_path / "out.onnx"
    runs[True].save(out)
    expect = _numpy_guard(
        path, out, [held[k] for k in held_out_indices(len(held), share=WINDOWS_HELD_OUT_SHARE)[:4]]
    )
    for key in ("kl", "agreement", "perplexity", "perplexity_fp32"):
        assert guard[key] == pytest.approx(expect[key], rel=1e-3, abs=1e-5), key
