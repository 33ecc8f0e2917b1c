"""Cross-layer equalization and high-bias absorption (:mod:`mixprec.int8.equalize`) on small
graphs with deliberately unbalanced channels: the ranges even out, the FP32 function stays
what ONNX Runtime computed before, and the per-tensor INT8 model's error drops."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.int8.config import QuantizeConfig
from mixprec.int8.equalize import EqualizeLayersPass, EqualizeLayersResult, channel_spread
from mixprec.passes.fold import FoldBatchNormPass

#: Per-channel factors that unbalance a pair: channel ranges spread over 1e4.
UNBALANCE = np.array([1e-2, 30.0, 0.1, 1.0, 100.0, 0.03, 3.0, 0.3])


def _model(
    nodes: list[onnx.NodeProto],
    arrays: dict[str, np.ndarray],
    *,
    as_constants: Sequence[str] = (),
    shape: Sequence[int] = (2, 4, 12, 12),
    out_rank: int = 4,
) -> onnx.ModelProto:
    """Input ``x`` -> ``nodes`` -> output ``y``; ``arrays`` are initializers, or Constant
    nodes for the names in ``as_constants`` (as PP-OCR stores its weights)."""
    consts = [
        helper.make_node(
            "Constant", [], [k], name=f"const_{k}", value=numpy_helper.from_array(v, k)
        )
        for k, v in arrays.items()
        if k in as_constants
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in arrays.items() if k not in as_constants]
    graph = helper.make_graph(
        [*consts, *nodes],
        "equalize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * out_rank)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _weights(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, shape).astype(np.float32)


def _conv_relu_conv() -> onnx.ModelProto:
    """Conv(4->8, 3x3) -> Relu -> Conv(8->6, 3x3): a balanced pair with channel ``i`` of the
    first divided by UNBALANCE[i] and the second's input channel ``i`` multiplied by it
    (the same function: Relu commutes with a positive scale)."""
    rng = np.random.default_rng(0)
    d = UNBALANCE.astype(np.float32)
    arrays = {
        "w1": _weights(rng, 8, 4, 3, 3) / d[:, None, None, None],
        "b1": (0.1 * _weights(rng, 8)) / d,
        "w2": _weights(rng, 6, 8, 3, 3) * d[None, :, None, None],
        "b2": 0.1 * _weights(rng, 6),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    return _model(nodes, arrays)


def _depthwise_chain() -> onnx.ModelProto:
    """Conv(4->8, 1x1) -> Relu -> depthwise Conv(8, 3x3) -> Mul(0.9) -> Add(0.5) ->
    Conv(8->6, 1x1), unbalanced at both joints, weights in Constant nodes (PP-OCR's
    layout, with the learnable affine block's scalar Mul/Add between)."""
    rng = np.random.default_rng(1)
    d1 = UNBALANCE.astype(np.float32)
    d2 = d1[::-1].copy()
    arrays = {
        "w1": _weights(rng, 8, 4, 1, 1) / d1[:, None, None, None],
        "b1": (0.1 * _weights(rng, 8)) / d1,
        "wd": _weights(rng, 8, 1, 3, 3) * (d1 / d2)[:, None, None, None],
        "bd": (0.1 * _weights(rng, 8)) / d2,
        "k": np.array([0.9], np.float32),
        "a": np.array([0.5], np.float32),
        "w2": _weights(rng, 6, 8, 1, 1) * d2[None, :, None, None],
        "b2": 0.1 * _weights(rng, 6),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="pw1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "wd", "bd"], ["cd"], name="dw", group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["cd", "k"], ["m"], name="lab_mul"),
        helper.make_node("Add", ["m", "a"], ["ad"], name="lab_add"),
        helper.make_node("Conv", ["ad", "w2", "b2"], ["y"], name="pw2"),
    ]
    return _model(nodes, arrays, as_constants=("w1", "wd", "w2", "a"))


def _inputs(shape: Sequence[int] = (2, 4, 12, 12), n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"x": rng.uniform(0.0, 1.0, shape).astype(np.float32)} for _ in range(n)]


def _equalized(
    model: onnx.ModelProto, **kwargs: bool
) -> tuple[onnx.ModelProto, EqualizeLayersResult]:
    work = ir.from_proto(model)
    result = EqualizeLayersPass(**kwargs)(work)
    assert isinstance(result, EqualizeLayersResult)
    return ir.to_proto(result.model), result


def _assert_same_function(
    before: onnx.ModelProto, after: onnx.ModelProto, shape: Sequence[int] = (2, 4, 12, 12)
) -> None:
    """ONNX Runtime's outputs agree to float32 rounding (1e-5 of the output's scale)."""
    for feeds in _inputs(shape)[:2]:
        ref, got = run_ort(before, feeds)["y"], run_ort(after, feeds)["y"]
        worst = float(np.abs(ref - got).max() / np.abs(ref).max())
        assert worst < 1e-5, f"FP32 output moved by {worst:.2e} of its scale"


