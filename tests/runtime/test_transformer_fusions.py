"""ONNX Runtime's transformer fusions (mixprec.runtime.transformer_fusions) and optimize's
``fused-ort`` candidate: what fuses, that the fused model gives FP32's answers in ONNX
Runtime, the head count read from a graph the optimizer cannot read it from, and the
models it leaves alone."""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.runtime.transformer_fusions import attention_shape, transformer_fused
from proto_builders import F32, _model, _vi

HIDDEN = 16


def _array(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values, name)


def encoder_block(seed: int = 0) -> onnx.ModelProto:
    """A transformer's feed-forward half: MatMul, bias, erf Gelu, MatMul, bias, the
    residual Add and LayerNormalization (BiasGelu and SkipLayerNormalization in ORT)."""
    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return _array(name, (rng.standard_normal(shape) * 0.3).astype(np.float32))

    inits = [
        weight("w1", HIDDEN, 4 * HIDDEN), weight("b1", 4 * HIDDEN),
        weight("w2", 4 * HIDDEN, HIDDEN), weight("b2", HIDDEN),
        weight("gamma", HIDDEN), weight("beta", HIDDEN),
        _array("sqrt2", np.array(np.sqrt(2.0), np.float32)),
        _array("one", np.array(1.0, np.float32)),
        _array("half", np.array(0.5, np.float32)),
    ]  # fmt: skip
    node = helper.make_node
    nodes = [
        node("MatMul", ["x", "w1"], ["h0"]),
        node("Add", ["h0", "b1"], ["h1"]),
        node("Div", ["h1", "sqrt2"], ["g0"]),
        node("Erf", ["g0"], ["g1"]),
        node("Add", ["g1", "one"], ["g2"]),
        node("Mul", ["h1", "g2"], ["g3"]),
        node("Mul", ["g3", "half"], ["g4"]),
        node("MatMul", ["g4", "w2"], ["h2"]),
        node("Add", ["h2", "b2"], ["h3"]),
        node("Add", ["x", "h3"], ["h4"]),
        node("LayerNormalization", ["h4", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
    ]
    graph = helper.make_graph(
        nodes,
        "encoder_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _samples(count: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((4, 8, HIDDEN)).astype(np.float32)} for _ in range(count)]


def test_the_fused_block_gives_fp32_answers_in_onnx_runtime() -> None:
    model = encoder_block()
    before = model.SerializeToString()
    fused, note = transformer_fused(model)
    assert fused is not None, note
    assert model.SerializeToString() == before  # the input is not rewritten
    ops = collections.Counter(n.op_type for n in fused.graph.node)
    assert ops["SkipLayerNormalization"] == 1 and ops["BiasGelu"] == 1, ops
    assert "LayerNormalization" not in ops and "Erf" not in ops, ops
    assert note == "ONNX Runtime's fusions: 1 SkipLayerNormalization, 1 BiasGelu"
    for feeds in _samples(3):
        want, got = run_ort(model, feeds)["y"], run_ort(fused, feeds)["y"]
        assert_close(want, got, "fp32", name="y")


def test_a_model_without_normalization_is_left_alone() -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])], [_vi("x", F32, [2])], [_vi("y", F32, [2])]
    )
    before = model.SerializeToString()
    fused, note = transformer_fused(model)
    assert fused is None and note == "no LayerNormalization: no transformer fusion applies"
    assert model.SerializeToString() == before


def _heads_graph(shape: onnx.NodeProto | None, reshape_shape: np.ndarray | None) -> onnx.ModelProto:
    """LayerNormalization over 8 channels, and a 4-d Reshape of its output whose shape is
    an initializer (``reshape_shape``) or a Concat ending in two Constants (``shape``)."""
    node = helper.make_node
    nodes = [node("LayerNormalization", ["x", "gamma", "beta"], ["n"], axis=-1)]
    inits = [_array("gamma", np.ones(8, np.float32)), _array("beta", np.zeros(8, np.float32))]
    if reshape_shape is not None:
        inits.append(_array("shape", reshape_shape))
    else:
        nodes += [
            node("Shape", ["n"], ["dims"], end=2),
            node("Constant", [], ["minus_one"], value=_array("m", np.array([-1], np.int64))),
            node("Constant", [], ["head_size"], value=_array("h", np.array([4], np.int64))),
            node("Split", ["dims"], ["d0", "d1"], axis=0, num_outputs=2),
            node("Concat", ["d0", "d1", "minus_one", "head_size"], ["shape"], axis=0),
        ]
    nodes.append(node("Reshape", ["n", "shape"], ["y"]))
    return _model(nodes, [_vi("x", F32, [1, 3, 8])], [_vi("y", F32, ["a", "b", "c", "d"])], inits)


def test_the_head_count_is_read_where_the_optimizer_cannot() -> None:
    # torch's export: [batch, seq, -1, head size] from a Concat (MiniLM: -1, 32 of 384)
    assert attention_shape(_heads_graph(None, None)) == (2, 8)
    assert attention_shape(_heads_graph(None, np.array([0, 0, 2, 4], np.int64))) == (2, 8)
    # a 4-d reshape that does not split the width into heads says nothing
    assert attention_shape(_heads_graph(None, np.array([1, 1, 8, 3], np.int64))) == (0, 0)


def test_optimize_tries_the_fused_model_as_fp32_in_onnx_runtime() -> None:
    result = mixprec.optimize(
        encoder_block(), _samples(8), candidates=["fp32-ort", "fused-ort"], accept_unconfirmed=True
    )
    rows = {r.name: r for r in result.table}
    fused = rows["fused-ort"]
    assert fused.accurate and fused.status in ("timed", "not timed"), (fused.status, fused.reason)
    assert "1 SkipLayerNormalization, 1 BiasGelu" in fused.note
    if result.winner == "fused-ort":  # what it wrote runs as FP32 in ONNX Runtime
        feeds = _samples(1, seed=5)[0]
        want, got = run_ort(encoder_block(), feeds)["y"], run_ort(result.model_proto, feeds)["y"]
        assert_close(want, got, "fp32", name="y")
