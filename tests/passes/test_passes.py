"""Per-pass tests on tiny graphs: op sequences, cast counts, reasons, exact ``modified``."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import mixprec
from helpers import assert_close, run_ort
from mixprec.core.config import ListChanges, resolve_policy
from mixprec.core.policy import DEFAULT_LISTS, OpClass, default_policy
from mixprec.core.schema import slot_info
from mixprec.passes.fold import FoldBatchNormPass
from mixprec.precision.paint import PaintPass, Precision
from mixprec.precision.rewrite import ApplyPrecisionPass, RemoveRedundantCastsPass

FP16 = ir.DataType.FLOAT16


def _model(
    text: str, *, seed: int = 0, scale: float = 0.1, **arrays: np.ndarray
) -> onnx.ModelProto:
    """Parse ``text`` and fill its declared initializers (seeded normal * scale, or given)."""
    proto = onnx.parser.parse_model(text)
    rng = np.random.default_rng(seed)
    produced = {o for n in proto.graph.node for o in n.output}
    declared = [vi for vi in proto.graph.value_info if vi.name not in produced]
    for vi in declared:
        dims = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        arr = arrays.get(vi.name)
        if arr is None:
            arr = rng.standard_normal(dims) * scale
        proto.graph.initializer.append(
            onnx.numpy_helper.from_array(np.asarray(arr, np.float32), vi.name)
        )
    keep = [vi for vi in proto.graph.value_info if vi.name in produced]
    del proto.graph.value_info[:]
    proto.graph.value_info.extend(keep)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _ir(text: str | onnx.ModelProto) -> ir.Model:
    proto = _model(text) if isinstance(text, str) else text
    model = ir.from_proto(onnx.shape_inference.infer_shapes(proto))
    ir.passes.common.NameFixPass()(model)
    return model


def _ops(model: ir.Model | onnx.ModelProto) -> list[str]:
    graph = model.graph
    return (
        [n.op_type for n in graph.node]
        if isinstance(model, onnx.ModelProto)
        else [n.op_type for n in graph]
    )


def _by_name(result, name: str):
    return next(n for n in result.report.nodes if n.name == name)


def _full_check(proto: onnx.ModelProto) -> None:
    onnx.checker.check_model(proto, full_check=True)
    onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)


CHAIN = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y) <float[4,4,3,3] w1, float[4,4,3,3] w2> {
    c1 = Conv <pads = [1,1,1,1]> (x, w1)
    e = Exp (c1)
    a = Add (e, c1)
    r = Relu (a)
    y = Conv <pads = [1,1,1,1]> (r, w2)
}
"""


def _chain_model() -> onnx.ModelProto:
    return _model(CHAIN)


# --- policy ---------------------------------------------------------------------------


def test_default_lists_are_disjoint_and_differ_per_dtype():
    for lists in DEFAULT_LISTS.values():
        seen: set[str] = set()
        for ops in lists.values():
            assert not (seen & ops), seen & ops
            seen |= ops
    assert "Exp" in DEFAULT_LISTS["float16"][OpClass.DENY]
    assert "Exp" in DEFAULT_LISTS["bfloat16"][OpClass.INFER]
    assert "ReduceMean" in DEFAULT_LISTS["bfloat16"][OpClass.DENY]


def test_policy_add_moves_op_and_errors_are_clear():
    policy = default_policy("fp16").with_changes({OpClass.ALLOW: ["Exp"]})
    assert policy.op_class("Exp") is OpClass.ALLOW
    assert "Exp" not in policy.lists[OpClass.DENY]
    with pytest.raises(mixprec.MixprecError, match="not in it"):
        default_policy("fp16").with_changes(remove={OpClass.ALLOW: ["Relu"]})
    with pytest.raises(mixprec.MixprecError, match="unknown op type 'Convv'"):
        default_policy("fp16").with_changes({OpClass.ALLOW: ["Convv"]})
    with pytest.raises(mixprec.MixprecError, match="unknown target dtype 'fp8'"):
        default_policy("fp8")
    with pytest.raises(mixprec.MixprecError, match=r"'int8' is not accepted here.*quantize"):
        default_policy("int8")


