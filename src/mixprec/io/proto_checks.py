"""Checks of a model file's protobuf, run where the file is read, before ``onnx_ir``
parses it (the graph checks that need the parsed model are passes:
:mod:`mixprec.passes.input_checks`).

* :func:`check_proto`: a value defined twice in one graph, an opset imported twice, and
  tensors without an element type or whose data does not fit their dims.
* :func:`check_text`: text fields that are not UTF-8 (a corrupted file): descriptive
  text is escaped, an identifier (op type, domain, attribute name) refused.
* :func:`tensor_fault`: why one tensor's data cannot be read.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import onnx
import onnx.helper
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import onnx_domain
from mixprec.io.protos import is_repeated, iter_model_graphs

__all__ = ["PACKED_4BIT", "check_proto", "check_text", "tensor_fault"]

logger = logging.getLogger(__name__)

#: Element types stored two per byte.
PACKED_4BIT = frozenset({"INT4", "UINT4", "FLOAT4E2M1"})


# --- tensors whose data does not fit their dims ------------------------------------------------


def _typed_count(dtype: ir.DataType, numel: int) -> int:
    """How many items of a typed data field (``float_data`` ...) ``numel`` elements take."""
    if dtype.name in PACKED_4BIT:
        return (numel + 1) // 2
    if dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128):
        return 2 * numel
    return numel


def tensor_fault(tensor: ir.TensorProtocol) -> str | None:
    """Why ``tensor`` cannot be read (no element type, data that does not fit its dims)."""
    try:
        dtype = ir.DataType(tensor.dtype)
    except ValueError:
        return f"has the unknown element type {int(tensor.dtype)}"
    if dtype == ir.DataType.UNDEFINED:
        return "has no element type (UNDEFINED)"
    dims = [d if isinstance(d, int) else -1 for d in tensor.shape.dims]
    if any(d < 0 for d in dims):
        return f"has invalid dims {list(tensor.shape.dims)}"
    numel = math.prod(dims)
    proto = getattr(tensor, "raw", None)
    if not isinstance(proto, onnx.TensorProto):
        return None  # in memory (numpy): consistent by construction
    if proto.data_location == onnx.TensorProto.EXTERNAL:
        return None  # checked where the file is read
    if proto.HasField("raw_data"):
        need = (numel * dtype.bitwidth + 7) // 8
        have = len(proto.raw_data)
        if have != need:
            return (
                f"holds {have} bytes of raw_data, but its dims {dims} of "
                f"{dtype.name.lower()} need {need}"
            )
        return None
    if dtype == ir.DataType.STRING:
        have = len(proto.string_data)
        need = numel
    else:
        field = onnx.helper.tensor_dtype_to_field(int(dtype))
        have = len(getattr(proto, field))
        need = _typed_count(dtype, numel)
    if have != need:
        return f"holds {have} values, but its dims {dims} need {need}"
    return None


# --- IR version ------------------------------------------------------------------------------


def check_proto(proto: onnx.ModelProto, where: str = "model") -> None:
    """Faults that stop ``onnx_ir`` from parsing ``proto`` or crash code before the stages.

    Call it at the boundary, before ``ir.from_proto``: a value defined twice in one graph
    (two nodes writing the same name, an input that a node also writes), and initializers
    or tensor attributes without an element type or with data that does not fit their
    dims.

    Raises:
        MixprecError: naming the graph, node or tensor.
    """
    if not proto.HasField("graph"):
        raise MixprecError(f"{where}: no graph")
    versions: dict[str, list[int]] = {}
    for opset in proto.opset_import:
        versions.setdefault(onnx_domain(opset.domain), []).append(opset.version)
    for domain, found in versions.items():
        if len(set(found)) > 1:  # which one holds is up to each reader: refuse, do not guess
            raise MixprecError(
                f"{where}: opset of domain {domain or 'ai.onnx'!r} imported {len(found)} "
                f"times ({', '.join(map(str, found))})"
            )
    graphs = list(iter_model_graphs(proto))
    for graph in graphs:
        defined: dict[str, str] = {}
        for vi in graph.input:
            defined.setdefault(vi.name, f"graph input {vi.name!r}")
        for node in graph.node:
            for out in node.output:
                if not out:
                    continue
                if out in defined:
                    raise MixprecError(
                        f"{where}: {_proto_label(node)} writes {out!r}, which "
                        f"{defined[out]} already defines (every value needs one producer)"
                    )
                defined[out] = _proto_label(node)
        for tensor in graph.initializer:
            _check_proto_tensor(tensor, f"{where}: initializer {tensor.name!r}")
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _check_proto_tensor(attr.t, f"{where}: {_proto_label(node)}: {attr.name!r}")


def _proto_label(node: onnx.NodeProto) -> str:
    if node.name:
        return f"node {node.name!r} ({node.op_type})"
    return f"an unnamed {node.op_type} node"


def _check_proto_tensor(tensor: onnx.TensorProto, what: str) -> None:
    if tensor.data_type == 0 or tensor.data_type not in {int(t) for t in ir.DataType}:
        raise MixprecError(f"{what} has no valid element type ({tensor.data_type})")
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return
    fault = tensor_fault(ir.serde.TensorProtoTensor(tensor))
    if fault:
        raise MixprecError(f"{what} {fault}")


# --- text that is not UTF-8 ------------------------------------------------------------------

#: ``(message, field)`` of the names :class:`~mixprec.passes.sanitize.RepairNamesPass` escapes
#: (or refuses, for the graph's inputs and outputs) once ``onnx_ir`` has parsed the model.
_NAME_FIELDS = frozenset(
    {("NodeProto", "name"), ("NodeProto", "input"), ("NodeProto", "output")}
    | {("GraphProto", "name"), ("ValueInfoProto", "name"), ("TensorProto", "name")}
    | {("FunctionProto", "input"), ("FunctionProto", "output")}
)
#: Fields that only describe (documentation, metadata, labels): escaped when not UTF-8.
_DESCRIPTIVE_FIELDS = frozenset(
    {"doc_string", "producer_name", "producer_version", "denotation", "dim_param"}
    | {"key", "value", "tensor_name"}
)


def check_text(proto: onnx.ModelProto, where: str = "model") -> int:
    """Text fields of ``proto`` that are not UTF-8, which protobuf hands over as ``bytes``
    and nothing can write back (a corrupted file): documentation, metadata and labels
    are escaped in place (``b"a\\xff"`` becomes ``"a\\\\xff"``); names are left to
    :class:`~mixprec.passes.sanitize.RepairNamesPass`; anything else is refused.

    Returns:
        The number of fields escaped.

    Raises:
        MixprecError: an op type, domain, attribute name or other identifier that is not
            UTF-8, naming the node or function that holds it.
    """
    escaped = [0]
    _walk_text(proto, where, "", escaped)
    if escaped[0]:
        logger.info("%s: escaped %d text field(s) that are not UTF-8", where, escaped[0])
    return escaped[0]


def _walk_text(message: Any, label: str, via: str, escaped: list[int]) -> None:
    kind = message.DESCRIPTOR.name
    if kind == "NodeProto":
        label = f"{label}: node {message.name!r}" + (
            f" ({message.op_type})" if isinstance(message.op_type, str) else ""
        )
    elif kind == "FunctionProto":
        label = f"{label}: function {message.domain!r}::{message.name!r}"
    for fd, value in message.ListFields():
        if fd.type == fd.TYPE_MESSAGE:
            for item in value if is_repeated(fd) else [value]:
                _walk_text(item, label, fd.name, escaped)
        elif fd.type == fd.TYPE_STRING:
            texts = list(value) if is_repeated(fd) else [value]
            if any(isinstance(t, bytes) for t in texts) and _escape_text(
                message, fd, texts, label, via
            ):
                escaped[0] += 1


def _escape_text(message: Any, fd: Any, texts: list[Any], label: str, via: str) -> bool:
    """Escape field ``fd`` of ``message`` (some of ``texts`` are bytes; True), leave a
    name to RepairNamesPass (False), or refuse an identifier."""
    kind = message.DESCRIPTOR.name
    if (kind, fd.name) in _NAME_FIELDS and (kind != "TensorProto" or via == "initializer"):
        return False
    if fd.name not in _DESCRIPTIVE_FIELDS and (kind, fd.name) != ("ModelProto", "domain"):
        bad = next(t for t in texts if isinstance(t, bytes))
        raise MixprecError(f"{label}: the {fd.name} {bad[:40]!r} is not UTF-8 (a corrupted file?)")
    fixed = [t.decode("utf-8", "backslashreplace") if isinstance(t, bytes) else t for t in texts]
    if is_repeated(fd):
        del getattr(message, fd.name)[:]
        getattr(message, fd.name).extend(fixed)
    else:
        setattr(message, fd.name, fixed[0])
    return True
