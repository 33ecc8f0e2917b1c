"""SmoothQuant (mixprec.int8.smooth): outlier channels move from activations to weights.

The graph: two LayerNormalizations whose scales have a few channels 40x the others (how
transformer outlier channels arise). The first feeds one MatMul only (1/s folds into its
scale and bias); the second feeds Q, K and V and a residual Add (1/s becomes one float
Mul shared by the three, which share s).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.plan import KEEP_FLOAT
from mixprec.int8.smooth import SmoothQuantPass, head_of, smoothing_scales

C, N, S = 32, 24, 12
OUTLIERS = [3, 17, 29]
LAYERS = ("mm", "q", "k", "v")


def _model(outliers: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    gamma = rng.uniform(0.5, 1.5, C).astype(np.float32)
    if outliers:
        gamma[OUTLIERS] = [40.0, -35.0, 50.0]
    beta = rng.normal(0.0, 0.1, C).astype(np.float32)
    inits = [numpy_helper.from_array(gamma, "gamma"), numpy_helper.from_array(beta, "beta")]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln1"], name="ln1"),
        helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["ln2"], name="ln2"),
        helper.make_node("Add", ["ln2", "x"], ["residual"], name="residual"),
    ]
    outputs = ["residual"]
    for name in LAYERS:
        weight = rng.normal(0.0, 0.2, (C, N)).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"W_{name}"))
        source = "ln1" if name == "mm" else "ln2"
        nodes.append(helper.make_node("MatMul", [source, f"W_{name}"], [name], name=name))
        outputs.append(name)
    graph = helper.make_graph(
        nodes,
        "smooth",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, S, C]) for n in ("x", "h")],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, S, C if n == "residual" else N])
            for n in outputs
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _samples(count: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {n: rng.normal(0.0, 1.0, (1, S, C)).astype(np.float32) for n in ("x", "h")}
        for _ in range(count)
    ]


def _smooth(alpha: float | None) -> tuple[onnx.ModelProto, ir.Model, object]:
    original = _model()
    model = ir.from_proto(original)
    result = SmoothQuantPass(_samples(8, 1), alpha=alpha)(model)
    return original, model, result


def _layer_norm(x: np.ndarray, model: onnx.ModelProto) -> np.ndarray:
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * init["gamma"] + init["beta"]


def test_smoothing_migrates_the_scales_and_keeps_the_fp32_function():
    original, model, result = _smooth(0.5)
    assert result.modified
    by_tensor = {i.tensor: i for i in result.inputs}
    folded, shared = by_tensor["ln1"], by_tensor["ln2"]
    assert "LayerNormalization" in folded.how and folded.nodes == ("mm",)
    assert "Mul" in shared.how and set(shared.nodes) == {"q", "k", "v"}
    for item in (folded, shared):  # the outlier channels flatten
        assert item.ratio_before > 10 and item.ratio_after < item.ratio_before / 3

    # Migrated scales equal the formula, from the activation maxima over the samples.
    weights = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    samples = _samples(8, 1)
    for source, layers in (("x", ["mm"]), ("h", ["q", "k", "v"])):
        act = np.max(
            [np.abs(_layer_norm(s[source], original)).max(axis=(0, 1)) for s in samples], 0
        )
        w_max = np.max([np.abs(weights[f"W_{n}"]).max(axis=1) for n in layers], axis=0)
        s = smoothing_scales(act, w_max, 0.5)
        for name in layers:
            node = next(n for n in model.graph if n.name == name)
            new = node.inputs[1].const_value.numpy()
            np.testing.assert_allclose(new, weights[f"W_{name}"] * s[:, None], rtol=1e-4)
    muls = [n for n in model.graph if n.op_type == "Mul"]
    assert len(muls) == 1 and KEEP_FLOAT in muls[0].metadata_props  # one Mul for Q, K, V
    ln1 = next(n for n in model.graph if n.name == "ln1")
    assert ln1.inputs[1].name != "gamma"  # a scaled copy; ln2 still reads the original
    assert next(n for n in model.graph if n.name == "ln2").inputs[1].name == "gamma"

    smoothed = ir.to_proto(model)
    onnx.checker.check_model(smoothed, full_check=True)
    for feeds in _samples(3, 7):
        want, got = run_ort(original, feeds), run_ort(smoothed, feeds)
        for name in want:
            assert_close(want[name], got[name], "float32", name=name)


def _error(model: onnx.ModelProto, feeds_list: list[dict[str, np.ndarray]]) -> float:
    reference = _model()
    worst = 0.0
    for feeds in feeds_list:
        want, got = run_ort(reference, feeds), run_ort(model, feeds)
        for name in LAYERS:
            rel = rel_l2_error(want[name], got[name])
            worst = max(worst, float(rel))
    return worst


def test_static_int8_error_drops_with_smoothing():
    options = dict(mode="static", speed="off", guard=False, per_channel=True, method="minmax")
    calibration = _samples(8, 1)
    plain = mixprec.quantize(_model(), calibration, smooth=None, **options)
    smooth = mixprec.quantize(_model(), calibration, smooth="auto", **options)
    # Scored on the calibration samples: on others, ranges from 96 tokens clip the outlier
    # channels of unseen tokens, an error alike in both that hides the rest.
    before, after = _error(plain.model_proto, calibration), _error(smooth.model_proto, calibration)
    # Measured: worst rel L2 of the four MatMul outputs 0.031 -> 0.009.
    assert after < 0.5 * before, (before, after)
    # The outputs no INT8 node reads stay float: ORT runs MatMulIntegerToFloat.
    assert smooth.report.quantization["ort_kernels"] == {"MatMulIntegerToFloat": 4}
    info = smooth.report.quantization["smooth"]
    assert info["smoothed"] == 2 and info["alpha"] == "auto"
    for item in info["inputs"]:
        assert item["error_after"] < item["error_before"]
    assert any("SmoothQuant" in note for note in smooth.report.notes)
    # The Mul before Q, K and V stays float: every QuantizeLinear reads a float tensor.
    mul = next(n for n in smooth.model_proto.graph.node if n.op_type == "Mul")
    assert {p.key for p in mul.metadata_props} == {KEEP_FLOAT}


def test_auto_leaves_inputs_without_outliers():
    model = ir.from_proto(_model(outliers=False))
    for alpha in (None, 0.5):
        result = SmoothQuantPass(_samples(4, 1), alpha=alpha)(model)
        assert not result.modified and len(result.inputs) == 2
        assert all(i.alpha is None and "no outlier channels" in i.how for i in result.inputs)
    assert ir.to_proto(model).graph.node[0].input[1] == "gamma"  # nothing changed


def test_head_of_buffers_a_stream_only_up_to_its_head():
    stream = (k for k in range(40))
    head, rest = head_of(stream, 16)
    assert head == list(range(16)) and list(rest) == list(range(40))
    items = list(range(5))
    assert head_of(items, 16) == (items, items)


@pytest.mark.parametrize("bad", [0, 1.5, True, "yes", -0.2])
def test_bad_smooth_values_are_one_line(bad):
    with pytest.raises(MixprecError, match="smooth must be"):
        QuantizeConfig(smooth=bad)


def test_cli_smooth_flags(tmp_path, capsys):
    src = tmp_path / "m.onnx"
    onnx.save(_model(), src)
    folder = tmp_path / "calib"
    folder.mkdir()
    for k, sample in enumerate(_samples(6, 1)):
        np.savez(folder / f"{k}.npz", **sample)
    common = ["--calibration-data", str(folder), "--mode", "static", "--speed", "off"]
    common += ["--no-guard", "--json"]
    reports = {}
    for flags in ([], ["--smooth", "0.6"], ["--no-smooth"]):
        out = tmp_path / f"out{len(reports)}.onnx"
        rc = main(["quantize", str(src), "-o", str(out), *common, *flags])
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        reports[" ".join(flags)] = json.loads(captured.out)["quantization"].get("smooth")
    assert reports[""]["alpha"] == "auto" and reports[""]["smoothed"] == 2  # on by default
    assert reports["--smooth 0.6"]["alpha"] == 0.6
    assert reports["--no-smooth"] is None
    rc = main(["quantize", str(src), "-o", str(tmp_path / "x.onnx"), *common, "--smooth", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--smooth takes 'auto' or an alpha" in err[0], err


def test_auto_skips_a_cnn_whose_gemm_head_holds_few_macs():
    rng = np.random.default_rng(0)
    conv = rng.normal(0, 0.1, (64, 3, 3, 3)).astype(np.float32)
    head = rng.normal(0, 0.1, (64, 10)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
            helper.make_node("GlobalAveragePool", ["c"], ["p"], name="pool"),
            helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
            helper.make_node("Gemm", ["f", "head"], ["y"], name="head"),
        ],
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(conv, "w"), numpy_helper.from_array(head, "head")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    data = [{"x": rng.normal(0, 1, (1, 3, 32, 32)).astype(np.float32)}]
    result = SmoothQuantPass(data, alpha=None, min_mac_share=0.5)(model)
    assert not result.modified and result.samples == 0  # no statistics run
    assert result.skipped is not None and "hold 0% of the MACs" in result.skipped


def _matmul_bias(batch: int | str) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    weight = rng.normal(0, 0.2, (C, N)).astype(np.float32)
    bias = np.zeros(N, np.float32)
    bias[:2] = 200.0  # outlier output channels, as a residual stream holds
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["mm"], name="mm"),
            helper.make_node("Add", ["mm", "b"], ["y"], name="bias"),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, S, C])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, S, N])],
        [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", ["batch", 1])
def test_placement_weighted_keeps_matmul_outputs_float(batch):
    """Transformer MatMul outputs feed bias and residual Adds: placement "weighted" keeps
    those float, and a MatMul output no INT8 node reads is not quantized (ORT runs
    MatMulIntegerToFloat), except where ORT would first fuse MatMul and bias Add into a
    float Gemm (static shapes): that output stays quantized (QLinearMatMul)."""
    model = _matmul_bias(batch)
    rng = np.random.default_rng(4)
    data = [{"x": rng.normal(0, 1, (1, S, C)).astype(np.float32)} for _ in range(4)]
    options = dict(mode="static", speed="off", guard=False, smooth=None)
    errors, kernels = {}, {}
    for placement in ("chains", "weighted"):
        result = mixprec.quantize(model, data, placement=placement, **options)
        kernels[placement] = result.report.quantization["ort_kernels"]
        got = [run_ort(result.model_proto, d)["y"] for d in data]
        want = [run_ort(model, d)["y"] for d in data]
        errors[placement] = max(rel_l2_error(w, g) for g, w in zip(got, want, strict=True))
    assert kernels["chains"] == {"QLinearMatMul": 1}, kernels
    if batch == 1:
        assert kernels["weighted"] == {"QLinearMatMul": 1}, kernels
        return
    assert kernels["weighted"] == {"MatMulIntegerToFloat": 1}, kernels
    # Measured: rel L2 0.0042 (chains: the sum's 200s set its scale) against 0.0002.
    assert errors["weighted"] < 0.5 * errors["chains"], errors