def test_configuration_priority_api_over_env_over_default():
    none = ListChanges(add={}, remove={})
    env = {"MIXPREC_DTYPE": "bf16", "MIXPREC_DENYLIST_ADD": "Relu"}
    from_env = resolve_policy(None, none, exclude_nodes=None, force_all=None, env=env)
    assert from_env.target == "bfloat16"
    assert from_env.op_class("Relu") is OpClass.DENY
    explicit = resolve_policy(
        "fp16",
        ListChanges(add={OpClass.DENY: []}, remove={}),
        exclude_nodes=None,
        force_all=None,
        env=env,
    )
    assert explicit.target == "float16"
    assert explicit.op_class("Relu") is OpClass.CLEAR  # API value [] beats the env list
    with pytest.raises(mixprec.MixprecError, match="MIXPREC_FORCE_ALL"):
        resolve_policy(
            None, none, exclude_nodes=None, force_all=None, env={"MIXPREC_FORCE_ALL": "maybe"}
        )
    with pytest.raises(mixprec.MixprecError, match="unknown environment variable"):
        resolve_policy(
            None, none, exclude_nodes=None, force_all=None, env={"MIXPREC_DENYLIST": "Exp"}
        )


# --- schema -----------------------------------------------------------------------------


def test_resize_scales_stay_float32():
    model = _ir("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,4,4] x) => (float[1,2,8,8] y) {
        s = Constant <value = float[4] {1.0, 1.0, 2.0, 2.0}> ()
        y = Resize <mode = "nearest"> (x, , s)
    }
    """)
    node = next(n for n in model.graph if n.op_type == "Resize")
    info = slot_info(node, 17, FP16, frozenset({1, 2}))
    assert info.inputs == {0}
    assert info.outputs == {0}
    assert info.fixed_inputs == {2}


def test_schema_without_target_type_stays_fp32():
    # Conv-11 (opset 17) admits float16 but not bfloat16.
    model = _ir(_chain_model())
    conv = next(n for n in model.graph if n.op_type == "Conv")
    assert slot_info(conv, 17, FP16).convertible
    info = slot_info(conv, 17, ir.DataType.BFLOAT16)
    assert not info.convertible
    assert "admits no bfloat16" in info.reason


# --- painting ---------------------------------------------------------------------------


def test_paint_steps_and_reasons():
    model = _ir(_chain_model())
    result = PaintPass(default_policy("fp16"))(model)
    assert result.modified is False
    by_op = {n.op_type + str(i): result.decisions[n] for i, n in enumerate(model.graph)}
    steps = [(k, d.precision, d.step) for k, d in by_op.items()]
    assert steps == [
        ("Conv0", Precision.LOW, "allow"),
        ("Exp1", Precision.FP32, "deny"),
        ("Add2", Precision.FP32, "deny"),
        ("Relu3", Precision.FP32, "deny"),
        ("Conv4", Precision.LOW, "allow"),
    ]
    assert "downstream of Exp" in by_op["Add2"].reason


def test_infer_follows_low_and_exclusion_by_regex():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y) {
        m = MatMul (x, w)
        s = Sigmoid (m)
        y = Add (s, m)
    }
    """
    model = _ir(text)
    decisions = PaintPass(default_policy("fp16"))(model).decisions
    assert [decisions[n].step for n in model.graph] == ["allow", "infer", "infer"]
    model.graph.node(0).name = "encoder/dense/MatMul"
    excluded = default_policy("fp16").with_changes(exclude_nodes=["encoder/.*/MatMul"])
    decisions = PaintPass(excluded)(model).decisions
    first = decisions[model.graph.node(0)]
    assert first.precision is Precision.FP32
    assert "excluded" in first.reason
    # Nothing low upstream: INFER nodes stay FP32.
    assert all(d.precision is Precision.FP32 for d in decisions.values())


