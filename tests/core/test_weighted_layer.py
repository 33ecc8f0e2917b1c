"""The weighted layer's one matcher (issue 44): membership from the registry, the weight,
bias and output-channel axis, or the reason a node is not a layer."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from mixprec.core.layers import is_layer, match_layer, takes_bias
from mixprec.core.registry import node_info
from text_models import filled_model

_LAYERS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1, 3, 8, 8] x, float[4, 6] m, float[6, 5] free) => (float[1, 2, 8, 8] c,
       float[1, 3, 10, 10] t, float[4, 5] gt, float[4, 5] mm, float[4, 5] dyn, float[4] v)
       <float[2, 3, 3, 3] cw, float[2] cb, float[3, 3, 3, 3] tw, float[5, 6] gw, float[5] gb,
        float[6, 5] mw, float[6] vw> {
        c = Conv <pads = [1, 1, 1, 1]> (x, cw, cb)
        t = ConvTranspose (x, tw)
        gt = Gemm <transB = 1> (m, gw, gb)
        mm = MatMul (m, mw)
        dyn = MatMul (m, free)
        v = MatMul (m, vw)
    }
"""


@pytest.fixture(scope="module")
def nodes() -> dict[str, ir.Node]:
    model = ir.from_proto(filled_model(_LAYERS))
    return {node.outputs[0].name: node for node in model.graph}


def test_each_layer_with_its_weight_bias_and_output_axis(nodes):
    expected = {  # output -> (kind, output-channel axis, bias, INT8 quantizes it)
        "c": ("conv", 0, "cb", True),
        "t": ("conv", 1, None, False),  # a layer, but no INT8 role (no QLinearConvTranspose)
        "gt": ("dense", 0, "gb", True),  # transB: [outputs, inputs]
        "mm": ("matmul", 1, None, True),
    }
    for name, (kind, axis, bias, int8) in expected.items():
        layer = match_layer(nodes[name])
        assert not isinstance(layer, str), (name, layer)
        assert (layer.kind, layer.out_axis, layer.int8) == (kind, axis, int8), name
        assert (layer.bias.name if layer.bias is not None else None) == bias, name
        assert layer.weight is nodes[name].inputs[1] and layer.x is nodes[name].inputs[0]
        assert np.array_equal(layer.tensor.numpy(), nodes[name].inputs[1].const_value.numpy())
    assert takes_bias(nodes["c"]) and takes_bias(nodes["t"]) and takes_bias(nodes["gt"])
    assert not takes_bias(nodes["mm"])


def test_a_node_that_is_not_a_layer_says_why(nodes):
    assert match_layer(nodes["dyn"]) == "its weight is not a constant"
    assert match_layer(nodes["v"]) == "its weight has no output-channel axis"
    add = ir.node("Add", [nodes["mm"].outputs[0], nodes["mm"].outputs[0]])
    assert match_layer(add) == "Add is not a weighted layer" and not is_layer(add)
    custom = ir.node("Conv", list(nodes["c"].inputs), domain="com.example")
    assert not is_layer(custom) and "not a weighted layer" in str(match_layer(custom))
    assert node_info(nodes["t"]).int8 is None and node_info(nodes["c"]).int8 == "weighted"
