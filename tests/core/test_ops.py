"""core.ops: the one parser of dtype spellings, the weight axes, the domain test."""

from __future__ import annotations

import onnx_ir as ir
import pytest

from mixprec.core.errors import MixprecError
from mixprec.core.metrics import DEFAULT_RTOL
from mixprec.core.ops import (
    is_onnx_domain,
    onnx_domain,
    onnx_opset,
    parse_dtype,
    short_name,
    tolerance,
    weight_out_axis,
)


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("fp16", "float16"),
        ("Float16", "float16"),
        (" half ", "float16"),
        ("f16", "float16"),
        ("bf16", "bfloat16"),
        ("BFLOAT16", "bfloat16"),
        ("int8", "int8"),
        ("I8", "int8"),
    ],
)
def test_every_spelling_parses_to_one_canonical_name(spelling: str, canonical: str) -> None:
    assert parse_dtype(spelling) == canonical
    assert short_name(canonical) == {"float16": "fp16", "bfloat16": "bf16"}.get(
        canonical, canonical
    )


def test_unknown_and_refused_spellings_get_one_line_naming_the_accepted_ones() -> None:
    with pytest.raises(MixprecError) as info:
        parse_dtype("fp8")
    assert "\n" not in str(info.value) and "unknown dtype 'fp8'" in str(info.value)
    assert "fp16" in str(info.value) and "i8" in str(info.value)
    with pytest.raises(MixprecError, match=r"u8/s8 are INT8 activation types"):
        parse_dtype("u8")
    with pytest.raises(MixprecError, match=r"'i8' is not accepted here.*quantize") as info:
        parse_dtype("i8", allowed=("float16", "bfloat16"), what="target dtype")
    assert "i8" not in str(info.value).split("use one of:")[1]
    with pytest.raises(TypeError, match="must be a str"):
        parse_dtype(16)


def _node(op_type: str, **attrs: int) -> ir.Node:
    attributes = [ir.AttrInt64(k, v) for k, v in attrs.items()]
    return ir.Node("", op_type, inputs=[], attributes=attributes)


@pytest.mark.parametrize(
    ("op_type", "attrs", "ndim", "axis"),
    [
        ("Conv", {}, 4, 0),
        ("ConvTranspose", {}, 4, 1),
        ("Gemm", {}, 2, 1),
        ("Gemm", {"transB": 1}, 2, 0),
        ("Gemm", {"transB": 0}, 2, 1),
        ("MatMul", {}, 2, 1),
        ("MatMul", {}, 3, 2),
        ("MatMul", {}, 1, None),
        ("Relu", {}, 2, None),
    ],
)
def test_weight_output_channel_axis(op_type: str, attrs: dict, ndim: int, axis: int | None):
    assert weight_out_axis(_node(op_type, **attrs), ndim) == axis


def test_default_domain_under_both_spellings() -> None:
    assert is_onnx_domain("") and is_onnx_domain("ai.onnx")
    assert not is_onnx_domain("com.microsoft") and not is_onnx_domain("ai.onnx.ml")
    assert onnx_domain("ai.onnx") == "" and onnx_domain("com.microsoft") == "com.microsoft"
    assert onnx_opset({"ai.onnx": 13}) == 13 and onnx_opset({"": 17, "ai.onnx": 13}) == 17
    assert onnx_opset({"com.microsoft": 1}) is None and onnx_opset({}, 7) == 7


def test_tolerances_have_one_home() -> None:
    assert DEFAULT_RTOL == {"float16": 1e-2, "bfloat16": 8e-2, "int8": 1e-1}
    assert tolerance("rel-l2", "bfloat16") == DEFAULT_RTOL["bfloat16"]
    assert tolerance("cosine", "float16") == 0.9999 and tolerance("max-abs", "int8") is None