def test_range_block_from_calibration_and_constants():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y) {
        big = Constant <value = float[1] {100000.0}> ()
        m = MatMul (x, w)
        z = Mul (m, big)
        y = MatMul (z, w)
    }
    """
    result = PaintPass(default_policy("fp16"), absmax={"z": 5e5})(_ir(text))
    reasons = {n.op_type + (n.outputs[0].name or ""): d for n, d in result.decisions.items()}
    assert reasons["Mulz"].step == "range"
    assert "holds |x|=1e+05" in reasons["Mulz"].reason
    assert reasons["MatMuly"].step == "range"
    assert "reached |x|=5e+05" in reasons["MatMuly"].reason
    assert reasons["MatMulm"].precision is Precision.LOW


# --- rewriting --------------------------------------------------------------------------


def test_one_cast_per_tensor_shared_by_consumers():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] a, float[2,8] b, float[2,8] c) <float[8,8] w> {
        a = MatMul (x, w)
        b = MatMul (x, w)
        c = MatMul (x, w)
    }
    """
    model = _model(text, w=np.eye(8))
    result = mixprec.convert(model, "fp16", calibrate=False)
    proto = result.model_proto
    casts = [n for n in proto.graph.node if n.op_type == "Cast"]
    # One cast for x (shared by 3 MatMuls) and one per output back to float32.
    assert len(casts) == 4
    x_casts = [c for c in casts if c.input[0] == "x"]
    assert len(x_casts) == 1
    assert sum(1 for n in proto.graph.node if x_casts[0].output[0] in n.input) == 3
    # The shared weight is stored once, in float16, not per consumer.
    assert len(proto.graph.initializer) == 1
    assert proto.graph.initializer[0].data_type == onnx.TensorProto.FLOAT16
    assert [o.name for o in proto.graph.output] == ["a", "b", "c"]
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in proto.graph.output)
    _full_check(proto)


def test_weight_read_by_both_precisions_small_copy_large_cast():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8,8] x) => (float[8,8] y, float[8,8] z) <float[8,8] w> {
        y = MatMul (x, w)
        z = Add (x, w)
    }
    """
    model = _model(text, w=np.full((8, 8), 0.5))
    small = mixprec.convert(model, "fp16", calibrate=False)
    assert small.report.weights["duplicated"] == 1
    types = sorted(t.data_type for t in small.model_proto.graph.initializer)
    assert types == [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16]
    work = _ir(model)
    paint = PaintPass(default_policy("fp16"))(work)
    applied = ApplyPrecisionPass(
        default_policy("fp16"), paint.decisions, paint.slots, small_weight_bytes=16
    )(work)
    assert applied.modified
    assert applied.weights.cast_at_runtime == 1
    assert applied.weights.duplicated == 0
    w_casts = [n for n in work.graph if n.op_type == "Cast" and n.inputs[0].name == "w"]
    assert len(w_casts) == 1


def test_out_of_range_constant_keeps_consumer_fp32_and_is_not_clipped():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y) {
        m = MatMul (x, w)
        big = Constant <value = float[1] {1e8}> ()
        y = Div (m, big)
    }
    """
    result = mixprec.convert(_model(text), "fp16", calibrate=False)
    div = next(n for n in result.report.nodes if n.op_type == "Div")
    assert div.precision == "fp32" and div.step == "range"
    consts = [n for n in result.model_proto.graph.node if n.op_type == "Constant"]
    assert onnx.numpy_helper.to_array(consts[0].attribute[0].t).item() == 1e8
    assert result.report.weights["overflowed"] == 0


def test_cast_to_float_inside_low_region_is_retargeted():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w, int64[2,8] k) => (float[2,8] y) {
        m = MatMul (x, w)
        kf = Cast <to = 1> (k)
        s = Add (m, kf)
        y = MatMul (s, w)
    }
    """
    result = mixprec.convert(_model(text), "fp16", calibrate=False)
    proto = result.model_proto
    cast_k = next(n for n in proto.graph.node if n.op_type == "Cast" and n.input[0] == "k")
    assert cast_k.attribute[0].i == onnx.TensorProto.FLOAT16
    _full_check(proto)
    feeds = {
        "x": np.random.default_rng(1).random((2, 8), dtype=np.float32),
        "w": np.random.default_rng(2).random((8, 8), dtype=np.float32),
        "k": np.arange(16, dtype=np.int64).reshape(2, 8),
    }
    assert_close(run_ort(_model(text), feeds)["y"], run_ort(proto, feeds)["y"], "float16")


def test_remove_redundant_casts_pass_modified_is_exact():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4] x, int64[4] i) => (float[4] y, int32[4] j) {
        h = Cast <to = 10> (x)
        y = Cast <to = 1> (h)
        a = Cast <to = 6> (i)
        j = Identity (a)
    }
    """
    model = _ir(text)
    # y is a graph output: the chain must stay (its name is the interface).
    assert RemoveRedundantCastsPass()(model).modified is False
    text2 = text.replace("y = Cast <to = 1> (h)", "y0 = Cast <to = 1> (h)\n y = Relu (y0)")
    model = _ir(text2)
    result = RemoveRedundantCastsPass()(model)
    assert result.modified is True
    assert _ops(model) == ["Relu", "Cast", "Identity"]  # both float casts gone, int cast kept
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.inputs[0] is model.graph.inputs[0]
    assert RemoveRedundantCastsPass()(model).modified is False


