"""runtime.fit: generated inputs learn from ONNX Runtime's refusals (real ORT runs)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mixprec.core.errors import MixprecError
from mixprec.io.feeds import guessed_dims, make_inputs, resolve_input_shapes
from mixprec.runtime.fit import MAX_RUNS, fit_shapes
from mixprec.runtime.ort import run_model


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _reflect_pad(width: int) -> onnx.ModelProto:
    """x [1, T] reflect-padded by ``width`` on both sides of T (an STFT's framing)."""
    pads = helper.make_tensor("pads", TensorProto.INT64, [4], [0, width, 0, width])
    return _model(
        [helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None])],
        [pads],
    )


def _runner(model: onnx.ModelProto):
    runs: list[dict[str, list[int]]] = []

    def attempt(shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
        runs.append({k: list(v) for k, v in shapes.items()})
        feeds, _ = make_inputs(model, shapes=shapes, seed=0)
        return run_model(model, feeds)

    return runs, attempt


def test_a_refused_length_grows_until_the_reflect_pad_fits() -> None:
    model = _reflect_pad(100)
    runs, attempt = _runner(model)
    # the default guess (the graph-read first guess would already be long enough)
    outputs, used, notes = fit_shapes({"x": [1, 64]}, guessed_dims(model), attempt)
    assert runs == [{"x": [1, 64]}, {"x": [1, 256]}]
    assert used == {"x": [1, 256]} and outputs["y"].shape == (1, 456)
    assert "input 'x' dim 1 (T): 256 (64 was refused: Pad reflect" in notes[0], notes
    assert notes[-1] == "generated inputs ran on try 2 of 5: x [1, 256]"


def test_the_dims_onnxruntime_names_are_taken_from_its_message() -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    runs: list[dict[str, list[int]]] = []

    def attempt(shapes: dict[str, list[int]]) -> dict[str, np.ndarray]:
        runs.append({k: list(v) for k, v in shapes.items()})
        return run_model(model, {"x": np.ones(shapes["x"], np.float32)})

    # a wrong first guess for a dim ORT knows: its refusal says what it expected
    _, used, notes = fit_shapes({"x": [2, 64]}, {("x", 1): "?"}, attempt)
    assert runs == [{"x": [2, 64]}, {"x": [2, 3]}]
    assert used == {"x": [2, 3]}
    assert notes[0] == "input 'x' dim 1: 3 (onnxruntime expected it)", notes


def test_the_first_guess_reads_the_reflect_pad_the_input_reaches() -> None:
    first, notes = resolve_input_shapes(_reflect_pad(100))
    assert first == {"x": [1, 256]}
    assert "used 256 (at least 101: the reflect Pad" in notes[-1], notes


def test_a_model_that_refuses_every_guess_gets_one_line_naming_the_dim() -> None:
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, 100])
    model = _model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 100])],
        [shape],
    )
    first, _ = resolve_input_shapes(model)
    runs, attempt = _runner(model)
    with pytest.raises(MixprecError) as info:
        fit_shapes(first, guessed_dims(model), attempt)
    assert len(runs) == MAX_RUNS
    assert [r["x"][1] for r in runs] == [64, 256, 512, 1024, 4096]
    message = str(info.value)
    assert "\n" not in message
    assert "after 5 run(s) (input 'x' dim 1 last tried 4096)" in message, message
    assert "--shape x=1,N" in message and "cannot be reshaped" in message, message
