"""Per-pass tests on tiny graphs: the pass (or the painter and the apply pass) alone, then
op sequences, cast counts, reasons, exact ``modified``; compositions: tests/pipeline."""

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
from mixprec.precision.paint import PaintPass, Precision, decision_of, painted
from mixprec.precision.rewrite import ApplyPrecisionPass, RemoveRedundantCastsPass
from text_models import chain_model, filled_model, full_check, ir_model, op_list

FP16 = ir.DataType.FLOAT16


def paint_apply(
    model: onnx.ModelProto, **apply_options: object
) -> tuple[ir.Model, ir.passes.PassResult]:
    """The annotate and apply passes alone (no calibration: lists, rules and constants):
    the painted, rewritten model and the ApplyPrecisionPass result."""
    work = ir_model(model)
    policy = default_policy("fp16")
    PaintPass(policy)(work)
    applied = ApplyPrecisionPass(policy, **apply_options)(work)  # type: ignore[arg-type]
    return work, applied


def decisions(model: ir.Model) -> dict[str, tuple[str, str]]:
    """(precision, step) of every painted node by op type (last one wins)."""
    return {n.op_type: (d.precision.value, d.step) for n, d in painted(model)}


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
    model = ir_model("""
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
    model = ir_model(chain_model())
    conv = next(n for n in model.graph if n.op_type == "Conv")
    assert slot_info(conv, 17, FP16).convertible
    info = slot_info(conv, 17, ir.DataType.BFLOAT16)
    assert not info.convertible
    assert "admits no bfloat16" in info.reason


# --- painting ---------------------------------------------------------------------------


def test_paint_steps_and_reasons():
    model = ir_model(chain_model())
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
    model = ir_model(text)
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
    result = PaintPass(default_policy("fp16"), absmax={"z": 5e5})(ir_model(text))
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
    model = filled_model(text, w=np.eye(8))
    work, applied = paint_apply(model)
    assert applied.modified and applied.casts_inserted == 4, applied.casts_inserted
    proto = ir.to_proto(work)
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
    full_check(proto)


def test_weight_read_by_both_precisions_small_copy_large_cast():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[8,8] x) => (float[8,8] y, float[8,8] z) <float[8,8] w> {
        y = MatMul (x, w)
        z = Add (x, w)
    }
    """
    model = filled_model(text, w=np.full((8, 8), 0.5))
    small, applied = paint_apply(model)
    assert applied.weights.duplicated == 1
    types = sorted(t.data_type for t in ir.to_proto(small).graph.initializer)
    assert types == [onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16]
    work = ir_model(model)
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
    work, applied = paint_apply(filled_model(text))
    assert decisions(work)["Div"] == ("fp32", "range"), decisions(work)
    consts = [n for n in ir.to_proto(work).graph.node if n.op_type == "Constant"]
    assert onnx.numpy_helper.to_array(consts[0].attribute[0].t).item() == 1e8
    assert applied.weights.overflowed == 0


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
    work, applied = paint_apply(filled_model(text))
    assert len(applied.retargeted_casts) == 1, applied.retargeted_casts
    proto = ir.to_proto(work)
    cast_k = next(n for n in proto.graph.node if n.op_type == "Cast" and n.input[0] == "k")
    assert cast_k.attribute[0].i == onnx.TensorProto.FLOAT16
    full_check(proto)
    feeds = {
        "x": np.random.default_rng(1).random((2, 8), dtype=np.float32),
        "w": np.random.default_rng(2).random((8, 8), dtype=np.float32),
        "k": np.arange(16, dtype=np.int64).reshape(2, 8),
    }
    assert_close(run_ort(filled_model(text), feeds)["y"], run_ort(proto, feeds)["y"], "float16")


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
    model = ir_model(text)
    # y is a graph output: the chain must stay (its name is the interface).
    assert RemoveRedundantCastsPass()(model).modified is False
    text2 = text.replace("y = Cast <to = 1> (h)", "y0 = Cast <to = 1> (h)\n y = Relu (y0)")
    model = ir_model(text2)
    result = RemoveRedundantCastsPass()(model)
    assert result.modified is True
    assert op_list(model) == ["Relu", "Cast", "Identity"]  # both float casts gone, int cast kept
    relu = next(n for n in model.graph if n.op_type == "Relu")
    assert relu.inputs[0] is model.graph.inputs[0]
    assert RemoveRedundantCastsPass()(model).modified is False


def test_shape_only_ops_take_any_dtype_without_casts():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x, float[8,8] w) => (float[2,8] y, int64[2] s) {
        m = MatMul (x, w)
        s = Shape (m)
        y = Relu (m)
    }
    """
    work, _ = paint_apply(filled_model(text))
    proto = ir.to_proto(work)
    full_check(proto)
    shape = next(n for n in proto.graph.node if n.op_type == "Shape")
    producer = next(n for n in proto.graph.node if shape.input[0] in n.output)
    assert producer.op_type == "MatMul"  # no Cast in between
    assert decision_of(next(n for n in work.graph if n.op_type == "Shape")) is None


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
    model = filled_model(text, v=np.ones(4))
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
    assert op_list(work) == [producer]
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
    result = FoldBatchNormPass()(ir.from_proto(filled_model(text)))
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
    model = filled_model(IF_MODEL, scale=1.0)
    work, applied = paint_apply(model)
    assert applied.modified
    proto = ir.to_proto(work)
    full_check(proto)
    assert decisions(work)["MatMul"][0] == "low", decisions(work)
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
    model = filled_model(text, scale=0.3)
    work, _ = paint_apply(model)
    proto = ir.to_proto(work)
    full_check(proto)
    feeds = {
        "x": np.random.default_rng(8).random((2, 8), dtype=np.float32),
        "n": np.array(3, dtype=np.int64),
    }
    assert_close(run_ort(model, feeds)["y"], run_ort(proto, feeds)["y"], "float16")
    assert decisions(work)["MatMul"][0] == "low", decisions(work)


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
    model = filled_model(text, scale=0.5)
    work, _ = paint_apply(model)
    proto = ir.to_proto(work)
    full_check(proto)
    by_op = {op: precision for op, (precision, _) in decisions(work).items()}
    assert by_op["If"] == "low" and by_op["Squeeze"] == "low", by_op
    assert op_list(proto).count("Cast") == 2  # x in, y out: none around the If
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


def test_apply_reports_not_modified_when_nothing_goes_low():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (int64[2,8] i, float[2,8] x) => (int64[2,8] j, float[2,8] y) {
        j = Add (i, i)
        y = Exp (x)
    }
    """
    work, applied = paint_apply(filled_model(text))
    assert applied.modified is False and applied.casts_inserted == 0
    assert op_list(work) == ["Add", "Exp"]
    assert decisions(work)["Exp"][0] == "fp32", decisions(work)


def test_apply_rerun_on_its_own_output_is_not_modified():
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,8] x) => (float[2,8] y) <float[8,8] w> {
        m = MatMul (x, w)
        y = Relu (m)
    }
    """
    work, applied = paint_apply(filled_model(text))
    assert applied.modified is True
    before = op_list(work)
    again = ApplyPrecisionPass(default_policy("fp16"))(work)
    assert again.modified is False and again.casts_inserted == 0
    assert op_list(work) == before
