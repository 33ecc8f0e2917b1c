"""The op registry: one entry per (domain, op_type) holds every per-op fact."""

from __future__ import annotations

import onnx_ir as ir

import mixprec
from mixprec.core.policy import DEFAULT_LISTS, RANGE_CHECKED, SHAPE_ONLY_OPS, rule_for
from mixprec.core.registry import MacArgs, OpClass, op_info, register_op, registered


def test_one_entry_carries_every_fact_of_an_op():
    exp = op_info("Exp")
    assert exp.classes == {"float16": OpClass.DENY, "bfloat16": OpClass.INFER}
    assert exp.range_checked == frozenset({"float16"})
    softmax = op_info("Softmax")
    assert softmax.rule is not None and softmax.rule.fp32_if is not None
    assert op_info("Shape").shape_only and op_info("Loop").control_flow
    assert op_info("QLinearConv").quantized
    conv = op_info("Conv")
    assert conv.classes["float16"] is OpClass.ALLOW
    assert conv.macs is not None
    assert conv.macs(MacArgs([[1, 3, 8, 8], [4, 3, 3, 3]], [[1, 4, 8, 8]], {})) == 256 * 27


def test_the_tables_are_read_back_from_the_registry():
    for target, lists in DEFAULT_LISTS.items():
        for cls, ops in lists.items():
            for op in ops:
                assert op_info(op).classes[target] is cls
    assert "Exp" in RANGE_CHECKED["float16"] and not RANGE_CHECKED["bfloat16"]
    assert {"Shape", "Size"} == SHAPE_ONLY_OPS
    assert all(key[1] for key, _ in registered())


def test_register_refines_and_unknown_ops_get_an_empty_entry():
    assert op_info("NoSuchOp", "com.example").classes == {}
    register_op("MyOp", domain="com.example", classes={"float16": OpClass.INFER})
    register_op("MyOp", domain="com.example", classes={"bfloat16": OpClass.CLEAR})
    info = op_info("MyOp", "com.example")
    assert info.classes == {"float16": OpClass.INFER, "bfloat16": OpClass.CLEAR}
    node = ir.node("Resize", [])
    assert rule_for(node).keep_fp32_inputs == frozenset({1, 2})


def test_policy_snapshot_lists_the_rules_in_force():
    snapshot = mixprec.default_policy("fp16").to_dict()
    rules = snapshot["rules"]
    assert isinstance(rules, dict)
    assert "ai.onnx::Resize" in rules and "roi and scales" in rules["ai.onnx::Resize"]
    assert ("", "Pow") in mixprec.RULES