def _int8_error(model: onnx.ModelProto, equalize: bool) -> float:
    """rel L2 of the all-INT8, per-tensor model against the FP32 model on held-out inputs."""
    result = mixprec.quantize(
        model,
        _inputs(),
        speed="off",
        guard=False,
        per_channel=False,
        equalize=equalize,
        method="minmax",
    )
    quantized = ir.to_proto(result.model)
    feeds = _inputs(n=6)[4:]
    ref = np.concatenate([run_ort(model, f)["y"] for f in feeds])
    got = np.concatenate([run_ort(quantized, f)["y"] for f in feeds])
    return rel_l2_error(ref, got)


def _weight(model: onnx.ModelProto, node_name: str) -> np.ndarray:
    """The weight array a node reads now (initializer or Constant node)."""
    node = next(n for n in model.graph.node if n.name == node_name)
    name = node.input[1]
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    const = next(n for n in model.graph.node if n.op_type == "Constant" and n.output[0] == name)
    return numpy_helper.to_array(const.attribute[0].t)


def test_conv_relu_conv_ranges_equalize_and_fp32_holds() -> None:
    model = _conv_relu_conv()
    out, result = _equalized(model)
    assert result.modified
    assert result.pairs == [("conv1", "conv2")]
    # Output channel ranges of conv1 spread over ~1e4 before; the theory gives each
    # channel sqrt(r1 * r2), which for the balanced pair is about equal.
    before, after = result.spread["conv1"]
    assert before > 1e3
    assert after < 2.0, f"conv1's channel ranges still spread {after:.2f}x"
    assert channel_spread(_weight(out, "conv1"), 0) == pytest.approx(after, rel=1e-5)
    # The second layer's input channels (axis 1) are as even as the first's outputs.
    w2 = _weight(out, "conv2")
    r2 = np.abs(w2).max(axis=(0, 2, 3))
    r1 = np.abs(_weight(out, "conv1")).max(axis=(1, 2, 3))
    np.testing.assert_allclose(r1, r2, rtol=1e-5)
    _assert_same_function(model, out)


def test_conv_relu_conv_per_tensor_int8_error_drops() -> None:
    model = _conv_relu_conv()
    plain, equalized = _int8_error(model, False), _int8_error(model, True)
    # Per-tensor weights: channels 1e-2 of the largest round to zero before equalization.
    assert equalized < 0.5 * plain, f"rel L2 {plain:.4f} -> {equalized:.4f}"
    assert equalized < 0.05


def test_depthwise_chain_with_constant_nodes_and_affine_links() -> None:
    model = _depthwise_chain()
    out, result = _equalized(model)
    assert result.pairs == [("pw1", "dw"), ("dw", "pw2")]
    assert result.sweeps > 2  # the shared depthwise layer couples the two pairs
    for name in ("pw1", "dw"):
        before, after = result.spread[name]
        assert before > 100 and after < 3.0, f"{name}: spread {before:.1f} -> {after:.2f}"
    # The scalar Add became one constant per channel, divided by the pair's scale.
    add = next(n for n in out.graph.node if n.name == "lab_add")
    shift = next(i for i in out.graph.initializer if i.name == add.input[1])
    assert list(shift.dims) == [8, 1, 1]
    _assert_same_function(model, out)
    plain, equalized = _int8_error(model, False), _int8_error(model, True)
    assert equalized < 0.5 * plain, f"rel L2 {plain:.4f} -> {equalized:.4f}"


def test_matmul_add_relu_gemm_pair() -> None:
    """MatMul -> Add(bias) -> Relu -> Gemm(transB): channels on the last axis."""
    rng = np.random.default_rng(4)
    d = UNBALANCE.astype(np.float32)
    arrays = {
        "w1": _weights(rng, 6, 8) / d[None, :],
        "b1": 0.1 * _weights(rng, 8) / d,
        "w2": _weights(rng, 5, 8) * d[None, :],
        "b2": 0.1 * _weights(rng, 5),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["m1"], name="fc1"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="bias1"),
        helper.make_node("Relu", ["a1"], ["r1"], name="relu"),
        helper.make_node("Gemm", ["r1", "w2", "b2"], ["y"], name="fc2", transB=1),
    ]
    model = _model(nodes, arrays, shape=(3, 6), out_rank=2)
    out, result = _equalized(model)
    assert result.pairs == [("fc1", "fc2")]
    before, after = result.spread["fc1"]
    assert before > 1e3 and after < 3.0, (before, after)  # 6 weights per channel: ~2
    _assert_same_function(model, out, (3, 6))


def test_chains_that_cannot_be_equalized_are_left_alone_with_a_reason() -> None:
    rng = np.random.default_rng(2)
    w = _weights(rng, 4, 4, 1, 1)
    clip = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6"),
        helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2"),
    ]
    lo, hi = np.array(0.0, np.float32), np.array(6.0, np.float32)
    model = _model(clip, {"w1": w, "w2": w.copy(), "lo": lo, "hi": hi})
    _, result = _equalized(model)
    assert not result.modified and not result.pairs
    assert "not scale-equivariant" in result.skipped["conv1"]
    shared = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w1"], ["y"], name="conv2"),
    ]
    _, result = _equalized(_model(shared, {"w1": w}))
    assert not result.modified
    assert "shared" in result.skipped["conv1"]


