"""Bad options end in one clear line (issue 35): a bad ``--exclude`` regular expression
with every target, a guard budget that is not a number through the API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from mixprec.cli.main import main


def _matmul() -> onnx.ModelProto:
    """One MatMul [1, 32] x [32, 16]: fp16, INT8 and weight-only all take it."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((0.3 * rng.standard_normal((32, 16))).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(
    "command",
    [["convert"], ["quantize"], ["quantize", "--weights", "int4"]],
    ids=["convert", "quantize", "weights"],
)
def test_a_bad_exclude_pattern_is_one_line_and_exit_2(command, tmp_path: Path, capsys):
    """Before: ``quantize`` and ``quantize --weights`` ended in exit 3, "internal error"."""
    src, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    onnx.save(_matmul(), src)
    code = main([command[0], str(src), "-o", str(out), *command[1:], "--exclude", "mm["])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(err) == 1 and "bad exclude pattern 'mm['" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("weights", [None, "int4"])
def test_a_bad_exclude_pattern_through_the_api(weights):
    with pytest.raises(mixprec.MixprecError, match=r"bad exclude pattern 'mm\['"):
        mixprec.quantize(_matmul(), weights=weights, exclude_nodes=["mm["])


@pytest.mark.parametrize(
    ("weights", "option"),
    [
        (None, "guard_drop"),
        (None, "guard_rel_l2"),
        (None, "guard_cosine"),
        ("int4", "guard_drop"),
        ("int4", "guard_rel_l2"),
        ("int4", "guard_kl"),
    ],
)
def test_a_budget_that_is_not_a_number_is_a_mixprec_error(weights, option):
    """Before: ``float('abc')`` in the config's check raised a raw ValueError."""
    with pytest.raises(mixprec.MixprecError, match=f"{option} must be a number"):
        mixprec.quantize(_matmul(), weights=weights, **{option: "abc"})


def test_a_metric_budget_that_is_not_a_number_says_so():
    """Before: ``metric needs metric_budget``, as if none had been given."""
    with pytest.raises(mixprec.MixprecError, match=r"metric_budget .* must be a number, not 'abc'"):
        mixprec.quantize(_matmul(), metric="os.path:exists", metric_budget="abc")
