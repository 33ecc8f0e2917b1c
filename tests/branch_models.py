"""A small model shaped as Silero VAD exports: Ifs on shapes, and an If on a rate input.

``audio [N, 2, T]`` (N and T symbolic) and ``rate`` (an int64 scalar). The top If takes
its then-branch for ``rate == 16000``: a shape test squeezes the batch axis where it is 1
(rank 2), a second one unsqueezes a rank-2 tensor back (rank 3), then a Conv, a MatMul
over its 14 frames and a Sigmoid. The else-branch (8 kHz) is the same for half the
samples: its MatMul takes 6 frames, so at 16 samples (14 frames) it cannot run.
OpenVINO's ONNX reader converts neither branch: the Conv's input rank depends on a branch
(as Silero's "Conv-16 ... rank has to be known").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RATE = 16000
STATIC = {"audio": [1, 2, 16], "rate": []}


def _const(name: str, values: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(values, name))


def _declared(name: str, rank: int) -> onnx.ValueInfoProto:
    dims: list[int | str | None] = [f"{name}_{k}" for k in range(rank)]
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _shape_if(
    prefix: str, test: str, size: int, then: onnx.NodeProto, x: str, ranks: tuple[int, int]
) -> list[onnx.NodeProto]:
    """Nodes computing ``{prefix}out``: ``then`` where ``test`` of ``x``'s shape equals
    ``size`` ("dim0": its first dim, "rank": its rank), else ``x`` unchanged; ``ranks``:
    the two branches' output ranks, declared as the exporter declares them."""
    nodes = [helper.make_node("Shape", [x], [f"{prefix}shape"])]
    if test == "dim0":
        nodes += [
            _const(f"{prefix}zero", np.array(0, np.int64)),
            helper.make_node("Gather", [f"{prefix}shape", f"{prefix}zero"], [f"{prefix}got"]),
        ]
    else:
        nodes.append(helper.make_node("Size", [f"{prefix}shape"], [f"{prefix}got"]))
    nodes += [
        _const(f"{prefix}want", np.array(size, np.int64)),
        helper.make_node("Equal", [f"{prefix}got", f"{prefix}want"], [f"{prefix}cond"]),
    ]
    out = [_declared(then.output[0], ranks[0])]
    keep = helper.make_node("Identity", [x], [f"{prefix}same"])
    same = [_declared(f"{prefix}same", ranks[1])]
    branches = {
        "then_branch": helper.make_graph([then], f"{prefix}then", [], out),
        "else_branch": helper.make_graph([keep], f"{prefix}else", [], same),
    }
    nodes.append(helper.make_node("If", [f"{prefix}cond"], [f"{prefix}out"], **branches))
    return nodes


def _pipeline(prefix: str, frames: int, seed: int) -> onnx.GraphProto:
    """One rate's branch: the two shape tests, a Conv, a MatMul over ``frames`` of its
    output (the input's length less 2), Sigmoid."""
    rng = np.random.default_rng(seed)
    axes = _const(f"{prefix}axes", np.array([0], np.int64))
    squeeze = helper.make_node("Squeeze", ["audio", f"{prefix}axes"], [f"{prefix}sq"])
    unsqueeze = helper.make_node("Unsqueeze", [f"{prefix}a_out", f"{prefix}axes"], [f"{prefix}un"])
    weight = rng.normal(size=(3, 2, 3)).astype(np.float32)
    nodes = [
        axes,
        *_shape_if(f"{prefix}a_", "dim0", 1, squeeze, "audio", (2, 3)),
        *_shape_if(f"{prefix}b_", "rank", 2, unsqueeze, f"{prefix}a_out", (3, 3)),
        _const(f"{prefix}w", weight),
        helper.make_node("Conv", [f"{prefix}b_out", f"{prefix}w"], [f"{prefix}conv"]),
        _const(f"{prefix}pool", rng.normal(size=(frames, 1)).astype(np.float32)),
        helper.make_node("MatMul", [f"{prefix}conv", f"{prefix}pool"], [f"{prefix}mm"]),
        helper.make_node("Sigmoid", [f"{prefix}mm"], [f"{prefix}prob"]),
    ]
    return helper.make_graph(nodes, prefix, [], [_declared(f"{prefix}prob", 3)])


def rate_model(else_frames: int = 6) -> onnx.ModelProto:
    """The model the module's docstring describes (opset 17); ``else_frames``: the frames
    the 8 kHz branch's MatMul takes."""
    nodes = [
        _const("rate16k", np.array(RATE, np.int64)),
        helper.make_node("Equal", ["rate", "rate16k"], ["is16k"]),
        helper.make_node(
            "If", ["is16k"], ["prob"],
            then_branch=_pipeline("t_", 14, 0), else_branch=_pipeline("e_", else_frames, 1),
        ),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "rate_model",
        [
            helper.make_tensor_value_info("audio", TensorProto.FLOAT, ["N", 2, "T"]),
            helper.make_tensor_value_info("rate", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, ["N", 3, 1])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


def rate_feeds(count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` feeds at :data:`STATIC` (16 kHz)."""
    rng = np.random.default_rng(seed)
    return [
        {
            "audio": rng.normal(size=STATIC["audio"]).astype(np.float32),
            "rate": np.array(RATE, np.int64),
        }
        for _ in range(count)
    ]