def _bn_relu_conv() -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """Conv -> BatchNormalization(high beta) -> Relu -> Conv(1x1), with the BN's running
    statistics those of the inputs used, so its output is N(beta, gamma^2) per channel."""
    rng = np.random.default_rng(3)
    w1, w2 = _weights(rng, 8, 4, 3, 3), _weights(rng, 6, 8, 1, 1)
    data = [{"x": rng.normal(0.0, 1.0, (4, 4, 12, 12)).astype(np.float32)} for _ in range(6)]
    probe = _model(
        [helper.make_node("Conv", ["x", "w1"], ["y"], name="conv1", pads=[1, 1, 1, 1])],
        {"w1": w1},
        shape=(4, 4, 12, 12),
    )
    conv = np.concatenate([run_ort(probe, f)["y"] for f in data])
    gamma = np.full(8, 0.5, np.float32)
    beta = np.array([8.0, 0.0, 12.0, -1.0, 10.0, 0.2, 16.0, 6.0], np.float32)
    arrays = {
        "w1": w1,
        "g": gamma,
        "beta": beta,
        "mean": conv.mean(axis=(0, 2, 3)).astype(np.float32),
        "var": conv.var(axis=(0, 2, 3)).astype(np.float32),
        "w2": w2,
        "b2": np.zeros(6, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "g", "beta", "mean", "var"], ["n1"]),
        helper.make_node("Relu", ["n1"], ["r1"], name="relu"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2"),
    ]
    return _model(nodes, arrays, shape=(4, 4, 12, 12)), data


def test_high_bias_absorption_narrows_the_relu_range() -> None:
    model, data = _bn_relu_conv()
    results = {}
    for absorb in (False, True):
        work = ir.from_proto(model)
        FoldBatchNormPass()(work)
        results[absorb] = EqualizeLayersPass(absorb_bias=absorb)(work)
        results[absorb, "model"] = ir.to_proto(work)
    kept, moved = results[False, "model"], results[True, "model"]
    assert isinstance(results[True], EqualizeLayersResult)
    # beta - 3 gamma > 0 for the channels with beta 8, 12, 10, 16, 6.
    assert results[True].absorbed == {"conv1": 5}
    assert not results[False].absorbed
    held_out = data[4:]
    ref = np.concatenate([run_ort(model, f)["y"] for f in held_out])
    # Exact where the pre-activation stays above c (all but the normal tail): tiny change.
    assert rel_l2_error(ref, np.concatenate([run_ort(moved, f)["y"] for f in held_out])) < 1e-3
    # The Relu output (conv2's input, INT8 per tensor) loses its constant part.
    relu_max = {}
    for absorb, m in ((False, kept), (True, moved)):
        probe = onnx.ModelProto()
        probe.CopyFrom(m)
        probe.graph.output.append(helper.make_tensor_value_info("r1", TensorProto.FLOAT, None))
        relu_max[absorb] = max(float(run_ort(probe, f)["r1"].max()) for f in data)
    assert relu_max[True] < 0.6 * relu_max[False], relu_max
    errors = {}
    for absorb, m in ((False, kept), (True, moved)):
        int8 = mixprec.quantize(
            m, data[:4], speed="off", guard=False, equalize=False, method="minmax"
        )
        got = np.concatenate([run_ort(ir.to_proto(int8.model), f)["y"] for f in held_out])
        errors[absorb] = rel_l2_error(ref, got)
    assert errors[True] < 0.8 * errors[False], errors


def test_equalize_option_is_validated_and_reported() -> None:
    with pytest.raises(MixprecError, match="equalize"):
        QuantizeConfig(equalize="yes")
    assert QuantizeConfig(per_channel=False).equalizes
    assert not QuantizeConfig(equalize=False, per_channel=False).equalizes
    result = mixprec.quantize(_conv_relu_conv(), _inputs(), speed="off", guard=False, equalize=True)
    summary = result.report.quantization["equalize"]
    assert summary["pairs"] == 1
    before, after = summary["spread_median"]
    assert before > 100 * after


def test_cli_equalize_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pair.onnx"
    onnx.save(_conv_relu_conv(), src)
    folder = tmp_path / "calib"
    folder.mkdir()
    for k, sample in enumerate(_inputs()):
        np.savez(folder / f"{k}.npz", **sample)
    reports = {}
    for flags in (["--per-tensor"], ["--per-tensor", "--no-equalize"], ["--equalize"]):
        out = tmp_path / "pair_int8.onnx"
        rc = main(["quantize", str(src), "-o", str(out), "--calibration-data", str(folder),
                   "--speed", "off", "--no-guard", "--json", *flags])  # fmt: skip
        captured = capsys.readouterr()
        assert rc == 0, captured.err
        reports[" ".join(flags)] = json.loads(captured.out)["quantization"]
    assert reports["--per-tensor"]["equalize"]["pairs"] == 1  # auto: on with per-tensor weights
    assert "equalize" not in reports["--per-tensor --no-equalize"]
    assert reports["--equalize"]["equalize"]["pairs"] == 1
