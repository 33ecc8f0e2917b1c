"""Malformed and odd input models: one ``mixprec: error: ...`` line and exit 2 for faults
(naming the node or tensor), a valid converted model for what ONNX Runtime runs.

Each model is built in code; CLI cases go through ``mixprec.cli.main.main`` and check all of
stderr, that nothing is written and that the input file is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort, sha256_of
from mixprec.cli.main import main
from mixprec.io.proto_checks import check_proto
from mixprec.passes.input_checks import CheckInputPass
from mixprec.passes.sanitize import (
    RepairNamesPass,
    SetIrVersionPass,
    SortNodesPass,
)

F = TensorProto.FLOAT


def _vi(name: str, shape: list[int | str] | None = None, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, [1, 4] if shape is None else shape)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto] | None = None,
    outputs: list[onnx.ValueInfoProto] | None = None,
    inits: list[onnx.TensorProto] | None = None,
    *,
    opset: int = 17,
    ir_version: int = 8,
    functions: list[onnx.FunctionProto] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs or [_vi("x")], outputs or [_vi("y")], inits or [])
    imports = [helper.make_opsetid("", opset)]
    if functions:
        imports.append(helper.make_opsetid(functions[0].domain, 1))
    return helper.make_model(
        graph, opset_imports=imports, ir_version=ir_version, functions=functions or []
    )


def _relu(**kw: object) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"], name="r")], **kw)  # type: ignore[arg-type]


def _conv_bn(*, ir_version: int = 8, opset: int = 17, eps: onnx.AttributeProto | None = None):
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((0.3 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "w"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 4).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "mu"),
        numpy_helper.from_array(rng.uniform(0.5, 2, 4).astype(np.float32), "var"),
    ]
    bn = helper.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], ["y"], name="bn")
    if eps is not None:
        bn.attribute.append(eps)
    conv = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1])
    inputs = [_vi("x", [1, 3, 8, 8])]
    if ir_version < 4:  # IR 3: every initializer is also a graph input
        inputs += [_vi(t.name, list(t.dims)) for t in inits]
    return _model(
        [conv, bn], inputs, [_vi("y", [1, 4, 8, 8])], inits, opset=opset, ir_version=ir_version
    )


def _with_attr(model: onnx.ModelProto, index: int, attr: onnx.AttributeProto) -> onnx.ModelProto:
    model.graph.node[index].attribute.append(attr)
    return model


def _undefined_attr() -> onnx.ModelProto:
    model = _relu()
    attr = model.graph.node[0].attribute.add()
    attr.name = "alpha"
    attr.type = onnx.AttributeProto.UNDEFINED
    return model


def _short_raw(fold: bool) -> onnx.ModelProto:
    if fold:
        model = _conv_bn()
    else:
        k = numpy_helper.from_array(np.ones((1, 4), np.float32), "k")
        model = _model([helper.make_node("Add", ["x", "k"], ["y"], name="add")], inits=[k])
    tensor = model.graph.initializer[0]
    tensor.raw_data = tensor.raw_data[:6]
    return model


def _undefined_input() -> onnx.ModelProto:
    model = _relu()
    model.graph.input[0].type.tensor_type.elem_type = 0
    return model


def _recursive() -> onnx.ModelProto:
    f = helper.make_function(
        "local",
        "F",
        ["a"],
        ["b"],
        [helper.make_node("F", ["a"], ["b"], domain="local")],
        [helper.make_opsetid("", 17), helper.make_opsetid("local", 1)],
    )
    return _model([helper.make_node("F", ["x"], ["y"], domain="local")], functions=[f])


def _no_outputs() -> onnx.ModelProto:
    model = _relu()
    del model.graph.output[:]
    return model


def _empty_if() -> onnx.ModelProto:
    empty = helper.make_graph([], "branch", [], [])
    node = helper.make_node("If", ["c"], ["y"], name="if", then_branch=empty, else_branch=empty)
    return _model([node], [_vi("c", [], TensorProto.BOOL)])


def _view_of_declared_zero(blocks: int = 40) -> onnx.ModelProto:
    """Conv, Relu ``r`` declared [0, 4, 8, 8], ``r.view(r.size(0), -1)`` as PyTorch exports
    it (Shape, Gather, Concat, Reshape), MatMul, then ``blocks`` x (Mul, Add): onnx.checker
    passes, ONNX Runtime refuses the model (its Reshape inference reads the declared 0
    beside -1). A fuzz case: range analysis warned once per tensor (52 lines at 40 blocks,
    each variant that did not make ``r`` an output failed to load), then wrote a model ORT
    refuses too, exit 0."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype("f4"), "w"),
        numpy_helper.from_array((rng.standard_normal((256, 10)) * 0.1).astype("f4"), "fc"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([-1], np.int64), "rest"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Shape", ["r"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="gather"),
        helper.make_node("Concat", ["n", "rest"], ["t"], axis=0, name="concat"),
        helper.make_node("Reshape", ["r", "t"], ["f"], name="view"),
        helper.make_node("MatMul", ["f", "fc"], ["h"], name="fc"),
    ]
    h = "h"
    for k in range(blocks):
        nodes += [
            helper.make_node("Mul", [h, "half"], [f"m{k}"], name=f"mul{k}"),
            helper.make_node("Add", [f"m{k}", h], [f"a{k}"], name=f"add{k}"),
        ]
        h = f"a{k}"
    nodes.append(helper.make_node("Identity", [h], ["y"], name="out"))
    model = _model(
        nodes,
        [_vi("x", ["N", 3, 8, 8])],
        [_vi("y", ["N", 10])],
        inits,
    )
    model.graph.value_info.append(_vi("r", [0, 4, 8, 8]))
    return model


