"""mixprec's bf16 decisions as OpenVINO precision marks (``bf16-lists-openvino``): the
FP32 model, OpenVINO's bf16 hint, and the nodes mixprec keeps FP32 marked in the IR.

Real OpenVINO throughout. On a CPU without bf16 (AVX2 only) OpenVINO computes the hint in
f32: the marks are checked as written and read back, and the pair's results against ONNX
Runtime's FP32; which layers ran in bf16 is checked only where the CPU computes bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import assert_close, run_ort
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import DEFAULT_RTOL
from mixprec.io.runtime_fields import (
    FP32_NODES_KEY,
    HINTS_KEY,
    RUNTIME_KEY,
    RUNTIME_MODEL_KEY,
    fp32_nodes,
    runtime_fields_of,
)
from mixprec.optimize.candidates import select_candidates, skip_reason
from mixprec.optimize.metadata import save_marked
from mixprec.pipeline.marks import bf16_marked
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions
from mixprec.runtime.engines import ENGINES, run_model
from mixprec.runtime.ov_marks import marked_names, ops_of_nodes, runtime_layers

ov = pytest.importorskip("openvino")

_RNG = np.random.default_rng(0)


def _init(name: str, *shape: int, scale: float = 0.3) -> onnx.TensorProto:
    return numpy_helper.from_array((_RNG.standard_normal(shape) * scale).astype(np.float32), name)


def conv_bn_model() -> onnx.ModelProto:
    """Conv (with bias) -> BatchNormalization -> HardSigmoid -> Flatten -> MatMul ->
    Softmax: a Conv becomes several OpenVINO ops, the Softmax's op is named after the
    graph output."""
    bn = [
        numpy_helper.from_array(np.full(8, v, np.float32), n)
        for n, v in (("scale", 1.1), ("shift", 0.1), ("mean", 0.05), ("var", 0.9))
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"], name="bn0"
        ),
        helper.make_node("HardSigmoid", ["n"], ["h"], name="hsig"),
        helper.make_node("Flatten", ["h"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "w2"], ["m"], name="mm0"),
        helper.make_node("Softmax", ["m"], ["y"], name="soft"),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])],
        [_init("w", 8, 3, 3, 3), _init("b", 8), *bn, _init("w2", 512, 10, scale=0.05)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def constant_weights_model() -> onnx.ModelProto:
    """Three MatMuls whose weights are Constant nodes (no initializers), Relu between."""
    nodes = []
    for i, name in enumerate(("mm_a", "mm_keep", "mm_b")):
        weight = _init(f"w_{name}", 16, 16)
        constant = helper.make_node("Constant", [], [f"w_{name}"], name=f"c_{name}", value=weight)
        nodes.append(constant)
        src = "x" if i == 0 else f"r{i - 1}"
        nodes.append(helper.make_node("MatMul", [src, f"w_{name}"], [f"o{i}"], name=name))
        if i < 2:
            nodes.append(helper.make_node("Relu", [f"o{i}"], [f"r{i}"], name=f"relu{i}"))
    graph = helper.make_graph(
        nodes,
        "constant_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("o2", TensorProto.FLOAT, [4, 16])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def old_softmax_model() -> onnx.ModelProto:
    """A 4-D Softmax at opset 11 (axis 1 flattens the rest): bf16 upgrades the opset, which
    spells the old Softmax with reshapes around it, nodes the input did not have."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv0"),
        helper.make_node("Softmax", ["c"], ["y"], name="soft", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "old_softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
        [_init("w", 4, 3, 1, 1)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def _samples(model: onnx.ModelProto, n: int = 4) -> list[dict[str, np.ndarray]]:
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal(dims).astype(np.float32)} for _ in range(n)]


def _decisive_samples(model: onnx.ModelProto, n: int) -> list[dict[str, np.ndarray]]:
    """``n`` samples whose FP32 class is clear (the top two probabilities 0.02 apart, 35x
    the largest bf16 error seen on this model): the pair's plumbing is the point here, and
    a random model's near-tie flips under bf16 on one CPU and not on another."""
    pool = _samples(model, 8 * n)
    kept = []
    for feeds in pool:
        top2 = np.sort(run_ort(model, feeds)["y"].ravel())[-2:]
        if top2[1] - top2[0] >= 0.02:
            kept.append(feeds)
    assert len(kept) >= n, f"{len(kept)} of {len(pool)} samples decide their class"
    return kept[:n]


