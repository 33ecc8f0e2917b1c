"""Build a wide FP32 model for the report page at scale: 500 blocks of (Conv 1x1, Relu,
residual Add, Mul by a constant), 2,000 nodes on an 8-channel 8x8 image (seeded).

Usage: python examples/make_wide_model.py OUT.onnx [BLOCKS]
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(blocks: int = 500) -> onnx.ModelProto:
    """``blocks`` x (Conv 1x1, Relu, Add residual, Mul by a constant): 4 nodes each."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = "x"
    for k in range(blocks):
        w = numpy_helper.from_array((rng.standard_normal((8, 8, 1, 1)) * 0.3).astype("f4"), f"w{k}")
        s = numpy_helper.from_array(np.array(0.9, np.float32), f"s{k}")
        inits += [w, s]
        nodes += [
            helper.make_node("Conv", [x, f"w{k}"], [f"c{k}"], name=f"conv{k}"),
            helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}"),
            helper.make_node("Add", [f"r{k}", x], [f"a{k}"], name=f"add{k}"),
            helper.make_node("Mul", [f"a{k}", f"s{k}"], [f"m{k}"], name=f"mul{k}"),
        ]
        x = f"m{k}"
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 8, 8])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 8, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


if __name__ == "__main__":
    onnx.save(build(int(sys.argv[2]) if len(sys.argv) > 2 else 500), sys.argv[1])