def _ir_version(version: int) -> Callable[[], onnx.ModelProto]:
    def make() -> onnx.ModelProto:
        model = _relu()
        model.ir_version = version
        return model

    return make


# name: (model builder, extra CLI args, fragment of the error line)
BAD: dict[str, tuple[Callable[[], onnx.ModelProto], list[str], str]] = {
    "bn-epsilon-string": (
        lambda: _conv_bn(eps=helper.make_attribute("epsilon", "1e-5")),
        [],
        "node 'bn' (BatchNormalization): attribute 'epsilon' must be FLOAT, not STRING",
    ),
    "bn-epsilon-ints": (
        lambda: _conv_bn(eps=helper.make_attribute("epsilon", [1, 2])),
        [],
        "attribute 'epsilon' must be FLOAT, not INTS",
    ),
    "constant-value-ints": (
        lambda: _model(
            [
                helper.make_node("Constant", [], ["k"], name="k", value=[1, 2]),  # wrong kind
                helper.make_node("Add", ["x", "k"], ["y"]),
            ]
        ),
        [],
        "node 'k' (Constant): attribute 'value' must be TENSOR, not INTS",
    ),
    "cast-to-999": (
        lambda: _model([helper.make_node("Cast", ["x"], ["y"], name="cast", to=999)]),
        [],
        "node 'cast' (Cast): attribute 'to' = 999 is not an ONNX element type",
    ),
    "attribute-undefined": (_undefined_attr, [], "node 'r' (Relu): attribute 'alpha' has no type"),
    "raw-data-short-folded": (
        lambda: _short_raw(True),
        [],
        "initializer 'w' holds 6 bytes of raw_data, but its dims [4, 3, 3, 3] of float need 432",
    ),
    "raw-data-short": (lambda: _short_raw(False), ["--no-calibrate"], "initializer 'k' holds 6"),
    "input-undefined": (_undefined_input, [], "graph input 'x' has no element type"),
    "recursive-function": (_recursive, [], "recursively (local::F -> local::F)"),
    "no-graph-outputs": (_no_outputs, [], "no graph outputs"),
    "missing-tensor": (
        lambda: _model([helper.make_node("Add", ["x", "nope"], ["y"], name="add")]),
        ["--no-calibrate"],
        "node 'add' (Add) reads 'nope' (input 1), which no node",
    ),
    "output-not-computed": (lambda: _model([]), [], "output 'y' of the graph is not computed"),
    "onnxruntime-refuses-the-input": (
        _view_of_declared_zero,
        [],
        "onnxruntime cannot load the model: [ONNXRuntimeError] : 1 : FAIL : Node (view) Op "
        "(Reshape) [ShapeInferenceError] Invalid Target shape product of 0",
    ),
    # a fuzz case: a Cast's input renamed to "" crashed FoldCastsPass (IndexError, exit 3)
    "cast-input-empty": (
        lambda: _model(
            [
                helper.make_node("Cast", [""], ["c"], name="cast", to=TensorProto.FLOAT),
                helper.make_node("Add", ["x", "c"], ["y"], name="add"),
            ]
        ),
        [],
        "node 'cast' (Cast): input 0 ('input') is required but its name is empty",
    ),
    "too-few-inputs": (
        lambda: _model([helper.make_node("Add", ["x"], ["y"], name="add")]),
        ["--no-calibrate"],
        "node 'add' (Add): has 1 input(s); Add-14 needs at least 2",
    ),
    "empty-if-branches": (
        _empty_if,
        ["--no-calibrate"],
        "node 'if' (If): then_branch has 0 output(s), the node has 1",
    ),
    "domain-not-imported": (
        lambda: _model([helper.make_node("Foo", ["x"], ["y"], name="foo", domain="com.x")]),
        [],
        "node 'foo' (Foo) is in domain 'com.x', which the model does not import",
    ),
    "unknown-ai-onnx-op": (
        lambda: _model([helper.make_node("Frobnicate", ["x"], ["y"], name="f")]),
        ["--no-calibrate"],
        "ai.onnx has no operator 'Frobnicate' at opset 17",
    ),
    "unknown-attribute": (
        lambda: _with_attr(_relu(), 0, helper.make_attribute("alpha", 0.1)),
        [],
        "node 'r' (Relu): Relu-14 has no attribute 'alpha'",
    ),
    "axis-out-of-rank": (
        lambda: _model([helper.make_node("Softmax", ["x"], ["y"], name="s", axis=2**40)]),
        [],
        "node 's' (Softmax): axis 1099511627776 is out of range for an input of rank 2 "
        "(must be in [-2, 1])",
    ),
    "flatten-axis-past-rank": (
        lambda: _model(
            [helper.make_node("Flatten", ["x"], ["y"], name="f", axis=3)],
            outputs=[_vi("y", [1, 4])],
        ),
        [],
        "node 'f' (Flatten): axis 3 is out of range for an input of rank 2 (must be in [-2, 2])",
    ),
    "reduce-axes-out-of-rank": (
        lambda: _model(
            [helper.make_node("ReduceMax", ["x"], ["y"], name="r", axes=[-3])],
            outputs=[_vi("y", [1, 4])],
            opset=13,
        ),
        [],
        "node 'r' (ReduceMax): axes -3 is out of range",
    ),
    "opset-too-new": (lambda: _relu(opset=99), [], "opset 99"),
    "ir-version-too-new": (_ir_version(99), [], "ir_version 99 is newer"),
    "string-input": (
        lambda: _model(
            [helper.make_node("Identity", ["s"], ["t"])],
            [_vi("s", [1], TensorProto.STRING)],
            [_vi("t", [1], TensorProto.STRING)],
        ),
        [],
        "string",
    ),
    "unknown-domain-imported": (
        lambda: _model(
            [helper.make_node("Foo", ["x"], ["y"], name="foo", domain="com.x")]
        ).__class__.FromString(
            _add_import(
                _model([helper.make_node("Foo", ["x"], ["y"], name="foo", domain="com.x")])
            ).SerializeToString()
        ),
        [],
        "com.x:Foo",
    ),
}


