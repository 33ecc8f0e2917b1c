"""The INT8 guard's test classifier and its samples, shared by tests/int8's guard tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CLASSES = 4


def wide_range_classifier(*, softmax: bool = True) -> onnx.ModelProto:
    """x[N,16] -> MatMul -> Relu -> MatMul -> Relu -> MatMul [-> Softmax], where input
    feature 0 is raw (~1000: an unnormalized count, like a byte value or a timestamp)
    and the others ~1. The wide feature sets the first MatMul's per-tensor INT8 input
    scale (a step of ~8), so the ordinary features round to a few levels, while the
    network barely reads the wide one: its answer follows the ordinary features, and
    INT8 flips some of them. The output is ``probs`` with the Softmax, else ``logits``."""
    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    w1[0] *= 1e-4
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(rng.standard_normal((32, 32)).astype(np.float32) * 0.3, "w2"),
        numpy_helper.from_array(rng.standard_normal((32, CLASSES)).astype(np.float32), "w3"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="fc1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu1"),
        helper.make_node("MatMul", ["r1", "w2"], ["h2"], name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu2"),
        helper.make_node("MatMul", ["r2", "w3"], ["logits"], name="classifier"),
    ]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1))
    out = "probs" if softmax else "logits"
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def wide_range_samples(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` batches of 16 rows for :func:`wide_range_classifier`: feature 0 uniform in
    [0, 1000), the others standard normal."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        x = rng.standard_normal((16, 16)).astype(np.float32)
        x[:, 0] = rng.uniform(0, 1000, 16)
        samples.append({"x": x})
    return samples


def separable_classifier() -> onnx.ModelProto:
    """x[N,16] -> MatMul -> Relu -> MatMul -> Softmax ``probs``, built so that INT8 never
    flips an answer on :func:`separable_samples`: each row's class is the one strong
    feature it carries (3 against noise of 0.1), a margin no 7- or 8-bit grid erases."""
    rng = np.random.default_rng(7)
    w1 = (np.eye(16) * 0.5 + rng.standard_normal((16, 16)) * 0.01).astype(np.float32)
    w2 = np.zeros((16, CLASSES), np.float32)
    w2[np.arange(16), np.arange(16) % CLASSES] = 1.0
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
            helper.make_node("Relu", ["h"], ["r"], name="relu"),
            helper.make_node("MatMul", ["r", "w2"], ["logits"], name="fc2"),
            helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
        ],
        "separable",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", CLASSES])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def separable_samples(n: int, rows: int = 1, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``n`` batches of ``rows`` rows for :func:`separable_classifier`."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        x = (rng.standard_normal((rows, 16)) * 0.1).astype(np.float32)
        x[np.arange(rows), rng.integers(0, 16, rows)] = 3.0
        samples.append({"x": x})
    return samples
