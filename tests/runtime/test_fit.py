"""runtime.fit: generated inputs learn from ONNX Runtime's refusals (real ORT runs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.inputs.feeds import guessed_dims, make_inputs, resolve_input_shapes
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import run_model
from mixprec.runtime.fit import fit_shapes

#: ONNX Runtime with its basic graph optimizations, as the tests' references run.
BASIC = RuntimeOptions("ort", optimization="basic")


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
        return run_model(model, feeds, BASIC)

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
        return run_model(model, {"x": np.ones(shapes["x"], np.float32)}, BASIC)

    # a wrong first guess for a dim ORT knows: its refusal says what it expected
    _, used, notes = fit_shapes({"x": [2, 64]}, {("x", 1): "?"}, attempt)
    assert runs == [{"x": [2, 64]}, {"x": [2, 3]}]
    assert used == {"x": [2, 3]}
    assert notes[0] == "input 'x' dim 1: 3 (onnxruntime expected it)", notes


def test_the_first_guess_reads_the_reflect_pad_the_input_reaches() -> None:
    first, notes = resolve_input_shapes(_reflect_pad(100))
    assert first == {"x": [1, 256]}
    assert "used 256 (at least 101: the reflect Pad" in notes[-1], notes


def test_a_refusal_that_names_no_length_is_not_retried_and_names_the_dim() -> None:
    # was: every guessed length grew 64 -> 256 -> 512 -> 1024 -> 4096 on any refusal
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
    assert runs == [{"x": [1, 64]}]
    message = str(info.value)
    assert "\n" not in message
    assert "after 1 run(s) (input 'x' dim 1 last tried 64)" in message, message
    assert "--shape x=1,N" in message and "cannot be reshaped" in message, message


def _pad_after_transpose_beside_another_input(width: int) -> onnx.ModelProto:
    """x [1, T, 2] transposed to [1, 2, T] and reflect-padded on T; z [1, S] only added
    to a reduction: only T is a length the Pad reads (through the Transpose)."""
    pads = helper.make_tensor("pads", TensorProto.INT64, [6], [0, 0, width, 0, 0, width])
    return _model(
        [
            helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
            helper.make_node("Pad", ["t", "pads"], ["p"], mode="reflect", name="pad"),
            helper.make_node("ReduceSum", ["p"], ["r"], keepdims=0),
            helper.make_node("ReduceSum", ["z"], ["s"], keepdims=0),
            helper.make_node("Add", ["r", "s"], ["y"]),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 2]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, "S"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [pads],
    )


def test_only_the_length_the_refusing_pad_reads_grows() -> None:
    # was: z's S grew with T (every guessed length grew on any refusal)
    model = _pad_after_transpose_beside_another_input(100)
    runs, attempt = _runner(model)
    _, used, notes = fit_shapes({"x": [1, 64, 2], "z": [1, 64]}, guessed_dims(model), attempt)
    assert runs == [{"x": [1, 64, 2], "z": [1, 64]}, {"x": [1, 256, 2], "z": [1, 64]}]
    assert used == {"x": [1, 256, 2], "z": [1, 64]}
    assert notes[0].startswith("input 'x' dim 1 (T): 256 (64 was refused: Pad reflect"), notes


def test_a_pool_window_grows_only_the_axis_it_refused() -> None:
    model = _model(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 100], name="pool")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    runs, attempt = _runner(model)
    # MaxPool's refusal names no axis: both spatial lengths it reads may grow
    _, used, _ = fit_shapes({"x": [1, 1, 64, 64]}, guessed_dims(model), attempt)
    assert used == {"x": [1, 1, 256, 256]} and len(runs) == 2


def test_growing_past_the_sample_limit_stops_with_one_line_and_allocates_nothing() -> None:
    # was: the lengths grew to 4096 whatever a sample then took (512 GiB for 4096^3)
    model = _model(
        [helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[100, 100], name="pool")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1100, "H", "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    runs, attempt = _runner(model)
    with pytest.raises(MixprecError) as info:
        fit_shapes({"x": [1, 1100, 64, 64]}, guessed_dims(model), attempt)
    assert len(runs) == 1  # 1100 x 256 x 256 floats (275 MiB) were never generated
    message = str(info.value)
    assert "over the 256 MiB limit on a generated sample" in message, message
    assert "--shape x=1,1100,N," in message or "--shape x=1,1100,64,N" in message, message


def test_a_huge_declared_dim_is_refused_before_anything_is_allocated() -> None:
    # was: MemoryError: Unable to allocate 1.50 PiB for an array with shape (1, 3, 2**40, 64)
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2**40, "W"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    first, _ = resolve_input_shapes(model)
    runs, attempt = _runner(model)
    with pytest.raises(MixprecError) as info:
        fit_shapes(first, guessed_dims(model), attempt)
    assert runs == []
    message = str(info.value)
    assert message.startswith("a generated sample would take 768 TiB, over the 256 MiB"), message
    assert "input 'x' dim 2 is declared 1099511627776" in message, message
    assert "--shape x=1,3,1099511627776,64" in message, message
    with pytest.raises(MixprecError, match="768 TiB"):
        make_inputs(model)


def test_convert_refuses_a_huge_declared_dim_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2**40, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, str(src))
    capsys.readouterr()
    rc = main(["convert", str(src), "-o", str(out), "--dtype", "bf16", "-q"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and not out.exists(), lines
    assert lines[0].startswith("mixprec: error: ") and "internal error" not in lines[0]
    assert "--shape x=1,3,1099511627776,64" in lines[0], lines