def _add_import(model: onnx.ModelProto) -> onnx.ModelProto:
    model.opset_import.append(helper.make_opsetid("com.x", 1))
    return model


def _run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(args)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_model_is_one_error_line_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, extra, fragment = BAD[case]
    src = tmp_path / "in.onnx"
    src.write_bytes(make().SerializeToString())
    digest = sha256_of(src)
    out = tmp_path / "out.onnx"
    rc, err = _run_cli(["convert", str(src), "-o", str(out), "-q", *extra], capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("mixprec: error: "), err
    assert fragment in lines[0], err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]  # no temporary left
    assert sha256_of(src) == digest


# --- faults that must be caught before onnx_ir parses the proto ---------------------------


def _duplicate_output() -> onnx.ModelProto:
    return _model(
        [
            helper.make_node("Relu", ["x"], ["y"], name="a"),
            helper.make_node("Neg", ["x"], ["y"], name="b"),
        ]
    )


def _undefined_initializer() -> onnx.ModelProto:
    k = numpy_helper.from_array(np.ones((1, 4), np.float32), "k")
    model = _model([helper.make_node("Add", ["x", "k"], ["y"])], inits=[k])
    model.graph.initializer[0].data_type = 0
    return model


PROTO_FAULTS = {
    "duplicate-output": (_duplicate_output, "node 'b' (Neg) writes 'y', which node 'a' (Relu)"),
    "undefined-initializer": (_undefined_initializer, "initializer 'k' has no valid element type"),
    "short-raw-data": (lambda: _short_raw(False), "initializer 'k' holds 6 bytes"),
}


