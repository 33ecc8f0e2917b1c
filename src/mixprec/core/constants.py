"""Fast access to the constant tensor behind a value (initializer or Constant node)."""

from __future__ import annotations

import onnx_ir as ir

from mixprec.core.ops import is_onnx_domain

__all__ = ["const_tensor"]


def const_tensor(value: ir.Value | None) -> ir.TensorProtocol | None:
    """The tensor of an initializer or of a ``Constant(value=...)`` node's output, else None.

    A fast path for the two common cases; other Constant forms (``value_float`` ...) go
    through ``onnx_ir.convenience.get_const_tensor``. A malformed Constant (an attribute
    of the wrong kind) gives None: ``CheckInputPass`` reports it.
    """
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value
    producer = value.producer()
    if producer is None or producer.op_type != "Constant" or not is_onnx_domain(producer.domain):
        return None
    attr = producer.attributes.get("value")
    if attr is not None and attr.type == ir.AttributeType.TENSOR:
        return attr.value  # as_tensor() would repeat a slow runtime Protocol check
    try:
        return ir.convenience.get_const_tensor(value)
    except (TypeError, ValueError):
        return None