def test_keep_io_types_false_changes_interface():
    result = mixprec.convert(_chain_model(), "fp16", calibrate=False, keep_io_types=False)
    proto = result.model_proto
    assert proto.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert proto.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    _full_check(proto)


def test_convert_does_not_mutate_inputs():
    model = _chain_model()
    before = model.SerializeToString()
    mixprec.convert(model, "fp16", calibrate=False)
    assert model.SerializeToString() == before
    ir_model = ir.from_proto(model)
    text_before = str(ir_model)
    result = mixprec.convert(ir_model, "fp16", calibrate=False)
    assert str(ir_model) == text_before
    assert isinstance(result.converted, ir.Model)


def test_chain_numeric_and_valid():
    model = _chain_model()
    x = np.random.default_rng(3).random((1, 4, 8, 8), dtype=np.float32)
    # Without calibration the DENY op (Exp) and what it feeds stay FP32.
    plain = mixprec.convert(model, "fp16", calibrate=False).model_proto
    _full_check(plain)
    assert_close(run_ort(model, {"x": x})["y"], run_ort(plain, {"x": x})["y"], "float16")
    ops = _ops(plain)
    assert ops.count("Cast") == 4  # x->fp16, c1->fp32, r->fp16, y->fp32
    assert ops.index("Exp") > ops.index("Cast")
    # With calibration, Exp's measured range is safe: it runs in fp16 and casts drop to 2.
    result = mixprec.convert(model, "fp16", calibration_data={"x": x})
    calibrated = result.model_proto
    _full_check(calibrated)
    assert _ops(calibrated).count("Cast") == 2
    exp = next(n for n in result.report.nodes if n.op_type == "Exp")
    assert exp.precision == "low" and "calibrated safe range" in exp.reason
    assert_close(run_ort(model, {"x": x})["y"], run_ort(calibrated, {"x": x})["y"], "float16")


def test_range_checked_deny_op_stays_fp32_when_its_range_is_unsafe():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) <float[8,8] w> {
        m = MatMul (x, w)
        e = Exp (m)
        y = MatMul (e, w)
    }
    """
    model = _model(text, w=np.full((8, 8), 1.5))
    x = np.full((2, 8), 1.0, np.float32)  # m = 12 -> exp(12) = 1.6e5 > fp16 max
    result = mixprec.convert(model, "fp16", calibration_data={"x": x})
    exp = next(n for n in result.report.nodes if n.op_type == "Exp")
    assert exp.precision == "fp32" and exp.step == "range", exp
    assert np.isfinite(run_ort(result.model_proto, {"x": x})["y"]).all()


def test_embedding_region_fed_by_constants_goes_low():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[2,5] ids) => (float[2,5,8] y) <float[50,8] table, float[8,8] w, float[8] s,
                                            float[8] b> {
        e = Gather (table, ids)
        n = LayerNormalization <axis = -1> (e, s, b)
        y = MatMul (n, w)
    }
    """
    model = _model(text, s=np.ones(8), b=np.zeros(8))
    ids = np.arange(10, dtype=np.int64).reshape(2, 5)
    result = mixprec.convert(model, "fp16", calibration_data={"ids": ids})
    proto = result.model_proto
    _full_check(proto)
    precisions = {n.op_type: (n.precision, n.step) for n in result.report.nodes}
    assert precisions["Gather"] == ("low", "weights"), precisions
    assert precisions["LayerNormalization"] == ("low", "weights"), precisions
    # The table is stored in fp16 and the only cast is the output one.
    table = next(t for t in proto.graph.initializer if t.name == "table")
    assert table.data_type == onnx.TensorProto.FLOAT16
    assert _ops(proto).count("Cast") == 1
    assert_close(run_ort(model, {"ids": ids})["y"], run_ort(proto, {"ids": ids})["y"], "float16")