@pytest.mark.parametrize("case", list(PROTO_FAULTS))
def test_check_proto_names_the_fault(case: str) -> None:
    make, fragment = PROTO_FAULTS[case]
    with pytest.raises(mixprec.MixprecError, match=r"^model: ") as caught:
        check_proto(make())
    assert fragment in str(caught.value)


def test_a_domain_imported_twice_is_refused_or_deduplicated() -> None:
    model = _relu()
    model.opset_import.append(helper.make_opsetid("", 13))
    with pytest.raises(mixprec.MixprecError, match=r"domain 'ai.onnx' imported 2 times"):
        check_proto(model)
    same = _relu()
    same.opset_import.append(helper.make_opsetid("", same.opset_import[0].version))
    check_proto(same)  # the same version twice is harmless: converted with one import
    out = mixprec.convert(same, "bf16").model_proto
    assert [o.domain for o in out.opset_import].count("") == 1


def test_check_proto_accepts_a_sound_model() -> None:
    check_proto(_conv_bn())
    check_proto(_relu())


@pytest.mark.parametrize("case", ["duplicate-output", "undefined-initializer"])
def test_proto_faults_through_the_cli(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make, fragment = PROTO_FAULTS[case]
    src = tmp_path / "in.onnx"
    src.write_bytes(make().SerializeToString())
    rc, err = _run_cli(["convert", str(src), "-o", str(tmp_path / "o.onnx"), "-q"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


# --- odd input that ONNX Runtime runs: converted, checked, numerically equal ------------------


def _convert_and_compare(
    model: onnx.ModelProto,
    dtype: str,
    feeds: dict[str, np.ndarray],
    reference: dict[str, np.ndarray] | None = None,
    **options: object,
) -> mixprec.ConversionResult:
    ref = reference if reference is not None else run_ort(model, feeds)
    result = mixprec.convert(model, dtype, calibration_data=feeds, **options)  # type: ignore[arg-type]
    proto = result.model_proto
    onnx.checker.check_model(proto, full_check=True)
    if dtype == "fp16":
        got = run_ort(proto, feeds)
    else:  # ORT's CPU provider has no bf16 kernels: run the rounding-emulated FP32 model
        emulated = mixprec.EmulateLowPrecisionPass()(ir.from_proto(proto)).model
        got = run_ort(ir.to_proto(emulated), feeds)
    assert set(got) == set(ref)
    for name in ref:
        assert_close(ref[name], got[name], dtype, name=name)
    return result


def _image(shape: tuple[int, ...] = (1, 3, 8, 8)) -> np.ndarray:
    return np.random.default_rng(1).uniform(0, 1, shape).astype(np.float32)


def _non_utf8_names(output: bool = False) -> bytes:
    model = _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["mmmm"], name="NODEA"),
            helper.make_node("Relu", ["mmmm"], ["VALY"], name="NODEB"),
        ],
        outputs=[_vi("VALY", [1, 4])],
        inits=[numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")],
    )
    # Same lengths, so the protobuf framing stays valid.
    data = model.SerializeToString().replace(b"NODEA", b"N\xff\xfeDA")
    data = data.replace(b"mmmm", b"m\xffmm")
    return data.replace(b"VALY", b"V\xffLY") if output else data


def test_non_utf8_names_convert_and_are_renamed(tmp_path: Path) -> None:
    data = _non_utf8_names()
    proto = onnx.ModelProto.FromString(data)
    model = ir.from_proto(proto)
    result = RepairNamesPass()(model)
    assert result.modified
    assert [n.name for n in model.graph] == ["N\\xff\\xfeDA", "NODEB"]
    assert next(iter(model.graph)).outputs[0].name == "m\\xffmm"
    assert "renamed 1 node(s) and 1 value(s)" in result.notes[0]
    assert not RepairNamesPass()(model).modified
    x = np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)
    converted = mixprec.convert(proto, "fp16", calibration_data={"x": x}).model_proto
    onnx.checker.check_model(converted, full_check=True)
    assert [o.name for o in converted.graph.output] == ["VALY"]
    assert_close(np.maximum(x, 0), run_ort(converted, {"x": x})["VALY"], "fp16")


