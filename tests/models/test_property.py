"""Property-based: random DAGs of common ops convert to valid, runnable, accurate models."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort

C, H, W = 4, 6, 6
SHAPE = [1, C, H, W]
OPS = (
    "Conv",
    "MatMul",
    "Gemm",
    "Add",
    "Mul",
    "Relu",
    "Sigmoid",
    "Softmax",
    "Exp",
    "ReduceMean",
    "Concat",
    "Reshape",
    "Transpose",
    "Resize",
    "If",
)


class _Builder:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.k = 0

    def name(self, base: str) -> str:
        self.k += 1
        return f"{base}{self.k}"

    def const(self, arr: np.ndarray, base: str = "w") -> str:
        n = self.name(base)
        self.inits.append(numpy_helper.from_array(arr, n))
        return n

    def weight(self, *shape: int, scale: float = 0.3) -> str:
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32))

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        return out

    def apply(self, op: str, a: str, b: str) -> str:
        """Apply ``op`` to tensor ``a`` (and ``b``, same shape [1,C,H,W]); returns [1,C,H,W]."""
        if op == "Conv":
            return self.node("Conv", [a, self.weight(C, C, 3, 3, scale=0.2)], pads=[1, 1, 1, 1])
        if op == "MatMul":
            return self.node("MatMul", [a, self.weight(W, W)])
        if op == "Gemm":
            flat = self.node("Reshape", [a, self.const(np.array([C * H, W], np.int64), "s")])
            g = self.node("Gemm", [flat, self.weight(W, W), self.weight(W)])
            return self.node("Reshape", [g, self.const(np.array(SHAPE, np.int64), "s")])
        if op in ("Add", "Mul"):
            return self.node(op, [a, b])
        if op in ("Relu", "Sigmoid"):
            return self.node(op, [a])
        if op == "Softmax":
            return self.node("Softmax", [a], axis=-1)
        if op == "Exp":
            scaled = self.node("Mul", [a, self.const(np.array(0.1, np.float32), "c")])
            return self.node("Exp", [scaled])
        if op == "ReduceMean":
            mean = self.node("ReduceMean", [a], axes=[3], keepdims=1)
            return self.node("Add", [a, mean])
        if op == "Concat":
            cat = self.node("Concat", [a, b], axis=1)
            return self.node("Conv", [cat, self.weight(C, 2 * C, 1, 1, scale=0.2)])
        if op == "Reshape":
            r = self.node("Reshape", [a, self.const(np.array([1, C, H * W], np.int64), "s")])
            return self.node("Reshape", [r, self.const(np.array(SHAPE, np.int64), "s")])
        if op == "Transpose":
            return self.node("Transpose", [a], perm=[0, 1, 3, 2])
        if op == "Resize":
            scales = self.const(np.array([1, 1, 2, 2], np.float32), "scales")
            up = self.node("Resize", [a, "", scales], mode="nearest")
            return self.node("MaxPool", [up], kernel_shape=[2, 2], strides=[2, 2])
        if op == "If":
            w = self.weight(W, W)
            then_out, else_out = self.name("then"), self.name("else")
            mm = self.name("mm")
            then_g = helper.make_graph(
                [
                    helper.make_node("MatMul", [a, w], [mm]),
                    helper.make_node("Relu", [mm], [then_out]),
                ],
                self.name("then_g"),
                [],
                [helper.make_tensor_value_info(then_out, TensorProto.FLOAT, SHAPE)],
            )
            else_g = helper.make_graph(
                [helper.make_node("Sigmoid", [a], [else_out])],
                self.name("else_g"),
                [],
                [helper.make_tensor_value_info(else_out, TensorProto.FLOAT, SHAPE)],
            )
            out = self.name("if")
            self.nodes.append(
                helper.make_node(
                    "If",
                    ["cond"],
                    [out],
                    name=out + "_node",
                    then_branch=then_g,
                    else_branch=else_g,
                )
            )
            return out
        raise AssertionError(op)


def _build(ops: list[str], picks: list[int], seed: int) -> onnx.ModelProto:
    b = _Builder(np.random.default_rng(seed))
    tensors = ["x"]
    for op, pick in zip(ops, picks, strict=True):
        a = tensors[pick % len(tensors)]
        other = tensors[(pick // 7) % len(tensors)]
        tensors.append(b.apply(op, a, other))
    outputs = [tensors[-1]]
    if len(tensors) > 3 and tensors[2] != tensors[-1]:
        outputs.append(tensors[2])
    graph = helper.make_graph(
        b.nodes,
        "random_dag",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, SHAPE) for o in outputs],
        b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _signature(model: onnx.ModelProto) -> list[tuple[str, int, int]]:
    return [
        (v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
        for v in [*model.graph.input, *model.graph.output]
    ]


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=st.lists(st.sampled_from(OPS), min_size=1, max_size=8),
    data=st.data(),
    dtype=st.sampled_from(["float16", "bfloat16"]),
)
def test_random_dags_convert_to_valid_accurate_models(ops, data, dtype):
    picks = data.draw(st.lists(st.integers(0, 1000), min_size=len(ops), max_size=len(ops)))
    model = _build(ops, picks, seed=len(ops) * 1000 + picks[0])
    result = mixprec.convert(model, dtype)
    out = result.model_proto
    # Dead nodes are removed before painting: only ops the outputs depend on count.
    live = {n.op_type for n in result.report.nodes}
    if {"Conv", "MatMul", "Gemm", "Concat"} & live:
        assert result.report.low_nodes > 0, "an ALLOW op stayed FP32"
    onnx.checker.check_model(out, full_check=True)
    onnx.shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
    assert _signature(out) == _signature(model), "the I/O signature changed"
    feeds = {
        "x": np.random.default_rng(0).random(SHAPE, dtype=np.float32),
        "cond": np.array(picks[0] % 2 == 0),
    }
    ref = run_ort(model, feeds)
    if dtype == "float16":
        got = run_ort(out, feeds)
    else:
        from mixprec.passes.emulate import emulate_low_precision

        got = run_ort(emulate_low_precision(out), feeds)
    for name, expected in ref.items():
        assert_close(expected, got[name], dtype, name=f"{name} of {ops}")
    casts = sum(1 for n in out.graph.node if n.op_type == "Cast")
    # Never more than one cast per boundary tensor: bounded by twice the float nodes + I/O.
    assert casts <= 2 * len(result.report.nodes) + 3