CASES = {
    "conv_bn": (conv_bn_model, {"exclude_nodes": ["hsig"]}),
    "constant_weights": (constant_weights_model, {"exclude_nodes": ["mm_keep"]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_marks_land_on_exactly_the_nodes_kept_fp32(tmp_path: Path, case: str) -> None:
    build, options = CASES[case]
    model = build()
    proto, report = bf16_marked(model, _samples(model), **options)
    kept = {n.name for n in report.nodes if n.precision == "fp32" and n.op_type != "Constant"}
    low = {n.name for n in report.nodes if n.precision == "low"}
    assert set(fp32_nodes(proto) or []) == kept and set(options["exclude_nodes"]) <= kept
    assert low  # the rest goes to bf16: OpenVINO's hint lowers it
    xml = save_marked(proto, tmp_path / "out.onnx")
    assert xml == tmp_path / "out.xml" and xml.with_suffix(".bin").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files
    modes = {(tmp_path / f"out.{ext}").stat().st_mode & 0o777 for ext in ("onnx", "xml", "bin")}
    assert len(modes) == 1  # the IR follows the umask, as the model does
    core = ov.Core()
    onnx.save(proto, tmp_path / "plain.onnx")
    read = core.read_model(str(tmp_path / "plain.onnx"))
    ops = ops_of_nodes(read, proto.graph)
    expected = {op.get_friendly_name() for name in kept for op in ops[name]}
    unmarked = {op.get_friendly_name() for name in low for op in ops[name]}
    marked = marked_names(core.read_model(str(xml)))
    assert marked == expected and marked  # every op of a kept node, nothing else
    assert not marked & unmarked and unmarked
    fields = runtime_fields_of(onnx.load(tmp_path / "out.onnx"))  # written directly: stamped too
    assert fields[RUNTIME_MODEL_KEY] == "out.xml" and fields[RUNTIME_KEY] == "openvino"
    assert json.loads(fields[HINTS_KEY]) == {"INFERENCE_PRECISION_HINT": "bf16"}


@pytest.mark.parametrize("build", [conv_bn_model, constant_weights_model, old_softmax_model])
def test_every_op_openvino_makes_belongs_to_one_named_node(tmp_path: Path, build) -> None:
    model = build()
    proto, _ = bf16_marked(model, _samples(model))
    assert all(node.name for node in proto.graph.node)  # added nodes are named too
    onnx.save(proto, tmp_path / "m.onnx")
    read = ov.Core().read_model(str(tmp_path / "m.onnx"))
    owners = [
        op.get_friendly_name() for ops in ops_of_nodes(read, proto.graph).values() for op in ops
    ]
    data = {"Constant", "Parameter", "Result"}
    made = {
        op.get_friendly_name() for op in read.get_ordered_ops() if op.get_type_name() not in data
    }
    assert sorted(owners) == sorted(made)  # each op once


def test_a_conv_maps_to_all_its_ops_and_an_output_to_its_tensor_name() -> None:
    model = conv_bn_model()
    read = ov.Core().read_model(model.SerializeToString(), ov.Tensor(np.empty(0, np.uint8)))
    ops = ops_of_nodes(read, model.graph)
    conv = {op.get_type_name() for op in ops["conv0"]}
    assert {"Convolution", "Add"} <= conv and "Constant" not in conv
    assert [op.get_type_name() for op in ops["soft"]] == ["Softmax"]  # named "y" by OpenVINO
    assert [op.get_type_name() for op in ops["hsig"]] == ["HardSigmoid"]


def _optimized_pair(tmp_path: Path, monkeypatch) -> tuple[Path, onnx.ModelProto]:
    """The candidate run through optimize (told this CPU computes bf16, so that it is not
    skipped: OpenVINO then computes the hint in f32 here) and saved."""
    model = conv_bn_model()
    original = tmp_path / "m.onnx"
    onnx.save(model, original)
    monkeypatch.setattr(type(ENGINES["openvino"]), "computes_bf16", lambda self: True)
    # 8 samples: too few rows to confirm a bf16 pass; the pair is the point here
    result = mixprec.optimize(
        str(original),
        _decisive_samples(model, 8),
        candidates=["bf16-lists-openvino"],
        time_budget=4,
        accept_unconfirmed=True,
    )
    assert result.winner == "bf16-lists-openvino", result.format_table()
    out = tmp_path / "out.onnx"
    assert result.save(out) == [out, tmp_path / "out.xml", tmp_path / "out.bin"]
    monkeypatch.undo()
    return out, model


def test_the_pair_runs_as_its_metadata_says(tmp_path: Path, monkeypatch) -> None:
    out, model = _optimized_pair(tmp_path, monkeypatch)
    fields = runtime_fields_of(onnx.load(out))
    assert fields[RUNTIME_KEY] == "openvino" and fields[RUNTIME_MODEL_KEY] == "out.xml"
    assert json.loads(fields[HINTS_KEY]) == {"INFERENCE_PRECISION_HINT": "bf16"}
    # BatchNormalization's scale 1.1 is not a bf16 number (a rule keeps it FP32, and its
    # FP32 path downstream); the Softmax keeps its probabilities' digits
    assert json.loads(fields[FP32_NODES_KEY]) == ["bn0", "flat", "hsig", "soft"]
    assert {i.name for i in onnx.load(out).graph.initializer} >= {"w", "w2"}  # FP32 weights
    assert onnx.load(out).graph.initializer[0].data_type == TensorProto.FLOAT

    def no_front_end(path: str) -> None:
        raise AssertionError("the ONNX front end ran: the IR was not read")

    monkeypatch.setattr("mixprec.runtime.openvino._read_onnx", no_front_end)
    engine = ENGINES["openvino"]
    session = engine.session(out, RuntimeOptions("openvino", precision="bf16"))
    written = marked_names(ov.Core().read_model(str(tmp_path / "out.xml")))
    assert marked_names(session.model) == written and "y" in written  # read from the IR
    tolerance = "bf16" if engine.computes_bf16() else "fp32"
    samples = _decisive_samples(model, 2)
    for feeds in samples:
        ref = run_ort(model, feeds)["y"]
        assert_close(ref, run_model(out, feeds)["y"], tolerance, name="y")
    report = mixprec.validate(str(tmp_path / "m.onnx"), str(out), inputs=samples)
    assert report.passed and report.kind == "openvino", report.format_table()
    # held to bf16's tolerance: its hint lowers FP32 layers (FP32's failed on a bf16 CPU)
    assert report.rtol == DEFAULT_RTOL["bfloat16"], report.rtol


def test_a_missing_ir_is_one_line(tmp_path: Path, monkeypatch) -> None:
    out, model = _optimized_pair(tmp_path, monkeypatch)
    (tmp_path / "out.bin").unlink()
    feeds = _samples(model, 1)[0]
    with pytest.raises(RuntimeLoadError) as caught:
        run_model(out, feeds)
    message = str(caught.value)
    assert "\n" not in message and "out.bin is missing" in message
    with pytest.raises(MixprecError, match=r"out\.bin is missing"):
        mixprec.validate(str(tmp_path / "m.onnx"), str(out), inputs=[feeds])


def test_the_candidate_is_skipped_where_the_cpu_has_no_bf16() -> None:
    (candidate,) = select_candidates(["bf16-lists-openvino"])
    assert candidate.runtime == "openvino" and candidate.precision == "bf16"
    if ENGINES["openvino"].computes_bf16():
        assert skip_reason(candidate) is None
    else:
        assert skip_reason(candidate) == "this CPU does not compute bf16"


_COMPUTE = {"FullyConnected", "MatMul", "Convolution"}


@pytest.mark.skipif(
    not ENGINES["openvino"].computes_bf16(),
    reason="this CPU does not compute bf16 (no avx512_bf16/AMX): OpenVINO runs the hint in f32",
)
def test_marked_layers_run_f32_and_the_rest_bf16(tmp_path: Path) -> None:
    """From the compiled model's runtime graph: a layer holding a marked op ran in f32, a
    compute layer holding only unmarked ops in bf16."""
    model = constant_weights_model()
    proto, _ = bf16_marked(model, _samples(model), exclude_nodes=["mm_keep"])
    xml = save_marked(proto, tmp_path / "out.onnx")
    core = ov.Core()
    read = core.read_model(str(xml))
    marked = marked_names(read)
    config = ENGINES["openvino"].config(RuntimeOptions("openvino", precision="bf16"), read)
    compiled = core.compile_model(read, "CPU", config)
    layers = [la for la in runtime_layers(compiled) if la.type in _COMPUTE]
    kept = [la for la in layers if set(la.originals) & marked]
    lowered = [la for la in layers if la.originals and not set(la.originals) & marked]
    assert kept and lowered, layers
    assert all(la.precision == "f32" for la in kept), kept
    assert all(la.precision == "bf16" for la in lowered), lowered