def test_non_utf8_graph_output_name_is_refused_not_renamed() -> None:
    proto = onnx.ModelProto.FromString(_non_utf8_names(output=True))
    with pytest.raises(mixprec.MixprecError, match=r"graph output name 'V\\\\xffLY' is not UTF-8"):
        mixprec.convert(proto, "fp16")


def test_unsorted_nodes_are_sorted() -> None:
    model = _model(
        [
            helper.make_node("Relu", ["h"], ["y"], name="second"),
            helper.make_node("MatMul", ["x", "w"], ["h"], name="first"),
        ],
        inits=[numpy_helper.from_array(np.eye(4, dtype=np.float32) * 2, "w")],
    )
    irm = ir.from_proto(model)
    result = SortNodesPass()(irm)
    assert result.modified and [n.name for n in irm.graph] == ["first", "second"]
    assert "main graph" in result.notes[0]
    assert not SortNodesPass()(irm).modified
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)}
    _convert_and_compare(model, "fp16", feeds)


def test_ir_version_0_is_taken_from_the_opset() -> None:
    model = _relu()
    model.ir_version = 0
    irm = ir.from_proto(model)
    result = SetIrVersionPass()(irm)
    assert result.modified and irm.ir_version == 8  # opset 17 came with IR 8
    assert "ir_version 0 (unset) taken as 8" in result.notes[0]
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)}
    out = _convert_and_compare(model, "fp16", feeds)
    assert out.model.ir_version == 8


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ir3_conv_batchnorm_folds_and_passes_the_checker(dtype: str) -> None:
    model = _conv_bn(ir_version=3, opset=8)
    names = [i.name for i in model.graph.input]
    feeds = {"x": _image()}
    ref = run_ort(model, feeds)
    result = _convert_and_compare(model, dtype, feeds, ref)
    assert result.model.ir_version == 4
    assert [v.name for v in result.model.graph.inputs] == names  # inputs unchanged
    kept = "BatchNormalization" in [n.op_type for n in result.model.graph]
    if dtype == "bf16":  # bf16 keeps it whole (a rounded folded bias loses the shift)
        assert result.report.batchnorm_folded == [] and kept
    else:
        assert result.report.batchnorm_folded == ["bn"] and not kept


