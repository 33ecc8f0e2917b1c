"""Facts about ONNX ops and dtypes that several layers read: one home for each.

- the default ONNX domain and its two spellings;
- the Q/DQ op pair, the attributes that name a dtype;
- the float element types, the low ones, the targets and their spellings (one parser,
  :func:`parse_dtype`, for every command and entry point);
- the weight axes of the weighted ops (output channels, per-channel scales);
- the default error tolerance of each target.

Nothing here imports from mixprec but :mod:`mixprec.core.errors`: it is the lowest layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, overload

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mixprec.core.errors import MixprecError

__all__ = [
    "BF16",
    "DEFAULT_ATOL",
    "DTYPE_ATTRS",
    "FLOAT_TYPES",
    "LOW_TYPES",
    "ONNX_DOMAINS",
    "QDQ_OPS",
    "ROW_BUDGETS",
    "TARGET_TYPES",
    "TOLERANCES",
    "is_float_dtype",
    "is_onnx_domain",
    "onnx_domain",
    "onnx_opset",
    "parse_dtype",
    "short_name",
    "tolerance",
    "trans_b",
    "weight_out_axis",
]

# --- domains ------------------------------------------------------------------------------

#: The two spellings of the default ONNX domain.
ONNX_DOMAINS = frozenset({"", "ai.onnx"})


def is_onnx_domain(domain: str) -> bool:
    """Whether ``domain`` is the default ONNX domain (``""`` or ``"ai.onnx"``)."""
    return domain in ONNX_DOMAINS


def onnx_domain(domain: str) -> str:
    """The canonical key of a domain: ``""`` for the default ONNX domain, else itself."""
    return "" if domain == "ai.onnx" else domain


@overload
def onnx_opset(opset_imports: Mapping[str, int], default: int) -> int: ...
@overload
def onnx_opset(opset_imports: Mapping[str, int], default: None = None) -> int | None: ...
def onnx_opset(opset_imports: Mapping[str, int], default: int | None = None) -> int | None:
    """The default domain's opset from an opset map, under either spelling."""
    return opset_imports.get("", opset_imports.get("ai.onnx", default))


# --- ops and attributes -------------------------------------------------------------------

#: The quantize/dequantize pair that brackets an INT8 region.
QDQ_OPS = frozenset({"QuantizeLinear", "DequantizeLinear"})
#: Attributes whose value is an element type (Cast's ``to``, ``dtype`` of the generators,
#: QuantizeLinear's ``output_dtype``).
DTYPE_ATTRS = ("to", "dtype", "output_dtype")

# --- dtypes -------------------------------------------------------------------------------

#: Floating element types (what a precision change may touch).
FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
)
#: The low-precision float types the converter writes.
LOW_TYPES = frozenset({ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
#: The fp16/bf16 targets by canonical name.
TARGET_TYPES: Mapping[str, ir.DataType] = {
    "float16": ir.DataType.FLOAT16,
    "bfloat16": ir.DataType.BFLOAT16,
}
#: Every accepted spelling of a target -> its canonical name.
_SPELLINGS: Mapping[str, str] = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "f16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "int8": "int8",
    "i8": "int8",
}
#: The short names the CLI and the reports use.
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "int8": "int8"}
#: Spellings that name the activation type of INT8, not a target.
_ACTIVATION_TYPES = ("u8", "s8", "uint8")


def parse_dtype(
    name: object, allowed: Iterable[str] = ("float16", "bfloat16", "int8"), *, what: str = "dtype"
) -> str:
    """The canonical name ("float16", "bfloat16" or "int8") of a target spelled any
    accepted way (``fp16|float16|half|f16``, ``bf16|bfloat16``, ``int8|i8``; any case).

    Raises:
        TypeError: ``name`` is not a string.
        MixprecError: unknown, or a target that is not in ``allowed`` (one line that lists
            the accepted spellings).
    """
    allowed = tuple(allowed)
    if not isinstance(name, str):
        raise TypeError(
            f"{what} must be a str such as 'fp16' or 'bf16', not {type(name).__name__} {name!r}"
        )
    key = name.strip().lower()
    canonical = _SPELLINGS.get(key)
    spellings = ", ".join(k for k, v in _SPELLINGS.items() if v in allowed)
    if canonical is None:
        hint = ""
        if key in _ACTIVATION_TYPES and "int8" in allowed:
            hint = " (u8/s8 are INT8 activation types: --activation-type)"
        raise MixprecError(f"unknown {what} {name!r}; use one of: {spellings}{hint}")
    if canonical not in allowed:
        hint = " (INT8: mixprec quantize)" if canonical == "int8" else ""
        raise MixprecError(f"{what} {name!r} is not accepted here; use one of: {spellings}{hint}")
    return canonical


