"""Corrupted bytes: a text field that is not UTF-8 (protobuf hands it over as ``bytes``).

Flipped bits in a real file turn a tag into another field's (an attribute's bytes read
as a node's op type) or break a UTF-8 sequence (in metadata, a doc string). Descriptive
text is escaped and the model converts; an identifier is one ``mixprec: error:`` line and
exit 2. Each model is built here and corrupted the way the fuzz campaigns found it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from helpers import sha256_of
from mixprec.cli.main import main
from mixprec.io.proto_checks import check_text


def _conv_model() -> onnx.ModelProto:
    """A small classifier: Conv (with a kernel_shape attribute) + Relu + pool + MatMul."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    fc = numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "fc")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv2d_3", kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c"], ["r"], name="relu", doc_string="DOCDOC"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("MatMul", ["f", "fc"], ["y"], name="head"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [w, fc],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    helper.set_model_props(model, {"character": "METAMETA"})
    return model


def _attribute_read_as_op_type() -> bytes:
    """The Conv's attribute field (tag 0x2a: field 5, bytes) with one bit flipped reads
    as field 4, the op type: the attribute's bytes, not UTF-8, become the op type."""
    data = bytearray(_conv_model().SerializeToString())
    attr = helper.make_attribute("kernel_shape", [3, 3]).SerializeToString()
    at = data.index(attr) - 2  # the tag byte and the one-byte length before the attribute
    assert data[at] == 0x2A
    data[at] ^= 0x08
    return bytes(data)


def _convert(
    data: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> tuple[int, str, Path]:
    src = tmp_path / "in.onnx"
    src.write_bytes(data)
    digest = sha256_of(src)
    out = tmp_path / "out.onnx"
    capsys.readouterr()
    rc = main(["convert", str(src), "-o", str(out), "--dtype", dtype, "-q"])
    err = capsys.readouterr().err
    assert sha256_of(src) == digest
    return rc, err, out


def _assert_one_error(rc: int, err: str, out: Path, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("mixprec: error: "), err
    assert "internal error" not in err and not out.exists()
    for fragment in fragments:
        assert fragment in lines[0], err


def test_an_attribute_read_as_the_op_type_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # was: internal error in stage 'prepare/CheckInputPass': TypeError: get_schema():
    # incompatible function arguments
    rc, err, out = _convert(_attribute_read_as_op_type(), tmp_path, capsys, "fp16")
    _assert_one_error(rc, err, out, "node 'conv2d_3': the op_type b'\\n\\x0ckernel_shape", "UTF-8")


@pytest.mark.parametrize(
    ("old", "new", "fragment"),
    [
        (b"GlobalAveragePool", b"GlobalAverag\xffPool", "node 'pool': the op_type"),
        (b"kernel_shape", b"kernel\xfeshape", "'conv2d_3' (Conv): the name b'kernel\\xfeshape'"),
    ],
)
def test_an_identifier_that_is_not_utf8_is_one_error_line(
    old: bytes, new: bytes, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _conv_model().SerializeToString().replace(old, new)
    rc, err, out = _convert(data, tmp_path, capsys, "fp16")
    _assert_one_error(rc, err, out, fragment, "is not UTF-8")


def test_metadata_and_doc_strings_that_are_not_utf8_are_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # was: internal error in stage 'prepare/InferShapesPass': SerdeError: Error calling
    # serialize_model_into (a metadata_props value with a broken UTF-8 sequence, bf16)
    data = _conv_model().SerializeToString()
    data = data.replace(b"METAMETA", b"META\xe6ETA").replace(b"DOCDOC", b"DO\xffDOC")
    rc, err, out = _convert(data, tmp_path, capsys, "bf16")
    assert rc == 0, err
    converted = onnx.load(str(out))
    onnx.checker.check_model(converted, full_check=True)
    assert {p.key: p.value for p in converted.metadata_props}["character"] == "META\\xe6ETA"


def test_check_text_escapes_in_place_and_counts() -> None:
    proto = onnx.ModelProto.FromString(
        _conv_model().SerializeToString().replace(b"METAMETA", b"META\xe6ETA")
    )
    assert isinstance(proto.metadata_props[0].value, bytes)
    assert check_text(proto) == 1
    assert proto.metadata_props[0].value == "META\\xe6ETA"
    assert check_text(proto) == 0
