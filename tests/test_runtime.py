"""Tests of mixprec._runtime: inputs, ORT runs, range analysis, comparison, emulation."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mixprec._errors import MixprecError
from mixprec._runtime import (
    DEFAULT_RTOL,
    OutputComparison,
    collect_absmax,
    compare_outputs,
    emulate_low_precision,
    load_inputs_npz,
    make_inputs,
    run_model,
    validate_models,
)

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
BF16 = TensorProto.BFLOAT16
OPSET = 21


def _model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name: str, elem: int, shape: Sequence[int | str | None] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def _tensor(name: str, values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values, name=name)


def _const(output: str, values: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [output], value=numpy_helper.from_array(values))


def _low_tensor_types(model: onnx.ModelProto) -> set[int]:
    """Low element types of any value, initializer or constant, subgraphs included.

    Also checks that every Cast to a low type only feeds Casts back to float32 (the
    rounding round trip of the emulation).
    """
    low = {F16, BF16}
    found: set[int] = set()

    def graphs(g: onnx.GraphProto) -> list[onnx.GraphProto]:
        out = [g]
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    out += graphs(a.g)
        return out

    for g in graphs(model.graph):
        found.update(t.data_type for t in g.initializer)
        for vi in [*g.input, *g.output, *g.value_info]:
            found.add(vi.type.tensor_type.elem_type)
        for n in g.node:
            for a in n.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    found.add(a.t.data_type)
            to = {a.name: a.i for a in n.attribute}.get("to")
            if n.op_type == "Cast" and to in low:
                users = [u for u in g.node if n.output[0] in u.input]
                assert users and all(
                    u.op_type == "Cast" and u.attribute[0].i == F32 for u in users
                ), f"Cast {n.name} to {to} is not a rounding round trip: {users}"
    return found & low


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), 1e-300))


def _assert_bits_equal(got: np.ndarray, want: np.ndarray) -> None:
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, (
        f"{bad.size} values differ, first at {bad[:5].tolist()}: "
        f"got {got.ravel()[bad[:5]].tolist()}, want {want.ravel()[bad[:5]].tolist()}"
    )


# --------------------------------------------------------------------------- make_inputs


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
    model = _input_model([_vi("x", F32, ["N", 3]), _vi("y", F32, [None, 2])])
    with pytest.raises(MixprecError, match=r"input 'x' has symbolic dim 'N'; give its shape with "):
        make_inputs(model)
    feeds, notes = make_inputs(model, default_dim=1)
    assert feeds["x"].shape == (1, 3) and feeds["y"].shape == (1, 2), feeds
    assert notes == [
        "input 'x': dim 0 ('N') unknown, used 1",
        "input 'y': dim 0 unknown, used 1",
    ], notes
    feeds, notes = make_inputs(model, shapes={"x": [5, 3], "y": [4, 2]})
    assert feeds["x"].shape == (5, 3) and feeds["y"].shape == (4, 2) and notes == []
    with pytest.raises(MixprecError, match=r"--shape for input 'x' has rank 3 but the model"):
        make_inputs(model, shapes={"x": [5, 3, 1]}, default_dim=1)
    with pytest.raises(MixprecError, match=r"dim 1 = 4 but the model declares 3"):
        make_inputs(model, shapes={"x": [5, 4]}, default_dim=1)
    with pytest.raises(MixprecError, match=r"'nope', which is not a graph input"):
        make_inputs(model, shapes={"nope": [1]}, default_dim=1)


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


# --------------------------------------------------------------------------- run_model


def test_run_model_sources_and_errors(tmp_path: Path) -> None:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [_vi("a", F32, [2]), _vi("b", F32, [2])],
        [_vi("y", F32, [2])],
    )
    feeds = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([0.5, 0.25], np.float32)}
    want = np.array([1.5, 2.25], np.float32)
    path = tmp_path / "add.onnx"
    onnx.save_model(model, path)
    for source in (model, model.SerializeToString(), str(path), path):
        out = run_model(source, feeds, threads=1)
        np.testing.assert_array_equal(out["y"], want, err_msg=f"source {type(source)}")
    assert list(run_model(model, feeds, output_names=["y"])) == ["y"]

    with pytest.raises(MixprecError, match=r"^onnxruntime failed to run the model: "):
        run_model(model, {"a": feeds["a"]})
    with pytest.raises(MixprecError, match=r"^onnxruntime cannot load the model: "):
        run_model(b"not a model", feeds)


def test_run_model_bfloat16_inputs_and_outputs() -> None:
    model = _model(
        [
            helper.make_node("Cast", ["x"], ["xf"], to=F32),
            helper.make_node("Cast", ["xf"], ["y"], to=BF16),
        ],
        [_vi("x", BF16, [3])],
        [_vi("y", BF16, [3])],
    )
    x = np.array([1.5, -2.25, 3.0e38], ml_dtypes.bfloat16)
    out = run_model(model, {"x": x})["y"]
    assert out.dtype == np.dtype(ml_dtypes.bfloat16), out.dtype
    _assert_bits_equal(out.astype(np.float32), x.astype(np.float32))


# --------------------------------------------------------------------------- collect_absmax


def _range_model() -> onnx.ModelProto:
    """x*1000 -> Exp (overflows), Tanh; an If whose then-branch holds a Constant."""
    then_branch = helper.make_graph(
        [
            _const("branch_k", np.array([-7.5, 2.0], np.float32)),
            helper.make_node("Mul", ["t", "branch_k"], ["then_out"]),
        ],
        "then",
        [],
        [_vi("then_out", F32, [2])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["t"], ["else_out"])], "else", [], [_vi("else_out", F32, [2])]
    )
    nodes = [
        helper.make_node("Mul", ["x", "k1000"], ["scaled"]),
        helper.make_node("Exp", ["scaled"], ["expd"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node(
            "If", ["cond"], ["branch"], then_branch=then_branch, else_branch=else_branch
        ),
        helper.make_node("Add", ["branch", "expd"], ["y"]),
    ]
    return _model(
        nodes,
        [_vi("x", F32, [2]), _vi("cond", TensorProto.BOOL, [])],
        [_vi("y", F32, [2])],
        [_tensor("k1000", np.array(1000.0, np.float32))],
    )


@pytest.mark.parametrize("chunk_size", [1, 2000])
def test_collect_absmax_exact_values(chunk_size: int) -> None:
    model = _range_model()
    before = model.SerializeToString()
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(True)}
    absmax = collect_absmax(model, feeds, chunk_size=chunk_size, threads=1)
    assert model.SerializeToString() == before, "the input model was mutated"
    want = {
        "x": 0.5,
        "k1000": 1000.0,
        "scaled": 500.0,
        "expd": math.inf,
        "t": float(np.tanh(np.float32(500.0))),
        "branch_k": 7.5,
        "branch": float(np.tanh(np.float32(500.0))) * 7.5,
        "y": math.inf,
    }
    assert set(absmax) == set(want), f"got keys {sorted(absmax)}, want {sorted(want)}"
    for name, value in want.items():
        assert absmax[name] == pytest.approx(value, rel=1e-6), (name, absmax[name], value)


def test_collect_absmax_nan_is_ignored_inf_is_recorded() -> None:
    model = _model(
        [
            helper.make_node("Sqrt", ["x"], ["root"]),
            helper.make_node("Reciprocal", ["x"], ["recip"]),
            helper.make_node("Add", ["root", "recip"], ["y"]),
        ],
        [_vi("x", F32, [3])],
        [_vi("y", F32, [3])],
    )
    feeds = {"x": np.array([-1.0, 4.0, 0.0], np.float32)}
    absmax = collect_absmax(model, feeds)
    assert absmax["root"] == 2.0, absmax  # sqrt(-1) is nan: ignored
    assert absmax["recip"] == math.inf, absmax


def test_collect_absmax_raises_when_the_model_cannot_run() -> None:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        [_vi("a", F32, ["N"]), _vi("b", F32, ["M"])],
        [_vi("y", F32, [None])],
    )
    feeds = {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)}  # cannot broadcast
    with pytest.raises(MixprecError, match=r"^onnxruntime failed to run the model"):
        collect_absmax(model, feeds)


# --------------------------------------------------------------------------- compare_outputs


def test_compare_outputs_thresholds_and_top1() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 10)).astype(np.float32)
    noise = rng.standard_normal(ref.shape)
    noise *= 0.005 * np.linalg.norm(ref) / np.linalg.norm(noise)  # rel L2 error 0.005
    out = (ref + noise).astype(np.float32)

    (loose,) = compare_outputs({"logits": ref}, {"logits": out}, rtol=1e-2, atol=0.0)
    (tight,) = compare_outputs({"logits": ref}, {"logits": out}, rtol=1e-3, atol=0.0)
    assert loose.rel_l2_error == pytest.approx(0.005, rel=1e-3), loose
    assert loose.passed and not tight.passed, (loose, tight)
    assert loose.max_abs_error == pytest.approx(float(np.abs(out - ref).max()), rel=1e-6)
    assert loose.ref_abs_max == pytest.approx(float(np.abs(ref).max()))

    swapped = ref.copy()
    row = swapped[0]
    i, j = int(np.argmax(row)), int(np.argmin(row))
    row[i], row[j] = row[j], row[i]
    (cmp,) = compare_outputs({"logits": ref}, {"logits": swapped}, rtol=1e-2)
    assert cmp.top1_agreement == pytest.approx(7 / 8), cmp
    assert not cmp.passed, cmp  # a large error; top-1 itself never decides
    (spatial,) = compare_outputs({"f": np.ones((1, 2, 3, 4))}, {"f": np.ones((1, 2, 3, 4))}, rtol=0)
    assert spatial.top1_agreement is None and spatial.passed, spatial


def test_compare_outputs_edge_cases() -> None:
    near_zero = np.full(4, 1e-6, np.float32)
    (cmp,) = compare_outputs({"y": near_zero}, {"y": near_zero * 3}, rtol=1e-2, atol=1e-3)
    assert cmp.passed and cmp.rel_l2_error == pytest.approx(2.0), cmp  # atol branch

    bad = np.array([1.0, np.inf], np.float32)
    (cmp,) = compare_outputs({"y": np.ones(2, np.float32)}, {"y": bad}, rtol=1.0, atol=1.0)
    assert not cmp.passed and "non-finite" in cmp.note, cmp

    (cmp,) = compare_outputs({"y": np.ones(3)}, {"y": np.ones(4)}, rtol=1.0)
    assert not cmp.passed and "shape" in cmp.note, cmp

    ids = np.array([1, 2, 3], np.int64)
    same, diff = compare_outputs(
        {"a": ids, "b": ids}, {"a": ids.copy(), "b": ids + 1}, rtol=1.0, atol=1.0
    )
    assert same.passed and same.rel_l2_error == 0.0, same
    assert not diff.passed and diff.rel_l2_error == 1.0, diff

    (missing,) = compare_outputs({"y": ids}, {}, rtol=1.0)
    assert not missing.passed and "missing" in missing.note
    assert missing.to_dict()["max_abs_error"] == "inf"
    assert set(OutputComparison("n", 0, 0, 0, None, True).to_dict()) == {
        "name",
        "max_abs_error",
        "rel_l2_error",
        "ref_abs_max",
        "top1_agreement",
        "passed",
        "note",
    }


# --------------------------------------------------------------------------- emulation


def _fp16_mlp(low: int = F16, low_io: bool = False) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(fp32 original, low-precision version): y = Relu(x @ W + B)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    original = _model(
        [
            helper.make_node("MatMul", ["x", "W"], ["mm"]),
            helper.make_node("Add", ["mm", "B"], ["z"]),
            helper.make_node("Relu", ["z"], ["y"]),
        ],
        [_vi("x", F32, [4, 16])],
        [_vi("y", F32, [4, 32])],
        [_tensor("W", w), _tensor("B", b)],
    )
    np_low = np.float16 if low == F16 else ml_dtypes.bfloat16
    body = [
        helper.make_node("MatMul", ["xl", "Wl"], ["mm"]),
        helper.make_node("Add", ["mm", "Bl"], ["z"]),
        helper.make_node("Relu", ["z"], ["yl"]),
    ]
    inits = [_tensor("Wl", w.astype(np_low)), _tensor("Bl", b.astype(np_low))]
    if low_io:
        body[0].input[0] = "x"
        body[2].output[0] = "y"
        converted = _model(body, [_vi("x", low, [4, 16])], [_vi("y", low, [4, 32])], inits)
    else:
        nodes = [helper.make_node("Cast", ["x"], ["xl"], to=low), *body]
        nodes.append(helper.make_node("Cast", ["yl"], ["y"], to=F32))
        converted = _model(nodes, [_vi("x", F32, [4, 16])], [_vi("y", F32, [4, 32])], inits)
    return original, converted


def test_emulated_fp16_model_matches_real_fp16_run() -> None:
    _, converted = _fp16_mlp()
    before = converted.SerializeToString()
    emulated = emulate_low_precision(converted)
    assert converted.SerializeToString() == before, "the input model was mutated"
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)

    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    real = run_model(converted, {"x": x})["y"]
    emu = run_model(emulated, {"x": x})["y"]
    fp32 = np.maximum(
        x @ numpy_helper.to_array(converted.graph.initializer[0]).astype(np.float32), 0
    )
    assert _rel_l2(emu, real) <= 1e-3, f"emulated vs fp16 rel L2 {_rel_l2(emu, real)}"
    assert _rel_l2(emu, fp32) > 0, "emulation should differ from pure fp32"
    # every value the emulated model outputs is representable in float16
    _assert_bits_equal(emu, emu.astype(np.float16).astype(np.float32))


def test_emulated_low_precision_graph_inputs_and_outputs() -> None:
    _, converted = _fp16_mlp(low_io=True)
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert emulated.graph.input[0].type.tensor_type.elem_type == F32
    assert emulated.graph.output[0].type.tensor_type.elem_type == F32
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    real = run_model(converted, {"x": x.astype(np.float16)})["y"]
    emu = run_model(emulated, {"x": x})["y"]  # fed as float32: rounded inside
    assert _rel_l2(emu, real) <= 1e-3, f"emulated vs fp16 rel L2 {_rel_l2(emu, real)}"


def test_emulated_bfloat16_rounding_is_exact() -> None:
    three = _tensor("three", np.array(3.0, ml_dtypes.bfloat16))
    converted = _model(
        [
            helper.make_node("Mul", ["x", "one"], ["xs"]),
            helper.make_node("Cast", ["xs"], ["xb"], to=BF16),
            helper.make_node("Mul", ["xb", "three"], ["pb"]),
            helper.make_node("Cast", ["xb"], ["y_round"], to=F32),
            helper.make_node("Cast", ["pb"], ["y_prod"], to=F32),
        ],
        [_vi("x", F32, [None])],
        [_vi("y_round", F32, [None]), _vi("y_prod", F32, [None])],
        [_tensor("one", np.array(1.0, np.float32)), three],
    )
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    rng = np.random.default_rng(4)
    special = [np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -0.0, 1.00390625, 1.01171875]
    x = np.concatenate([rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000), special])
    x = x.astype(np.float32)
    out = run_model(emulated, {"x": x})
    rounded = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    _assert_bits_equal(out["y_round"], rounded)
    # a product of two bfloat16 values is exact in float32, so this is correctly rounded
    with np.errstate(over="ignore", invalid="ignore"):
        want_prod = (rounded * np.float32(3.0)).astype(ml_dtypes.bfloat16).astype(np.float32)
    _assert_bits_equal(out["y_prod"], want_prod)


def _if_low_model() -> onnx.ModelProto:
    then_branch = helper.make_graph(
        [
            _const("k", np.array([1.1, -2.3, 0.7], np.float16)),
            helper.make_node("Mul", ["xh", "k"], ["prod"]),
            helper.make_node("Add", ["prod", "prod"], ["then_out"]),
        ],
        "then",
        [],
        [_vi("then_out", F16, [3])],
    )
    else_branch = helper.make_graph(
        [
            helper.make_node("Cast", ["x"], ["xh2"], to=F16),
            helper.make_node("Sqrt", ["xh2"], ["else_out"]),
        ],
        "else",
        [],
        [_vi("else_out", F16, [3])],
    )
    return _model(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=F16),
            helper.make_node("If", ["c"], ["r"], then_branch=then_branch, else_branch=else_branch),
            helper.make_node("Cast", ["r"], ["y"], to=F32),
        ],
        [_vi("x", F32, [3]), _vi("c", TensorProto.BOOL, [])],
        [_vi("y", F32, [3])],
    )


def test_emulated_if_subgraph_model() -> None:
    converted = _if_low_model()
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)
    x = np.array([0.3, 1.7, 2.9], np.float32)
    for cond in (True, False):
        feeds = {"x": x, "c": np.array(cond)}
        real = run_model(converted, feeds)["y"]
        emu = run_model(emulated, feeds)["y"]
        _assert_bits_equal(emu, real)  # fp16 Mul/Add/Sqrt are correctly rounded both ways


def test_emulated_loop_body_with_low_carried_value() -> None:
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Mul", ["v_in", "step"], ["v_out"]),
        ],
        "body",
        [
            _vi("i", TensorProto.INT64, []),
            _vi("cond_in", TensorProto.BOOL, []),
            _vi("v_in", F16, [3]),
        ],
        [_vi("cond_out", TensorProto.BOOL, []), _vi("v_out", F16, [3])],
    )
    converted = _model(
        [
            helper.make_node("Cast", ["x"], ["xh"], to=F16),
            helper.make_node("Loop", ["n", "", "xh"], ["vh"], body=body),
            helper.make_node("Cast", ["vh"], ["y"], to=F32),
        ],
        [_vi("x", F32, [3])],
        [_vi("y", F32, [3])],
        [_tensor("n", np.array(5, np.int64)), _tensor("step", np.array(1.1, np.float16))],
    )
    emulated = emulate_low_precision(converted)
    onnx.checker.check_model(emulated, full_check=True)
    assert not _low_tensor_types(emulated), _low_tensor_types(emulated)
    feeds = {"x": np.array([0.3, 1.7, -2.9], np.float32)}
    _assert_bits_equal(run_model(emulated, feeds)["y"], run_model(converted, feeds)["y"])


# --------------------------------------------------------------------------- validate_models


@pytest.mark.parametrize("op", ["MatMul", "Add", "Mul"])
def test_ort_cpu_lacks_bfloat16_kernels(op: str) -> None:
    """The premise of the emulated fallback; if ORT gains kernels, revisit the next test."""
    model = _model(
        [helper.make_node(op, ["a", "b"], ["y"])],
        [_vi("a", BF16, [2, 2]), _vi("b", BF16, [2, 2])],
        [_vi("y", BF16, [2, 2])],
    )
    pattern = rf"^onnxruntime cannot load the model: .*NOT_IMPLEMENTED.*{op}"
    with pytest.raises(MixprecError, match=pattern):
        run_model(model, {"a": np.ones((2, 2), ml_dtypes.bfloat16)} | {"b": np.ones((2, 2))})


def test_validate_bfloat16_auto_falls_back_to_emulation() -> None:
    original, converted = _fp16_mlp(low=BF16)
    feeds, _ = make_inputs(original)
    report = validate_models(original, converted, feeds)
    assert report.kind == "emulated" and report.fallback_reason, report
    assert "NOT_IMPLEMENTED" in report.fallback_reason, report.fallback_reason
    assert report.low_dtype == "bfloat16" and report.rtol == DEFAULT_RTOL["bfloat16"], report
    assert report.passed, report.format_table()
    (out,) = report.outputs
    assert 0 < out.rel_l2_error < 2e-2, out
    with pytest.raises(MixprecError, match=r"NOT_IMPLEMENTED"):
        validate_models(original, converted, feeds, mode="ort")
    emulated = validate_models(original, converted, feeds, mode="emulated")
    assert emulated.kind == "emulated" and emulated.fallback_reason == "", emulated
    assert emulated.outputs == report.outputs


def test_validate_fp16_runs_on_ort_and_reports() -> None:
    original, converted = _fp16_mlp()
    feeds, _ = make_inputs(original)
    report = validate_models(original, converted, feeds)
    assert report.kind == "onnxruntime" and report.fallback_reason == "", report
    assert report.low_dtype == "float16" and report.rtol == 1e-2, report
    assert report.passed, report.format_table()
    table = report.format_table()
    assert table.splitlines()[0].split() == [
        "output",
        "max",
        "abs",
        "err",
        "rel",
        "L2",
        "top-1",
        "ok",
    ]
    assert "PASSED" in table and "\ny " in table, table
    data = report.to_dict()
    assert data["passed"] is True and data["kind"] == "onnxruntime", data

    strict = validate_models(original, converted, feeds, rtol=1e-9, atol=0.0, mode="ort")
    assert not strict.passed and "FAILED" in strict.format_table(), strict.format_table()
    with pytest.raises(MixprecError, match=r"unknown validation mode 'gpu'"):
        validate_models(original, converted, feeds, mode="gpu")


def test_large_model_paths_use_external_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models over the protobuf limit run through a temporary external-data file."""
    import mixprec._runtime as rt

    big = np.linspace(-3.0, 2.0, 4096, dtype=np.float32)
    model = _model(
        [
            helper.make_node("Mul", ["x", "w"], ["p"]),
            helper.make_node("Add", ["w", "w"], ["ww"]),  # folded to a constant by ORT
            helper.make_node("Add", ["p", "ww"], ["y"]),
        ],
        [_vi("x", F32, [4096])],
        [_vi("y", F32, [4096])],
        [_tensor("w", big)],
    )
    before = model.SerializeToString()
    monkeypatch.setattr(rt, "_PROTO_LIMIT", 1000)
    x = np.full(4096, 2.0, np.float32)
    out = run_model(model, {"x": x})["y"]
    np.testing.assert_allclose(out, 4 * big, rtol=1e-6)
    absmax = collect_absmax(model, {"x": x}, chunk_size=1)
    assert model.SerializeToString() == before, "the input model was mutated"
    want = {"x": 2.0, "w": 3.0, "p": 6.0, "ww": 6.0, "y": 12.0}
    assert absmax == pytest.approx(want), absmax