def test_shape_only_ops_take_any_dtype_without_casts():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y, int64[2] s) {
        m = MatMul (x, w)
        s = Shape (m)
        y = Relu (m)
    }
    """
    result = mixprec.convert(_model(text), "fp16", calibrate=False)
    proto = result.model_proto
    _full_check(proto)
    shape = next(n for n in proto.graph.node if n.op_type == "Shape")
    producer = next(n for n in proto.graph.node if shape.input[0] in n.output)
    assert producer.op_type == "MatMul"  # no Cast in between
    assert all(n.op_type != "Shape" for n in result.report.nodes)


# --- BatchNormalization folding ---------------------------------------------------------


@pytest.mark.parametrize("producer", ["Conv", "ConvTranspose", "Gemm"])
def test_fold_batchnorm_numeric(producer):
    rng = np.random.default_rng(4)
    if producer == "Gemm":
        text = """
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3,6] x) => (float[3,4] y) <float[4,6] w, float[4] b, float[4] s, float[4] t,
                                            float[4] m, float[4] v> {
            z = Gemm <transB = 1, beta = 0.5> (x, w, b)
            y = BatchNormalization (z, s, t, m, v)
        }
        """
        shapes = {"w": (4, 6), "x": (3, 6)}
    else:
        conv = "Conv <pads = [1,1,1,1]>" if producer == "Conv" else "ConvTranspose"
        wshape = "[4,2,3,3]" if producer == "Conv" else "[2,4,3,3]"
        yshape = "[1,4,5,5]" if producer == "Conv" else "[1,4,7,7]"
        text = f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1,2,5,5] x) => (float{yshape} y) <float{wshape} w, float[4] b, float[4] s,
                                                   float[4] t, float[4] m, float[4] v> {{
            z = {conv} (x, w, b)
            y = BatchNormalization (z, s, t, m, v)
        }}
        """
        shapes = {"w": (4, 2, 3, 3) if producer == "Conv" else (2, 4, 3, 3), "x": (1, 2, 5, 5)}
    model = _model(text, v=np.ones(4))
    values = {
        "w": rng.standard_normal(shapes["w"]),
        "b": rng.standard_normal(4),
        "s": rng.uniform(0.5, 1.5, 4),
        "t": rng.standard_normal(4),
        "m": rng.standard_normal(4),
        "v": np.array([1e8, 0.5, 2.0, 1.0]),
    }
    del model.graph.initializer[:]
    for name, arr in values.items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(arr.astype(np.float32), name))
    work = ir.from_proto(model)
    result = FoldBatchNormPass()(work)
    assert result.modified and len(result.folded) == 1
    assert _ops(work) == [producer]
    assert FoldBatchNormPass()(work).modified is False
    folded = ir.to_proto(work)
    onnx.checker.check_model(folded, full_check=True)
    feeds = {"x": rng.random(shapes["x"], dtype=np.float32)}
    assert_close(run_ort(model, feeds)["y"], run_ort(folded, feeds)["y"], "float32")


def test_fold_skipped_when_conv_output_shared():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,2,5,5] x) => (float[1,2,5,5] y, float[1,2,5,5] z)
      <float[2,2,1,1] w, float[2] s, float[2] t, float[2] m, float[2] v> {
        z = Conv (x, w)
        y = BatchNormalization (z, s, t, m, v)
    }
    """
    result = FoldBatchNormPass()(ir.from_proto(_model(text)))
    assert result.modified is False
    assert "other consumers" in next(iter(result.skipped.values()))


# --- subgraphs and functions ------------------------------------------------------------

IF_MODEL = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,8] x, bool c) => (float[2,8] y) <float[8,8] w> {
    h = MatMul (x, w)
    y = If (c) <
        then_branch = t () => (float[2,8] o1) {
            k = Constant <value = float[8,8] {
                0.1,0,0,0,0,0,0,0, 0,0.1,0,0,0,0,0,0, 0,0,0.1,0,0,0,0,0, 0,0,0,0.1,0,0,0,0,
                0,0,0,0,0.1,0,0,0, 0,0,0,0,0,0.1,0,0, 0,0,0,0,0,0,0.1,0, 0,0,0,0,0,0,0,0.1}> ()
            m1 = MatMul (h, k)
            o1 = Relu (m1)
        },
        else_branch = e () => (float[2,8] o2) {
            o2 = Sigmoid (h)
        }
    >
}
"""