def _function_model(function_opset: int, *, inline: bool = False) -> onnx.ModelProto:
    """A Conv block as a model-local function; ``inline``: its body in the graph, at the
    function's opset (ORT does not run an opset-11 body inside an opset-17 model)."""
    rng = np.random.default_rng(2)
    body = [
        helper.make_node("Conv", ["a", "k"], ["t"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["t"], ["u"]),
        helper.make_node("ReduceSum", ["u"], ["b"], axes=[1], keepdims=1)
        if function_opset < 13
        else helper.make_node("Identity", ["u"], ["b"]),
    ]
    f = helper.make_function(
        "local", "Block", ["a", "k"], ["b"], body, [helper.make_opsetid("", function_opset)]
    )
    w = numpy_helper.from_array((0.3 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "w")
    out_c = 1 if function_opset < 13 else 4
    if inline:
        for node in body:
            node.input[:] = [{"a": "x", "k": "w"}.get(n, n) for n in node.input]
            node.output[:] = [{"b": "y"}.get(n, n) for n in node.output]
        return _model(
            body, [_vi("x", [1, 3, 8, 8])], [_vi("y", [1, out_c, 8, 8])], [w], opset=function_opset
        )
    return _model(
        [helper.make_node("Block", ["x", "w"], ["y"], domain="local", name="call")],
        [_vi("x", [1, 3, 8, 8])],
        [_vi("y", [1, out_c, 8, 8])],
        [w],
        opset=17,
        functions=[f],
    )


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("function_opset", [11, 17], ids=["opset-differs", "same-opset"])
def test_model_local_functions_convert(dtype: str, function_opset: int) -> None:
    model = _function_model(function_opset)
    feeds = {"x": _image()}
    ref = run_ort(_function_model(function_opset, inline=True), feeds)
    result = _convert_and_compare(model, dtype, feeds, ref)
    assert not result.model.functions
    ops = [n.op_type for n in result.model.graph]
    assert "Conv" in ops and "Block" not in ops


def test_output_that_is_an_input_and_zero_nodes() -> None:
    model = _model([], [_vi("x")], [_vi("x")])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)}
    result = _convert_and_compare(model, "fp16", feeds)
    assert len(result.model.graph) == 0
    passthrough = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y"), _vi("x")])
    _convert_and_compare(passthrough, "fp16", feeds)


def test_nan_inf_and_huge_weights_keep_their_consumer_fp32() -> None:
    big = np.full((4, 4), 1e6, np.float32)
    odd = np.eye(4, dtype=np.float32)
    odd[0, 1], odd[1, 0] = np.nan, np.inf
    normal = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    model = _model(
        [
            helper.make_node("MatMul", ["x", "big"], ["a"], name="huge"),
            helper.make_node("MatMul", ["x", "odd"], ["b"], name="nonfinite"),
            helper.make_node("MatMul", ["x", "normal"], ["c"], name="fine"),
        ],
        outputs=[_vi("a"), _vi("b"), _vi("c")],
        inits=[
            numpy_helper.from_array(big, "big"),
            numpy_helper.from_array(odd, "odd"),
            numpy_helper.from_array(normal, "normal"),
        ],
    )
    feeds = {"x": np.random.default_rng(3).uniform(0.5, 1, (1, 4)).astype(np.float32)}
    result = _convert_and_compare(model, "fp16", feeds)
    precision = {n.name: n.precision for n in result.report.nodes}
    assert precision["huge"] == "fp32"
    assert precision["fine"] != "fp32"


def test_unknown_domain_converts_without_calibration() -> None:
    model = _add_import(
        _model(
            [
                helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                helper.make_node("Foo", ["m"], ["y"], name="foo", domain="com.x"),
            ],
            inits=[numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")],
        )
    )
    result = mixprec.convert(model, "fp16", calibrate=False, check=False)
    foo = next(n for n in result.model.graph if n.op_type == "Foo")
    source = foo.inputs[0].producer() if foo.inputs[0] is not None else None
    assert source is not None
    if source.op_type == "Cast":  # MatMul ran low: Foo gets its float32 back
        assert source.attributes["to"].as_int() == ir.DataType.FLOAT
    else:
        assert source.op_type == "MatMul"


def test_check_input_pass_changes_nothing_on_a_sound_model() -> None:
    model = ir.from_proto(_conv_bn())
    before = ir.to_proto(model).SerializeToString()
    result = CheckInputPass()(model)
    assert not result.modified
    assert ir.to_proto(model).SerializeToString() == before
