"""Tests of mixprec.inputs.feeds: input shapes, generated inputs, .npz files, streams."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mixprec.core.errors import MixprecError
from mixprec.inputs.feeds import load_inputs_npz, make_inputs, resolve_input_shapes
from proto_builders import (
    BF16,
    F16,
    F32,
    OPSET,
    _model,
    _tensor,
    _vi,
)


def _input_model(inputs: Sequence[onnx.ValueInfoProto]) -> onnx.ModelProto:
    nodes = [helper.make_node("Identity", [vi.name], [f"{vi.name}_out"]) for vi in inputs]
    outs = []
    for vi in inputs:
        out = onnx.ValueInfoProto()
        out.CopyFrom(vi)
        out.name = f"{vi.name}_out"
        outs.append(out)
    return _model(nodes, inputs, outs)


def test_make_inputs_declared_dims_and_value_ranges() -> None:
    model = _input_model(
        [
            _vi("image", F32, [1, 3, 4, 4]),
            _vi("half", F16, [2, 3]),
            _vi("brain", BF16, [5]),
            _vi("ids", TensorProto.INT64, [2, 7]),
            _vi("attention_mask", TensorProto.INT64, [2, 7]),
            _vi("sr", TensorProto.INT64, []),
            _vi("flag", TensorProto.BOOL, [6]),
            _vi("audio", F32, [1, 16000]),
        ]
    )
    feeds, notes = make_inputs(model)
    assert {k: v.shape for k, v in feeds.items()} == {
        "image": (1, 3, 4, 4),
        "half": (2, 3),
        "brain": (5,),
        "ids": (2, 7),
        "attention_mask": (2, 7),
        "sr": (),
        "flag": (6,),
        "audio": (1, 16000),
    }
    assert feeds["image"].dtype == np.float32
    assert feeds["half"].dtype == np.float16
    assert feeds["brain"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert feeds["ids"].dtype == np.int64
    assert feeds["flag"].dtype == np.bool_
    image = feeds["image"]
    assert image.min() >= 0.0 and image.max() < 1.0, (image.min(), image.max())
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 100, feeds["ids"]
    assert (feeds["attention_mask"] == 1).all(), feeds["attention_mask"]
    assert int(feeds["sr"]) == 16000, feeds["sr"]
    audio = feeds["audio"]
    assert audio.min() >= -1.0 and audio.max() <= 1.0, (audio.min(), audio.max())
    assert audio.std() > 0.1, f"audio should be a signal, std {audio.std()}"
    assert not any("dim" in n for n in notes), notes

    again, _ = make_inputs(model)
    other, _ = make_inputs(model, seed=1)
    for name in feeds:
        np.testing.assert_array_equal(feeds[name], again[name], err_msg=name)
    assert not np.array_equal(feeds["image"], other["image"]), "seed must change the data"


def test_make_inputs_symbolic_dims() -> None:
    """Symbolic dims follow the one rule of resolve_input_shapes (batch 1, others 64)."""
    model = _input_model([_vi("x", F32, ["N", 3]), _vi("y", F32, [None, 2, "T"])])
    feeds, notes = make_inputs(model)
    assert feeds["x"].shape == (1, 3) and feeds["y"].shape == (1, 2, 64), feeds
    assert notes == [
        "input 'x' dim 0 (N) is symbolic: used 1 (give --shape to choose)",
        "input 'y' dim 0 (?) is symbolic: used 1 (give --shape to choose)",
        "input 'y' dim 2 (T) is symbolic: used 64 (give --shape to choose)",
    ], notes
    feeds, notes = make_inputs(model, shapes={"x": [5, 3], "y": [4, 2, 7]})
    assert feeds["x"].shape == (5, 3) and feeds["y"].shape == (4, 2, 7) and notes == []
    with pytest.raises(MixprecError, match=r"--shape for input 'x' has rank 3 but the model"):
        make_inputs(model, shapes={"x": [5, 3, 1]})
    with pytest.raises(MixprecError, match=r"dim 1 = 4 but the model declares 3"):
        make_inputs(model, shapes={"x": [5, 4]})
    with pytest.raises(MixprecError, match=r"'nope', which is not a graph input"):
        make_inputs(model, shapes={"nope": [1]})


def test_make_inputs_unknown_rank_needs_a_shape() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [_vi("x", F32, None)], [_vi("y", F32, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    shapes, notes = resolve_input_shapes(model)
    assert shapes == {} and notes == ["input 'x' has unknown rank: give --shape x=D0,D1,..."]
    with pytest.raises(MixprecError, match=r"input 'x' has unknown rank; give its shape"):
        make_inputs(model)
    feeds, _ = make_inputs(model, shapes={"x": [2, 2]})
    assert feeds["x"].shape == (2, 2)


def test_make_inputs_string_input_is_an_error() -> None:
    model = _input_model([_vi("text", TensorProto.STRING, [1])])
    with pytest.raises(MixprecError, match=r"^input 'text' is a string tensor; mixprec cannot"):
        make_inputs(model)


def test_make_inputs_skips_initializer_inputs() -> None:
    w = _tensor("w", np.ones(3, np.float32))
    model = _model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        [_vi("x", F32, [3]), _vi("w", F32, [3])],
        [_vi("y", F32, [3])],
        [w],
    )
    feeds, _ = make_inputs(model)
    assert list(feeds) == ["x"]


def test_load_inputs_npz(tmp_path: Path) -> None:
    model = _input_model([_vi("x", F32, [2, 3]), _vi("ids", TensorProto.INT64, [4])])
    path = tmp_path / "inputs.npz"
    np.savez(path, x=np.ones((2, 3), np.float64), ids=np.arange(4, dtype=np.int32))
    feeds = load_inputs_npz(path, model)
    assert feeds["x"].dtype == np.float32 and feeds["ids"].dtype == np.int64, feeds
    np.testing.assert_array_equal(feeds["ids"], np.arange(4))

    np.savez(path, x=np.ones((2, 3), np.float32), other=np.zeros(1))
    with pytest.raises(MixprecError, match=r"has no array for input 'ids' \(it has: other, x\)"):
        load_inputs_npz(path, model)
    with pytest.raises(MixprecError, match=r"does not exist"):
        load_inputs_npz(tmp_path / "missing.npz", model)
    np.savez(path, x=np.ones((2, 3), np.float32), ids=np.ones(4, np.float32))
    with pytest.raises(MixprecError, match=r"input 'ids' expects int64 but"):
        load_inputs_npz(path, model)


# --------------------------------------------------------------------------- calibration files


def test_iter_calibration_npz_leading_axis_and_folder(tmp_path: Path) -> None:
    from mixprec.inputs.feeds import iter_calibration_npz

    model = _input_model([_vi("x", F32, ["N", 3]), _vi("ids", TensorProto.INT64, ["N"])])
    stacked = tmp_path / "calib.npz"
    np.savez(stacked, x=np.arange(12, dtype=np.float64).reshape(2, 2, 3), ids=np.ones((2, 2)))
    with pytest.raises(MixprecError, match=r"input 'ids' expects int64 but"):
        list(iter_calibration_npz(stacked, model))
    np.savez(stacked, x=np.arange(12, dtype=np.float64).reshape(2, 2, 3), ids=np.ones((2, 2), int))
    samples = list(iter_calibration_npz(stacked, model))
    assert len(samples) == 2 and samples[1]["x"].shape == (2, 3), samples
    assert samples[1]["x"].dtype == np.float32 and samples[1]["x"][0, 0] == 6.0

    np.savez(stacked, x=np.zeros((3, 2, 3)), ids=np.ones((2, 2), int))
    with pytest.raises(MixprecError, match=r"inconsistent sample counts \(x: 3, ids: 2\)"):
        iter_calibration_npz(stacked, model)
    np.savez(stacked, x=np.zeros((2, 3)), ids=np.ones((2, 2), int))
    with pytest.raises(MixprecError, match=r"plus a leading sample axis"):
        iter_calibration_npz(stacked, model)

    folder = tmp_path / "samples"
    folder.mkdir()
    with pytest.raises(MixprecError, match=r"holds no .npz file"):
        iter_calibration_npz(folder, model)
    for k, rows in enumerate([1, 5]):  # variable shapes across files
        np.savez(folder / f"{k}.npz", x=np.full((rows, 3), k, np.float32), ids=np.ones(rows, int))
    stream = iter_calibration_npz(folder, model)
    first = next(stream)
    assert first["x"].shape == (1, 3)
    assert next(stream)["x"].shape == (5, 3)
    with pytest.raises(MixprecError, match=r"does not exist"):
        iter_calibration_npz(tmp_path / "missing.npz", model)


def test_an_npz_of_one_sample_is_one_sample_everywhere(tmp_path: Path) -> None:
    """Issue 17: every command's --inputs takes the same forms; an .npz whose arrays have
    the inputs' own ranks is one sample, not a stack of rows."""
    from mixprec.inputs.feeds import iter_calibration_npz

    model = _input_model([_vi("x", F32, ["N", 3]), _vi("ids", TensorProto.INT64, ["N"])])
    one = tmp_path / "one.npz"
    np.savez(one, x=np.ones((4, 3), np.float32), ids=np.arange(4))
    (sample,) = list(iter_calibration_npz(one, model))
    assert sample["x"].shape == (4, 3) and sample["ids"].tolist() == [0, 1, 2, 3]
