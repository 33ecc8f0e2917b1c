"""optimize's kept models (mixprec.optimize.kept): the input by reference, the others on
disk and read back the same."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from mixprec.optimize.kept import KeptModels


def _model(scale: float) -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.full((4, 4), scale, np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [weight],
    )
    return helper.make_model(graph)


def test_the_input_is_kept_by_reference_and_the_rest_on_disk() -> None:
    source, other = _model(1.0), _model(2.0)
    kept = KeptModels(source)
    kept.keep("fp32-openvino", source)
    kept.keep("bf16-lists-openvino", other)
    assert kept["fp32-openvino"] is source
    back = kept["bf16-lists-openvino"]
    assert back is not other and back.SerializeToString() == other.SerializeToString()
    assert list(kept) == ["fp32-openvino", "bf16-lists-openvino"] and len(kept) == 2
    folder = kept.folder
    assert [p.name for p in folder.iterdir()] == ["1.onnx"]
    kept.close()
    assert not folder.exists()
