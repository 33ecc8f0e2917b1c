"""Argument checking at the API boundary: every bad argument of ``convert``, ``inspect``,
``ConvertConfig.resolve``, ``Policy``, ``register_rule``, ``register_op`` and the calibration
data ends in a ``MixprecError`` (a ValueError) or ``TypeError`` naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import mixprec
from mixprec import ConvertConfig, MixprecError, OpClass, OpRule, Policy
from mixprec.core.policy import default_policy, register_rule
from mixprec.core.registry import op_info, register_op
from mixprec.inputs.feeds import feeds_for


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


M = _model()
X = np.ones((2, 4), np.float32)
P16 = default_policy("fp16")
LISTS = dict(P16.lists)


def _policy(**changes: object) -> Callable[[], object]:
    fields: dict[str, object] = {"target": "float16", "lists": LISTS, **changes}
    return lambda: Policy(**fields)  # type: ignore[arg-type]


# (call, exception type, fragment of the message)
CASES: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    # convert / inspect: the target dtype and the model
    "dtype-int": (lambda: mixprec.convert(M, 16), TypeError, "target_dtype must be a str"),
    "dtype-unknown": (lambda: mixprec.convert(M, "fp8"), MixprecError, "unknown target dtype"),
    "inspect-dtype-int": (lambda: mixprec.inspect(M, 16), TypeError, "target_dtype"),
    "model-int": (lambda: mixprec.convert(5), MixprecError, "model must be a path"),
    "model-missing": (lambda: mixprec.convert("no/such.onnx"), MixprecError, "no such file"),
    "unknown-option": (lambda: mixprec.convert(M, frobnicate=1), MixprecError, "frobnicate"),
    # policy and lists
    "policy-str": (lambda: mixprec.convert(M, policy="fp16"), TypeError, "policy must be a Policy"),
    "policy-and-lists": (
        lambda: mixprec.convert(M, policy=P16, deny_add=["Relu"]),
        MixprecError,
        "not both",
    ),
    "allow-add-str": (lambda: mixprec.convert(M, allow_add="Relu"), TypeError, "allow_add"),
    "deny-add-int": (lambda: mixprec.convert(M, deny_add=3), TypeError, "deny_add"),
    "infer-add-item": (lambda: mixprec.convert(M, infer_add=[3]), TypeError, "infer_add"),
    "clear-remove-empty": (
        lambda: mixprec.convert(M, clear_remove=[""]),
        TypeError,
        "clear_remove",
    ),
    "allow-add-unknown": (lambda: mixprec.convert(M, allow_add=["Foo"]), MixprecError, "'Foo'"),
    "deny-remove-absent": (
        lambda: mixprec.convert(M, deny_remove=["MatMul"]),
        MixprecError,
        "cannot remove 'MatMul'",
    ),
    "allow-and-deny": (
        lambda: mixprec.convert(M, allow_add=["Relu"], deny_add=["Relu"]),
        MixprecError,
        "both allow_add and deny_add",
    ),
    "exclude-str": (lambda: mixprec.convert(M, exclude_nodes="head"), TypeError, "exclude_nodes"),
    "exclude-bad-regex": (lambda: mixprec.convert(M, exclude_nodes=["(["]), MixprecError, "'(['"),
    "force-all-str": (lambda: mixprec.convert(M, force_all="yes"), TypeError, "force_all"),
    "output-fp32-unknown": (
        lambda: mixprec.convert(M, output_fp32_ops=["NotAnOp"]),
        MixprecError,
        "'NotAnOp'",
    ),
    "output-fp32-str": (
        lambda: mixprec.convert(M, output_fp32_ops="Relu"),
        TypeError,
        "output_fp32_ops",
    ),
    # config fields
    "range-threshold-zero": (
        lambda: mixprec.convert(M, range_threshold=0),
        MixprecError,
        "range_threshold",
    ),
    "range-threshold-negative": (
        lambda: mixprec.convert(M, range_threshold=-1.0),
        MixprecError,
        "range_threshold",
    ),
    "range-threshold-nan": (
        lambda: mixprec.convert(M, range_threshold=math.nan),
        MixprecError,
        "range_threshold",
    ),
    "range-threshold-inf": (
        lambda: mixprec.convert(M, range_threshold=math.inf),
        MixprecError,
        "range_threshold",
    ),
    "range-threshold-str": (
        lambda: mixprec.convert(M, range_threshold="1e4"),
        TypeError,
        "range_threshold",
    ),
    "range-threshold-bool": (
        lambda: mixprec.convert(M, range_threshold=True),
        TypeError,
        "range_threshold",
    ),
    "keep-io-str": (lambda: mixprec.convert(M, keep_io_types="x"), MixprecError, "keep_io_types"),
    "keep-io-int": (lambda: mixprec.convert(M, keep_io_types=1), MixprecError, "keep_io_types"),
    "keep-io-unknown-name": (
        lambda: mixprec.convert(M, keep_io_types=["nope"]),
        MixprecError,
        "valid names: 'x', 'y'",
    ),
    "calibrate-str": (lambda: mixprec.convert(M, calibrate="no"), TypeError, "calibrate"),
    "fold-batchnorm-int": (
        lambda: mixprec.convert(M, fold_batchnorm=1),
        TypeError,
        "fold_batchnorm",
    ),
    "check-none": (lambda: mixprec.convert(M, check=None), TypeError, "check"),
    "clip-weights-str": (lambda: mixprec.convert(M, clip_weights="y"), TypeError, "clip_weights"),
    "upgrade-opset-str": (
        lambda: mixprec.convert(M, upgrade_opset="no"),
        TypeError,
        "upgrade_opset",
    ),
    "observer-int": (lambda: mixprec.convert(M, observer=3), MixprecError, "observer"),
    "observer-unknown": (lambda: mixprec.convert(M, observer="kl"), MixprecError, "observer"),
    "shapes-list": (lambda: mixprec.convert(M, shapes=[2, 4]), TypeError, "shapes"),
    "shapes-str-dims": (lambda: mixprec.convert(M, shapes={"x": "2,4"}), TypeError, "'x'"),
    "shapes-float-dims": (
        lambda: mixprec.convert(M, shapes={"x": [2.5, 4]}),
        MixprecError,
        "shape of 'x'",
    ),
    "shapes-zero": (lambda: mixprec.convert(M, shapes={"x": [0, 4]}), MixprecError, "positive"),
    "log-dir-int": (lambda: mixprec.convert(M, log_dir=3), TypeError, "log_dir"),
    # calibration data
    "calibration-list-of-array": (
        lambda: mixprec.convert(M, calibration_data=[X]),
        MixprecError,
        "calibration sample 0 is a ndarray",
    ),
    "calibration-array": (
        lambda: mixprec.convert(M, calibration_data=X),
        MixprecError,
        "calibration_data must be a dict",
    ),
    "calibration-with-calibrate-false": (
        lambda: mixprec.convert(M, calibrate=False, calibration_data={"x": X}),
        MixprecError,
        "calibrate=False",
    ),
    "calibration-empty-list": (
        lambda: mixprec.convert(M, calibration_data=[]),
        MixprecError,
        "holds no sample",
    ),
    "calibration-empty-array": (
        lambda: mixprec.convert(M, calibration_data={"x": np.zeros((0, 4), np.float32)}),
        MixprecError,
        "'x' is empty",
    ),
    "calibration-all-nan": (
        lambda: mixprec.convert(M, calibration_data={"x": np.full((2, 4), np.nan, np.float32)}),
        MixprecError,
        "all NaN",
    ),
    "calibration-all-nan-second-batch": (
        lambda: mixprec.convert(
            M, calibration_data=[{"x": X}, {"x": np.full((2, 4), np.nan, np.float32)}]
        ),
        MixprecError,
        "calibration sample 1: input 'x' is all NaN",
    ),
    "calibration-empty-dict-sample": (
        lambda: mixprec.convert(M, calibration_data=[{}]),
        MixprecError,
        "empty dict",
    ),
    "calibration-object-array": (
        lambda: mixprec.convert(M, calibration_data={"x": [object()]}),
        MixprecError,
        "not a numeric array",
    ),
    "feeds-not-a-dict": (lambda: feeds_for(M, [X]), MixprecError, "inputs must be a dict"),
    # ConvertConfig.resolve
    "resolve-env-int": (lambda: ConvertConfig.resolve("fp16", env=3), TypeError, "env"),
    "resolve-dtype-bytes": (lambda: ConvertConfig.resolve(b"fp16"), TypeError, "target_dtype"),
    "resolve-policy-dict": (
        lambda: ConvertConfig.resolve(policy={"target": "float16"}),
        TypeError,
        "policy",
    ),
    "config-policy-str": (lambda: ConvertConfig(policy="fp16"), MixprecError, "policy"),
    # Policy
    "policy-target": (_policy(target="fp8"), MixprecError, "Policy target"),
    "policy-lists-missing": (_policy(lists={}), MixprecError, "missing: allow"),
    "policy-lists-not-mapping": (_policy(lists=[1]), TypeError, "Policy lists"),
    "policy-exclude-list": (_policy(exclude_nodes=["a"]), TypeError, "exclude_nodes"),
    "policy-force-all-int": (_policy(force_all=1), TypeError, "force_all"),
    "policy-output-fp32-set": (_policy(output_fp32_ops={"Relu"}), TypeError, "output_fp32_ops"),
    "policy-op-in-two-lists": (
        _policy(lists={**LISTS, OpClass.ALLOW: LISTS[OpClass.ALLOW] | {"Exp"}}),
        MixprecError,
        "'Exp' is in both",
    ),
    # register_rule / register_op
    "rule-str": (lambda: register_rule("Pow", "notarule"), TypeError, "rule must be an OpRule"),  # type: ignore[arg-type]
    "rule-op-int": (lambda: register_rule(3, OpRule()), TypeError, "op_type"),  # type: ignore[arg-type]
    "rule-op-empty": (lambda: register_rule("", OpRule()), MixprecError, "malformed op type"),
    "rule-domain-none": (
        lambda: register_rule("Pow", OpRule(), domain=None),  # type: ignore[arg-type]
        TypeError,
        "domain",
    ),
    "rule-keep-inputs-list": (
        lambda: register_rule("Pow", OpRule(keep_fp32_inputs=[1])),  # type: ignore[arg-type]
        TypeError,
        "keep_fp32_inputs",
    ),
    "rule-fp32-if-str": (
        lambda: register_rule("Pow", OpRule(fp32_if="x > 1")),  # type: ignore[arg-type]
        TypeError,
        "fp32_if",
    ),
    "op-unknown-fact": (lambda: register_op("Foo", colour="red"), MixprecError, "colour"),
    "op-bool-fact": (lambda: register_op("Foo", shape_only="yes"), TypeError, "shape_only"),
    "op-macs": (lambda: register_op("Foo", macs=3), TypeError, "macs"),
    "op-classes-target": (
        lambda: register_op("Foo", classes={"fp8": OpClass.ALLOW}),
        MixprecError,
        "'fp8'",
    ),
    "op-classes-value": (
        lambda: register_op("Foo", classes={"float16": "allow"}),
        MixprecError,
        "OpClass",
    ),
    "op-range-checked": (
        lambda: register_op("Foo", range_checked={"float16"}),
        MixprecError,
        "range_checked",
    ),
}


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument_is_refused_naming_it(case: str) -> None:
    call, kind, fragment = CASES[case]
    before = {
        key: info for key, info in [(("", "Pow"), op_info("Pow")), (("", "Foo"), op_info("Foo"))]
    }
    with pytest.raises(kind) as caught:
        call()
    assert fragment in str(caught.value), str(caught.value)
    if kind is not TypeError:
        assert isinstance(caught.value, ValueError)  # MixprecError is a ValueError
    # A refused registration leaves the registry as it was.
    assert op_info("Pow") == before[("", "Pow")]
    assert op_info("Foo") == before[("", "Foo")]


def test_good_arguments_still_convert() -> None:
    result = mixprec.convert(
        M,
        "fp16",
        keep_io_types=["x", "y"],
        range_threshold=1e4,
        allow_add=["Relu"],
        calibration_data=[{"x": X}, {"x": 2 * X}],
        shapes={"x": (2, 4)},
    )
    assert result.report.calibrated
    ops = [n.op_type for n in result.model.graph]
    assert ops.count("MatMul") == 1 and ops.count("Relu") == 1


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"inputs": [np.zeros(3, np.float32)]}, "inputs must be a dict"),
        ({"rtol": -1.0}, "rtol must be a finite number > 0"),
        ({"atol": float("nan")}, "atol must be a finite number > 0"),
        ({"rtol": "0.1"}, "rtol must be a number"),
        ({"seed": 1.5}, "seed must be an int"),
    ],
)
def test_validate_checks_its_arguments(kwargs, fragment):
    with pytest.raises(mixprec.MixprecError, match=fragment):
        mixprec.validate("a.onnx", "b.onnx", **kwargs)