def test_collect_absmax_bisects_failing_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor ORT refuses to expose is skipped with a warning; the others are kept."""
    import mixprec._runtime as rt

    real_run = rt._VariantRunner.run

    def run(self: rt._VariantRunner, outputs: Sequence[onnx.ValueInfoProto]) -> dict:
        if any(vi.name == "t" for vi in outputs):
            raise MixprecError("onnxruntime failed to run the model: refused")
        return real_run(self, outputs)

    monkeypatch.setattr(rt._VariantRunner, "run", run)
    # Force the fetch-in-chunks fallback (used when the in-graph reduction cannot run).
    monkeypatch.setattr(rt, "_absmax_in_graph", lambda *args, **kwargs: None)
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    with caplog.at_level("WARNING", logger="mixprec._runtime"):
        absmax = collect_absmax(_range_model(), feeds)
    assert "t" not in absmax, absmax
    assert absmax["scaled"] == 500.0 and absmax["branch"] == pytest.approx(np.tanh(500.0)), absmax
    assert "skipped 1 tensor(s) ('t')" in caplog.text, caplog.text


def test_run_model_lowers_an_ir_version_newer_than_onnxruntime(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["y"])], "g", [_vi("x", F32, [2])], [_vi("y", F32, [2])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 99
    x = np.array([1.0, -2.0], np.float32)
    for source in (model, model.SerializeToString()):
        np.testing.assert_array_equal(run_model(source, {"x": x})["y"], -x)
    assert model.ir_version == 99, "the input model was mutated"
    path = tmp_path / "m.onnx"
    onnx.save_model(model, path)
    with pytest.raises(MixprecError, match=r"Unsupported model IR version: 99"):
        run_model(path, {"x": x})  # a user's file is never rewritten
    assert onnx.load_model(path).ir_version == 99


def test_collect_absmax_in_graph_matches_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-graph ReduceMax(Abs) path gives the same ranges and shapes as fetching."""
    import mixprec._runtime as rt

    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    shapes_fast: dict[str, list[int]] = {}
    fast = collect_absmax(_range_model(), feeds, shapes_out=shapes_fast)
    monkeypatch.setattr(rt, "_absmax_in_graph", lambda *args, **kwargs: None)
    shapes_slow: dict[str, list[int]] = {}
    slow = collect_absmax(_range_model(), feeds, shapes_out=shapes_slow)
    assert fast.keys() == slow.keys(), (sorted(fast), sorted(slow))
    for name in fast:
        assert fast[name] == pytest.approx(slow[name]), (name, fast[name], slow[name])
    for name, dims in shapes_slow.items():
        assert shapes_fast.get(name) == dims, (name, shapes_fast.get(name), dims)
