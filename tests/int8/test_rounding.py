"""Learned rounding (AdaRound) of INT8 weights: the layer input capture, the per-layer fit
(torch and numpy), and ``quantize(rounding="learned")`` against ONNX Runtime's FP32 run.

The inputs are image-like: smooth random fields plus a little noise, so that neighbouring
pixels are correlated as in photos; that correlation is what learned rounding exploits
(on white noise, round-to-nearest is already near the best).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.calibrate.capture import capture_inputs, layer_input
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.int8.adaround import RoundingBudget, learn_rounding
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.params import quantize_weight
from mixprec.int8.rounding import LearnedRoundingPass
from mixprec.pipeline.quantize import QuantizePipeline

BACKENDS = ["numpy"] + (["torch"] if importlib.util.find_spec("torch") is not None else [])


def _images(n: int, seed: int, channels: int = 3, size: int = 24) -> np.ndarray:
    """Photo-like NCHW images in [0, 1): bilinear upsampling of a coarse grid, plus noise."""
    rng = np.random.default_rng(seed)
    coarse = rng.random((n, channels, 5, 5))
    pos = np.linspace(0, 4, size)
    lo = np.minimum(pos.astype(int), 3)
    f = pos - lo
    rows = coarse[:, :, lo] * (1 - f)[:, None] + coarse[:, :, lo + 1] * f[:, None]
    img = rows[..., lo] * (1 - f) + rows[..., lo + 1] * f
    img += rng.normal(0, 0.02, img.shape)
    return np.clip(img, 0, 0.999).astype(np.float32)


def _conv_model(group: int = 1) -> onnx.ModelProto:
    """Conv(3x3, stride 2, pads 1, ``group``) -> Relu -> Conv(1x1) -> GAP -> Flatten -> Gemm."""
    rng = np.random.default_rng(7)
    c_in = 4
    inits = [
        numpy_helper.from_array(
            (0.4 * rng.standard_normal((16, c_in // group, 3, 3))).astype(np.float32), "w1"
        ),
        numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "b1"),
        numpy_helper.from_array(
            (0.3 * rng.standard_normal((12, 16, 1, 1))).astype(np.float32), "w2"
        ),
        numpy_helper.from_array((0.4 * rng.standard_normal((12, 5))).astype(np.float32), "wf"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1],
                         strides=[2, 2], group=group),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "wf"], ["y"], name="fc"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c_in, 24, 24])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5]),
            helper.make_tensor_value_info("c1", TensorProto.FLOAT, ["N", 16, 12, 12]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


# --- capture -------------------------------------------------------------------------------


def test_captured_patches_reproduce_the_conv_output_of_onnx_runtime():
    """With room for every output position, the captured im2col rows times the weight give
    the Conv's output as ONNX Runtime computes it: compared through the order-free Gram
    matrix ``Yᵀ Y`` of the outputs (a grouped, strided, padded Conv); with room for fewer,
    the reservoir keeps exactly that many rows."""
    proto = _conv_model(group=2)
    model = ir.from_proto(proto)
    samples = [{"x": _images(2, seed, 4)} for seed in range(3)]
    conv = next(n for n in model.graph if n.name == "conv1")
    layer = layer_input(conv)
    assert layer is not None and layer.kind == "patches" and layer.width == 4 * 9
    ((_, rows),) = capture_inputs(model, samples, [layer], rows=10_000, per_weight=None)
    assert rows.shape == (3 * 2 * 12 * 12, 4, 9)  # every position of every sample
    w = numpy_helper.to_array(proto.graph.initializer[0])  # [16, 2, 3, 3]
    y = np.concatenate(
        [rows[:, 2 * g : 2 * g + 2].reshape(len(rows), -1) @ w[8 * g : 8 * g + 8].reshape(8, -1).T
         for g in range(2)], axis=1)  # fmt: skip
    bias = numpy_helper.to_array(proto.graph.initializer[1])
    ort_out = np.concatenate([run_ort(proto, s)["c1"] for s in samples])  # [6, 16, 12, 12]
    ref = ort_out.transpose(0, 2, 3, 1).reshape(-1, 16) - bias
    np.testing.assert_allclose(y.T @ y, ref.T @ ref, rtol=1e-4)
    np.testing.assert_allclose(y.sum(0), ref.sum(0), rtol=1e-4, atol=1e-3)
    ((_, few),) = capture_inputs(model, samples, [layer], rows=100)
    assert few.shape == (100, 4, 9)


def test_the_same_seed_captures_the_same_positions():
    """Two captures with one seed and tensors of one shape take the same rows: inputs
    twice as large give rows exactly twice as large (how learned rounding pairs the INT8
    model's layer inputs with the FP32 ones)."""
    model = ir.from_proto(_conv_model())
    layer = layer_input(next(n for n in model.graph if n.name == "conv1"))
    assert layer is not None
    samples = [{"x": _images(2, seed, 4)} for seed in range(3)]
    doubled = [{"x": 2 * s["x"]} for s in samples]
    ((_, rows),) = capture_inputs(model, samples, [layer], rows=300, per_weight=None, seed=5)
    ((_, twice),) = capture_inputs(model, doubled, [layer], rows=300, per_weight=None, seed=5)
    assert rows.shape == (300, 4, 9) and np.abs(rows).sum() > 0
    np.testing.assert_array_equal(twice, 2 * rows)


def test_captured_gemm_rows_are_the_gemm_input():
    model = ir.from_proto(_conv_model())
    fc = next(n for n in model.graph if n.name == "fc")
    layer = layer_input(fc)
    assert layer is not None and layer.kind == "rows" and layer.width == 12
    samples = [{"x": _images(3, seed, 4)} for seed in range(2)]
    ((_, rows),) = capture_inputs(model, samples, [layer])
    assert rows.shape == (6, 12)  # one row per image
    flat = np.concatenate(
        [run_ort(_conv_model(), s)["y"] for s in samples]
    )  # y = rows @ wf: the rows are the Gemm's inputs, in some order
    wf = numpy_helper.to_array(_conv_model().graph.initializer[3])
    np.testing.assert_allclose(np.sort((rows @ wf).ravel()), np.sort(flat.ravel()), rtol=1e-4)


# --- the per-layer fit ---------------------------------------------------------------------


def _patch_rows(n: int, seed: int) -> np.ndarray:
    """3x3 patches of 4-channel photo-like images, ``[n, 36]``."""
    img = _images(4, seed, 4, 32)
    rng = np.random.default_rng(seed)
    b, y, x = rng.integers(0, 4, n), rng.integers(0, 30, n), rng.integers(0, 30, n)
    rows = (y[:, None] + np.arange(3))[:, None, :, None]
    cols = (x[:, None] + np.arange(3))[:, None, None, :]
    patch = img[b[:, None, None, None], np.arange(4)[None, :, None, None], rows, cols]
    return patch.reshape(n, -1).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_channel", [True, False])
def test_learned_rounding_lowers_the_layer_output_error(backend: str, per_channel: bool):
    """A 32x36 Conv weight on photo-like patches: the learned codes lower the output's
    squared error on patches of other images by at least 20% against round-to-nearest
    (measured: about 40-60%), stay inside [-127, 127] and differ from nearest by at most 1."""
    rng = np.random.default_rng(3)
    w = (0.3 * rng.standard_normal((32, 36))).astype(np.float32)
    quantized = quantize_weight(w, 0 if per_channel else None)
    assert not isinstance(quantized, str)
    nearest, params = quantized
    scale = params.scale.reshape(1, -1, 1) if per_channel else params.scale
    rows = _patch_rows(2000, seed=1)
    fit = learn_rounding(w[None], scale, rows[None], backend=backend)
    codes = fit.codes[0].astype(np.int32)
    assert fit.iterations > 0 and fit.changed > 0 and not fit.why
    assert np.abs(codes).max() <= 127
    assert np.abs(codes - nearest).max() == 1
    assert fit.learned < fit.nearest
    fresh = _patch_rows(2000, seed=2)  # other images
    s = params.scale.reshape(-1, 1) if per_channel else params.scale
    err_near = np.mean((fresh @ (nearest * s - w).T) ** 2)
    err_learned = np.mean((fresh @ (codes * s - w).T) ** 2)
    assert err_learned < 0.8 * err_near, (err_learned, err_near)


def test_both_backends_learn_the_same_codes():
    if len(BACKENDS) < 2:
        pytest.skip("torch is not importable")
    rng = np.random.default_rng(4)
    w = (0.3 * rng.standard_normal((1, 16, 36))).astype(np.float32)
    scale = np.abs(w).max(axis=2, keepdims=True) / 127
    rows = _patch_rows(800, seed=5)[None]
    fits = [learn_rounding(w, scale, rows, backend=b) for b in BACKENDS]
    agree = np.mean(fits[0].codes == fits[1].codes)
    assert agree > 0.99, agree  # float32 in both; a few near-ties may fall either way
    assert fits[0].learned == pytest.approx(fits[1].learned, rel=0.05)


def test_a_layer_with_too_few_rows_keeps_nearest():
    """A fit with fewer rows than weights per output channel would be noise."""
    w = np.random.default_rng(0).standard_normal((1, 4, 50)).astype(np.float32)
    scale = np.abs(w).max(axis=2, keepdims=True) / 127
    fit = learn_rounding(w, scale, _patch_rows(40, 0)[None, :, :36].repeat(2, axis=2)[..., :50])
    assert fit.iterations == 0 and "fitting rows" in fit.why
    np.testing.assert_array_equal(fit.codes, np.round(w / scale))
    assert fit.learned == fit.nearest


def test_budget_caps_the_steps_of_a_wide_layer():
    w = np.random.default_rng(0).standard_normal((1, 8, 64)).astype(np.float32)
    scale = np.abs(w).max(axis=2, keepdims=True) / 127
    rows = _patch_rows(400, 0)[None].repeat(2, axis=2)[..., :64]
    fit = learn_rounding(w, scale, rows, budget=RoundingBudget(macs=2 * 8 * 64 * 64 * 150))
    assert fit.iterations == 150
    tight = learn_rounding(w, scale, rows, budget=RoundingBudget(macs=2 * 8 * 64 * 64 * 50))
    assert tight.iterations == 0 and "budget" in tight.why


# --- quantize(rounding="learned") ---------------------------------------------------------


def _int8_weight(model: onnx.ModelProto, name: str) -> tuple[np.ndarray, np.ndarray]:
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    return inits[f"{name}_int8"], inits[f"{name}_scale"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_with_learned_rounding_is_closer_to_fp32_in_onnx_runtime(backend, monkeypatch):
    """All-INT8 with per-tensor weight scales (where rounding matters most): learned
    rounding lowers the rel L2 of the first Conv's output against the FP32 run on
    held-out images, the written int8 weights differ from nearest's by at most 1, and the
    report says what it did."""
    monkeypatch.setattr("mixprec.int8.rounding.backend_name", lambda _b: backend)
    proto = _conv_model(group=2)
    calib = [{"x": _images(4, seed, 4)} for seed in range(6)]
    held = {"x": _images(8, 99, 4)}
    ref = run_ort(proto, held)
    common = {"speed": "off", "guard": False, "per_channel": False, "method": "minmax"}
    near = mixprec.quantize(proto, calib, rounding="nearest", **common)
    learned = mixprec.quantize(proto, calib, rounding="learned", **common)

    def err(result) -> float:
        out = run_ort(result.model_proto, held)["c1"]
        return rel_l2_error(ref["c1"], out)

    assert err(learned) < 0.9 * err(near), (err(learned), err(near))
    codes, _ = _int8_weight(learned.model_proto, "w1")
    nearest, _ = _int8_weight(near.model_proto, "w1")
    assert np.abs(codes.astype(int) - nearest).max() == 1
    summary = learned.report.quantization["rounding"]
    assert summary["layers_learned"] >= 1 and summary["backend"] == backend
    assert summary["mean_rel_error_learned"] < summary["mean_rel_error_nearest"]
    assert set(summary["layers"]) | set(summary["kept_nearest"]) == {"conv1", "conv2", "fc"}
    assert any(n.startswith("learned rounding") for n in learned.report.notes)
    assert "rounding" not in near.report.quantization


def test_cli_rounding_learned(tmp_path: Path, capsys, monkeypatch):
    """``--rounding learned`` from a folder of samples: the JSON report holds the
    rounding summary (numpy: torch's import alone would take longer than the run)."""
    monkeypatch.setattr("mixprec.int8.rounding.backend_name", lambda _b: "numpy")
    src = tmp_path / "cnn.onnx"
    onnx.save(_conv_model(), src)
    folder = tmp_path / "calib"
    folder.mkdir()
    for k in range(5):
        np.savez(folder / f"{k}.npz", x=_images(4, k, 4))
    out = tmp_path / "int8.onnx"
    rc = main(["quantize", str(src), "-o", str(out), "--calibration-data", str(folder),
               "--rounding", "learned", "--method", "minmax", "--speed", "off", "--no-guard",
               "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rounding = json.loads(captured.out)["quantization"]["rounding"]
    assert rounding["samples"] == 5 and rounding["layers_learned"] >= 1
    assert set(rounding["seconds"]) == {"capture", "fit"}


def test_quantized_inputs_pair_the_int8_models_rows_with_the_fp32_ones():
    """``inputs="quantized"`` (AdaRound's asymmetric mode) fits against the inputs a
    round-to-nearest INT8 copy feeds each layer, captured at the FP32 rows' positions:
    every layer with enough rows learns, none is refused for rows that do not pair, and
    the graph is left as it was."""
    model = ir.from_proto(_conv_model())
    calib = [{"x": _images(4, seed, 4)} for seed in range(6)]
    QuantizePipeline(QuantizeConfig(speed="off", method="minmax"), calibration_data=calib).run(
        model, until="annotate"
    )
    before = len(list(model.graph))
    result = LearnedRoundingPass(calib, inputs="quantized", backend="numpy")(model)
    assert not result.modified and len(list(model.graph)) == before
    assert {"conv1", "conv2"} <= set(result.layers) | set(result.kept_nearest)
    assert not any("pair" in why for why in result.kept_nearest.values())
    assert result.layers and all(a <= b for b, a in result.layers.values())
    with pytest.raises(MixprecError, match="inputs must be one of"):
        LearnedRoundingPass(calib, inputs="int8")


def test_learned_rounding_without_data_keeps_nearest_and_says_why():
    result = mixprec.quantize(_conv_model(), speed="off", guard=False, rounding="learned")
    summary = result.report.quantization["rounding"]
    assert summary["layers_learned"] == 0
    assert set(summary["kept_nearest"].values()) == {"no calibration samples"}


def test_bad_rounding_is_one_clear_error():
    with pytest.raises(MixprecError, match="rounding must be one of nearest, learned"):
        mixprec.quantize(_conv_model(), rounding="adaround")