def short_name(canonical: str) -> str:
    """ "fp16", "bf16" or "int8" for a canonical target name."""
    return _SHORT.get(canonical, canonical)


# --- weights ------------------------------------------------------------------------------


def trans_b(node: ir.Node) -> bool:
    """Whether a Gemm takes its weight transposed (``transB`` = 1)."""
    attr = node.attributes.get("transB")
    return attr is not None and bool(attr.as_int())


def weight_out_axis(node: ir.Node, ndim: int) -> int | None:
    """The output-channel axis of the weight (input 1) of ``node``: Conv 0, ConvTranspose 1,
    Gemm 0 with transB else 1, MatMul the last axis; None for other ops (or a MatMul
    weight of rank < 2). Per-channel scales and BatchNormalization folding run along it."""
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm":
        return 0 if trans_b(node) else 1
    if node.op_type == "MatMul":
        return ndim - 1 if ndim >= 2 else None
    return None


#: numpy's dtype of bfloat16 (ml_dtypes'), which numpy's own kinds do not call a float.
BF16 = np.dtype(ml_dtypes.bfloat16)


def is_float_dtype(dtype: np.dtype[Any]) -> bool:
    """Whether arrays of numpy ``dtype`` hold floating-point values, bfloat16 included:
    the one test every layer asks (metrics, calibration, samples)."""
    return dtype.kind == "f" or dtype == BF16


# --- tolerances ---------------------------------------------------------------------------

#: Default bounds of each built-in metric per target: (higher is better, bound by target).
#: bf16 keeps 8 mantissa bits against fp16's 11: its unit roundoff is 8x larger, so its
#: relative L2 bound is fp16's scaled by 8. INT8 (8-bit activations and weights, about two
#: decimal digits) is held to 10% relative L2. max-abs has no default (scale-dependent).
TOLERANCES: Mapping[str, tuple[bool, Mapping[str, float]]] = {
    "rel-l2": (False, {"float16": 1e-2, "bfloat16": 8e-2, "int8": 1e-1}),
    "max-abs": (False, {}),
    "top1": (True, {"float16": 0.99, "bfloat16": 0.99, "int8": 0.99}),
    "cosine": (True, {"float16": 0.9999, "bfloat16": 0.999, "int8": 0.99}),
}
#: The max abs error an output passes with in place of its relative bound, for every
#: target: a reference near zero makes any relative error large (validate, the torch check).
DEFAULT_ATOL = 1e-3


#: The accuracy guard's checks that count rows whose answer holds: each one's default least
#: share (for every target) and why. ``top1``, ``match`` and ``row-cosine`` take the
#: top1 row of :data:`TOLERANCES` (a user's ``--max-drop`` moves them all).
ROW_BUDGETS: Mapping[str, tuple[float, str]] = {
    "top1": (0.99, "argmax rows (a class, a bin, a timestep): 99 in 100 unchanged"),
    "top1-active": (0.99, "a sigmoid's top bin, in rows with a score >= 0.5: 99 in 100"),
    "match": (0.99, "integer outputs: 99 in 100 elements equal"),
    "decision": (0.99, "a sigmoid's yes/no at 0.5: 99 in 100 scores on the same side"),
    "row-cosine": (0.99, "rows (an embedding, a token) at the cosine bound: 99 in 100"),
    "detection": (0.98, "decoded detections against FP32's (same class, IoU >= 0.5): F1"),
    "neighbours": (0.98, "each row's nearest neighbour among the held-out rows kept"),
}


def tolerance(metric: str, target: str) -> float | None:
    """The default bound of ``metric`` for ``target`` (canonical name), or None."""
    entry = TOLERANCES.get(metric)
    return None if entry is None else entry[1].get(target)