def test_if_subgraph_converted_consistently():
    model = _model(IF_MODEL, scale=1.0)
    result = mixprec.convert(model, "fp16", calibrate=False)
    proto = result.model_proto
    _full_check(proto)
    inner = {n.op_type: n for n in result.report.nodes}
    assert inner["MatMul"].precision == "low"
    if_node = next(n for n in proto.graph.node if n.op_type == "If")
    then = next(a.g for a in if_node.attribute if a.name == "then_branch")
    const = next(n for n in then.node if n.op_type == "Constant")
    assert const.attribute[0].t.data_type == onnx.TensorProto.FLOAT16
    for cond in (True, False):
        feeds = {
            "x": np.random.default_rng(6).random((2, 8), dtype=np.float32),
            "c": np.array(cond),
        }
        assert_close(run_ort(model, feeds)["y"], run_ort(proto, feeds)["y"], "float16")


def test_loop_carried_state_keeps_its_dtype():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, int64 n) => (float[2,8] y) <float[8,8] w> {
        t = Constant <value = bool {1}> ()
        y = Loop (n, t, x) <
            body = b (int64 i, bool cin, float[2,8] s) => (bool cout, float[2,8] s2) {
                cout = Identity (cin)
                m = MatMul (s, w)
                s2 = Tanh (m)
            }
        >
    }
    """
    model = _model(text, scale=0.3)
    result = mixprec.convert(model, "fp16", calibrate=False)
    proto = result.model_proto
    _full_check(proto)
    feeds = {
        "x": np.random.default_rng(8).random((2, 8), dtype=np.float32),
        "n": np.array(3, dtype=np.int64),
    }
    assert_close(run_ort(model, feeds)["y"], run_ort(proto, feeds)["y"], "float16")
    assert {n.op_type: n.precision for n in result.report.nodes}["MatMul"] == "low"


def test_model_local_function_is_inlined_and_converted():
    text = """
    <ir_version: 8, opset_import: ["" : 17, "local" : 1]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y) {
        y = local.Dense (x, w)
    }
    <domain: "local", opset_import: ["" : 17]>
    Dense (a, b) => (c) {
        m = MatMul (a, b)
        c = Relu (m)
    }
    """
    model = _model(text)
    result = mixprec.convert(model, "fp16", calibrate=False)
    assert any("inlined 1 model-local function" in note for note in result.report.notes)
    assert {n.op_type: n.precision for n in result.report.nodes} == {"MatMul": "low", "Relu": "low"}
    _full_check(result.model_proto)


def test_public_surface_is_pinned():
    assert sorted(mixprec.__all__) == sorted(
        [
            "DEFAULT_LISTS",
            "RULES",
            "STAGES",
            "ConversionResult",
            "ConvertConfig",
            "EmulateLowPrecisionPass",
            "EmulateLowPrecisionResult",
            "InternalError",
            "MixprecError",
            "NodeReport",
            "OpClass",
            "OpRule",
            "Pipeline",
            "Policy",
            "QuantizeConfig",
            "Report",
            "TuneResult",
            "ValidationReport",
            "convert",
            "default_policy",
            "inspect",
            "quantize",
            "register_rule",
            "tune",
            "validate",
        ]
    )


def test_streamed_save_writes_the_same_model(tmp_path):
    """Large initializers are written one at a time; the file is the same model."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,256] x) => (float[4,256] y) <float[256,256] w1, float[256,256] w2, float[256] b> {
        h = MatMul (x, w1)
        a = Add (h, b)
        y = MatMul (a, w2)
    }
    """
    model = _model(text)
    result = mixprec.convert(model, "fp16", calibrate=False)
    path = tmp_path / "out.onnx"
    from mixprec.io.models import _write_streaming

    _write_streaming(result.model, str(path), min_bytes=1024)  # w1, w2 streamed; b inline
    written = onnx.load(path)
    expected = result.model_proto
    onnx.checker.check_model(written, full_check=True)
    assert [n.SerializeToString() for n in written.graph.node] == [
        n.SerializeToString() for n in expected.graph.node
    ]
    inits = {t.name: t.SerializeToString() for t in written.graph.initializer}
    assert inits == {t.name: t.SerializeToString() for t in expected.graph.initializer}
    assert list(result.model.graph.initializers) == [t.name for t in expected.graph.initializer]
    x = np.random.default_rng(9).random((4, 256), dtype=np.float32)
    np.testing.assert_array_equal(run_ort(written, {"x": x})["y"], run_ort(expected, {"x": x})["y"])


def test_if_outputs_follow_their_branches_and_consumers():
    """A PyTorch-style conditional squeeze between two MatMuls stays in low precision."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[1,8] x, bool c) => (float[8] y) <float[8,8] w, float[8,8] w2> {
        h = MatMul (x, w)
        r = Relu (h)
        s = If (c) <
            then_branch = t () => (float[8] o1) {
                ax = Constant <value = int64[1] {0}> ()
                o1 = Squeeze (r, ax)
            },
            else_branch = e () => (float[8] o2) {
                ax2 = Constant <value = int64[1] {0}> ()
                o2 = Squeeze (r, ax2)
            }
        >
        y = MatMul (s, w2)
    }
    """
    model = _model(text, scale=0.5)
    result = mixprec.convert(model, "fp16", calibrate=False)
    proto = result.model_proto
    _full_check(proto)
    by_op = {n.op_type: n.precision for n in result.report.nodes}
    assert by_op["If"] == "low" and by_op["Squeeze"] == "low", result.report.nodes
    assert _ops(proto).count("Cast") == 2  # x in, y out: none around the If
    if_node = next(n for n in proto.graph.node if n.op_type == "If")
    for attr in if_node.attribute:
        assert attr.g.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
        assert all(n.op_type != "Cast" for n in attr.g.node)
    for cond in (True, False):
        feeds = {
            "x": np.random.default_rng(11).random((1, 8), dtype=np.float32),
            "c": np.array(cond),
        }
        assert_close(run_ort(model, feeds)["y"], run_ort(proto, feeds)["y"], "float16")


def test_no_value_info_added_and_existing_annotations_retyped():
    model = _chain_model()
    assert not model.graph.value_info
    out = mixprec.convert(model, "fp16", calibrate=False).model_proto
    assert [v.name for v in out.graph.value_info] == []
    annotated = onnx.shape_inference.infer_shapes(model)  # every intermediate annotated
    out = mixprec.convert(annotated, "fp16", calibrate=False).model_proto
    types = {v.name: v.type.tensor_type.elem_type for v in out.graph.value_info}
    assert types["c1"] == onnx.TensorProto.FLOAT16  # Conv output, now low precision
    assert types["e"] == onnx.TensorProto.FLOAT  # Exp stays FP32 without calibration
    _full_check(out)


def test_model_with_external_data_converts_with_calibration(tmp_path):
    model = _chain_model()
    path = tmp_path / "chain.onnx"
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(model)  # onnx.save moves the tensors of the proto it saves
    onnx.save(
        on_disk,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="chain.data",
        size_threshold=0,
    )
    x = np.random.default_rng(12).random((1, 4, 8, 8), dtype=np.float32)
    result = mixprec.convert(path, "fp16", calibration_data={"x": x})
    out = tmp_path / "out.onnx"
    result.save(out, external_data=True)
    assert (tmp_path / "out.onnx.data").exists()
    onnx.checker.check_model(str(out), full_check=True)
    assert_close(run_ort(model, {"x": x})["y"], run_ort(str(out), {"x": x})["y"], "float16")
    again = mixprec.convert(out, "fp16", calibration_data={"x": x})  # already fp16: left alone
    assert any("already holds float16" in n for n in again.report.notes)
