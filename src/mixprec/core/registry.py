"""The op registry: every per-op fact mixprec knows, in one entry per (domain, op_type).

An :class:`OpInfo` carries the op's default list per target dtype, whether its DENY is
only about range (and so lifted by calibration), its conditional rule, whether it only
reads shapes, whether it is control flow, whether it is already quantized, and how to
count its multiply-accumulates. Policies (``_policy``), the painter, the rewriter, the
report and, later, INT8 read the facts here; :func:`register_op` adds or refines them.

Example:
    >>> from mixprec.core.registry import op_info, register_op
    >>> register_op("MyGemm", domain="com.example", macs=gemm_like)   # doctest: +SKIP
    >>> op_info("Conv").macs is not None
    True
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import onnx_domain

__all__ = [
    "INT8_ROLES",
    "LAYER_KINDS",
    "MacArgs",
    "OpClass",
    "OpInfo",
    "OpRule",
    "RuleContext",
    "node_info",
    "op_info",
    "register_op",
    "registered",
]


class OpClass(enum.Enum):
    """The colour an op type has in the policy lists."""

    ALLOW = "allow"
    DENY = "deny"
    INFER = "infer"
    CLEAR = "clear"
    NONE = "none"


@dataclass(frozen=True)
class RuleContext:
    """What a rule's condition may look at besides the node.

    Attributes:
        target: "float16" or "bfloat16".
        opset: the opset of the node's domain.
        shapes: concrete shapes by value name, inferred from the calibration/--shape
            input shapes (may be empty).
    """

    target: str
    opset: int
    shapes: Mapping[str, Sequence[int | None]] = field(default_factory=dict)

    def shape(self, value: ir.Value | None) -> list[int | None] | None:
        """The best known shape of ``value``: concrete if inferred, else declared."""
        if value is None:
            return None
        known = self.shapes.get(value.name or "")
        if known is not None and all(isinstance(d, int) and d > 0 for d in known):
            return list(known)
        if value.shape is None:
            return None
        return [d if isinstance(d, int) and d > 0 else None for d in value.shape]


Condition = Callable[[ir.Node, RuleContext], "str | None"]


@dataclass(frozen=True)
class OpRule:
    """Per-op behaviour that the four lists cannot express.

    Attributes:
        keep_fp32_inputs: input indices that stay FP32 even when the op runs in low
            precision (parameters such as Resize's roi and scales).
        fp32_if: a condition returning a reason string when this node must stay FP32
            (it then acts as a DENY seed), or None.
        output_fp32: the op computes in low precision but hands FP32 to its consumers
            (the TVM ``output_dtype`` knob); a Cast is placed right after it.
        fp32_upstream: when ``fp32_if`` holds, the float path that feeds only this node
            stays FP32 too, back to the first value something else also reads (a count's
            whole computation: rounding it anywhere moves the count).
        note: one line shown in the documentation table.
    """

    keep_fp32_inputs: frozenset[int] = frozenset()
    fp32_if: Condition | None = None
    output_fp32: bool = False
    fp32_upstream: bool = False
    note: str = ""


DEFAULT_RULE = OpRule(note="every float input/output bound to a type the schema admits follows")

Shape = list[int] | None


@dataclass(frozen=True)
class MacArgs:
    """What a MAC formula sees: known input/output shapes (None: unknown) and ints."""

    inputs: Sequence[Shape]
    outputs: Sequence[Shape]
    ints: Mapping[str, int]


MacFormula = Callable[[MacArgs], int]


@dataclass(frozen=True)
class OpInfo:
    """Everything mixprec knows about one op type.

    Attributes:
        classes: the op's default list per target ("float16", "bfloat16").
        range_checked: targets where the op is DENY only through its range: a calibration
            that saw every tensor it touches in range paints it as INFER.
        rule: the conditional rule, or None for :data:`DEFAULT_RULE`.
        shape_only: reads only the shape of its input (never painted, never cast).
        control_flow: holds subgraphs (If/Loop/Scan).
        quantized: already an integer-quantized op (left alone).
        same_type: output 0 has the element type of input 0 (Where: of input 1; Split: all
            outputs); fills in types the model and shape inference leave unknown.
        macs: multiply-accumulates per node, from shapes; None: not counted.
        int8: the op's part in INT8 quantization (see :data:`INT8_ROLES`); None: it
            stays float.
        count_inputs: input indices that take a count or a shape (Range's bounds,
            Reshape's shape, TopK's k, ...): a float rounded into one decides a length.
        layer: a weighted layer (:data:`LAYER_KINDS`): its input 0 times its weight,
            input 1, whose output channels lie along
            :func:`~mixprec.core.ops.weight_out_axis`; "conv" or "dense" (with a bias
            as input 2) or "matmul" (none). :func:`mixprec.core.layers.match_layer` reads
            it for BatchNormalization folding, smoothing, equalization, calibration's
            layer inputs and INT8; whether INT8 quantizes the layer is its ``int8`` role.
    """

    classes: Mapping[str, OpClass] = field(default_factory=dict)
    range_checked: frozenset[str] = frozenset()
    rule: OpRule | None = None
    shape_only: bool = False
    control_flow: bool = False
    quantized: bool = False
    same_type: bool = False
    macs: MacFormula | None = None
    int8: str | None = None
    count_inputs: frozenset[int] = frozenset()
    layer: str | None = None


#: The kinds of weighted layer (:attr:`OpInfo.layer`): "conv" (a kernel over spatial
#: axes, bias input 2), "dense" (a matrix, bias input 2), "matmul" (a matrix, no bias).
LAYER_KINDS = ("conv", "dense", "matmul")

#: How an op takes part in INT8 (QDQ that ONNX Runtime's CPU provider fuses):
#: "weighted": integer kernel with a constant weight (QLinearConv, QLinearMatMul, QGemm);
#: "binary": QLinearAdd/QLinearMul; "pool": QLinearAveragePool/GlobalAveragePool;
#: "concat": QLinearConcat; "unary": QLinearSigmoid/LeakyRelu; "shared": data movement
#: that keeps its input's scale (ORT drops its Q/DQ); "absorbed": Relu/Clip folded into
#: the integer producer through the output range.
INT8_ROLES = ("weighted", "binary", "pool", "concat", "unary", "shared", "absorbed")

_EMPTY = OpInfo()
_REGISTRY: dict[tuple[str, str], OpInfo] = {}


def _key(op_type: str, domain: str) -> tuple[str, str]:
    return (onnx_domain(domain), op_type)


_FACTS = frozenset(f.name for f in dataclasses.fields(OpInfo))
_TARGETS = ("float16", "bfloat16")
_BOOL_FACTS = frozenset({"shape_only", "control_flow", "quantized", "same_type"})


def _check_registration(op_type: object, domain: object, facts: Mapping[str, object]) -> None:
    """Type- and value-check :func:`register_op`'s arguments (names the bad one)."""
    for name, given in (("op_type", op_type), ("domain", domain)):
        if not isinstance(given, str):
            raise TypeError(f"{name} must be a str, not {type(given).__name__} {given!r}")
    assert isinstance(op_type, str)  # for mypy: checked just above
    if not op_type or not op_type.replace("_", "").isalnum() or not op_type[0].isalpha():
        raise MixprecError(f"malformed op type {op_type!r}")
    unknown = sorted(set(facts) - _FACTS)
    if unknown:
        raise MixprecError(
            f"unknown op fact(s) {', '.join(unknown)}; known: {', '.join(sorted(_FACTS))}"
        )
    for name in _BOOL_FACTS & set(facts):
        if not isinstance(facts[name], bool):
            raise TypeError(f"{name} must be True or False, not {facts[name]!r}")
    if "rule" in facts:
        _check_rule(facts["rule"])
    macs = facts.get("macs")
    if macs is not None and not callable(macs):
        raise TypeError(f"macs must be a function of MacArgs, not {type(macs).__name__}")
    classes = facts.get("classes", {})
    if not isinstance(classes, Mapping):
        raise TypeError(f"classes must be a dict of target to OpClass, not {classes!r}")
    for target, cls in classes.items():
        if target not in _TARGETS or not isinstance(cls, OpClass):
            raise MixprecError(
                f"classes entry {target!r}: {cls!r}: targets are float16/bfloat16, "
                "values OpClass members"
            )
    _check_indices("count_inputs", facts.get("count_inputs", frozenset()))
    layer = facts.get("layer")
    if layer is not None and layer not in LAYER_KINDS:
        raise MixprecError(f"layer must be one of {', '.join(LAYER_KINDS)} or None, not {layer!r}")
    checked = facts.get("range_checked", frozenset())
    if not isinstance(checked, frozenset) or not checked <= set(_TARGETS):
        raise MixprecError(f"range_checked must be a frozenset of targets, got {checked!r}")


def _check_indices(what: str, indices: object) -> None:
    if not isinstance(indices, frozenset) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices
    ):
        raise TypeError(f"{what} must be a frozenset of input indices: {indices!r}")


def _check_rule(rule: object) -> None:
    if rule is None:
        return
    if not isinstance(rule, OpRule):
        raise TypeError(f"rule must be an OpRule, not {type(rule).__name__} {rule!r}")
    _check_indices("OpRule keep_fp32_inputs", rule.keep_fp32_inputs)
    if rule.fp32_if is not None and not callable(rule.fp32_if):
        raise TypeError(f"OpRule fp32_if must be a function or None, not {rule.fp32_if!r}")
    for name in ("output_fp32", "fp32_upstream"):
        if not isinstance(getattr(rule, name), bool):
            raise TypeError(f"OpRule {name} must be a bool, not {getattr(rule, name)!r}")
    if not isinstance(rule.note, str):
        raise TypeError(f"OpRule note must be a str, not {rule.note!r}")


def register_op(op_type: str, *, domain: str = "", **facts: object) -> OpInfo:
    """Add or refine the entry of ``(domain, op_type)``: given facts replace old ones,
    ``classes`` entries are merged per target. Returns the new entry.

    Raises:
        TypeError: a fact of the wrong type (names it).
        MixprecError: a malformed op type, an unknown fact, an unknown target.
    """
    _check_registration(op_type, domain, facts)
    key = _key(op_type, domain)
    old = _REGISTRY.get(key, _EMPTY)
    if "classes" in facts:
        facts["classes"] = {**old.classes, **dict(facts["classes"])}  # type: ignore[call-overload]
    new = dataclasses.replace(old, **facts)  # type: ignore[arg-type]
    _REGISTRY[key] = new
    return new


def op_info(op_type: str, domain: str = "") -> OpInfo:
    """The entry of ``(domain, op_type)``; an empty entry for unknown ops."""
    return _REGISTRY.get(_key(op_type, domain), _EMPTY)


def node_info(node: ir.Node) -> OpInfo:
    return op_info(node.op_type, node.domain)


def registered() -> Iterator[tuple[tuple[str, str], OpInfo]]:
    """Every ``((domain, op_type), OpInfo)`` entry, sorted."""
    yield from sorted(_REGISTRY.items(), key=lambda item: item[0])


# --- structural facts ---------------------------------------------------------------------

for _op in ("Shape", "Size"):
    register_op(_op, shape_only=True)
for _op in ("If", "Loop", "Scan", "SequenceMap"):
    register_op(_op, control_flow=True)
for _op in (
    "QuantizeLinear",
    "DequantizeLinear",
    "QLinearConv",
    "QLinearMatMul",
    "MatMulInteger",
    "ConvInteger",
    "DynamicQuantizeLinear",
):
    register_op(_op, quantized=True)

for _op in (
    "Abs",
    "Add",
    "AveragePool",
    "BatchNormalization",
    "Ceil",
    "Clip",
    "Concat",
    "Conv",
    "ConvTranspose",
    "Cos",
    "CumSum",
    "Div",
    "Dropout",
    "Elu",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Floor",
    "Gather",
    "GatherElements",
    "GatherND",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "InstanceNormalization",
    "LayerNormalization",
    "LeakyRelu",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "MaxPool",
    "Mean",
    "Min",
    "Mish",
    "Mul",
    "Neg",
    "Pad",
    "Pow",
    "PRelu",
    "Reciprocal",
    "ReduceL2",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Resize",
    "Round",
    "Selu",
    "Sigmoid",
    "Sign",
    "Sin",
    "Slice",
    "Softmax",
    "Softplus",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "Tile",
    "Transpose",
    "Unsqueeze",
    "Where",
):
    register_op(_op, same_type=True)


# --- inputs that take a count or a shape -------------------------------------------------

for _op, _slots in {
    "Range": {0, 1, 2},  # start, limit, delta
    "Expand": {1},  # shape
    "Tile": {1},  # repeats
    "Reshape": {1},  # shape
    "ConstantOfShape": {0},  # shape
    "Slice": {1, 2, 3, 4},  # starts, ends, axes, steps
    "Resize": {3},  # sizes
    "TopK": {1},  # k
    "CumSum": {0},  # positions from durations (VITS' alignment path)
    "OneHot": {1},  # depth
    "Pad": {1},  # pads
}.items():
    register_op(_op, count_inputs=frozenset(_slots))


# --- multiply-accumulates ---------------------------------------------------------------


def _prod(dims: Sequence[int]) -> int:
    return int(np.prod(dims, dtype=np.int64))


def _conv_macs(a: MacArgs) -> int:
    y, w = a.outputs[0], a.inputs[1] if len(a.inputs) > 1 else None
    return _prod(y) * _prod(w[1:]) if y and w else 0


def _conv_transpose_macs(a: MacArgs) -> int:
    x, w = a.inputs[0], a.inputs[1] if len(a.inputs) > 1 else None
    return _prod(x) * _prod(w[1:]) if x and w else 0


def _matmul_macs(a: MacArgs) -> int:
    y, x = a.outputs[0], a.inputs[0]
    return _prod(y) * x[-1] if y and x else 0


def _gemm_macs(a: MacArgs) -> int:
    y, x = a.outputs[0], a.inputs[0]
    if not (y and x):
        return 0
    return _prod(y) * (x[0] if a.ints.get("transA", 0) else x[-1])


register_op("Conv", macs=_conv_macs, int8="weighted", layer="conv")
# ConvTranspose is a layer (BatchNormalization folds into it, smoothing scales it) but
# no INT8 role: ONNX Runtime's CPU provider has no QLinearConvTranspose kernel to fuse
# its QDQ into, so quantizing it would only add rounding.
register_op("ConvTranspose", macs=_conv_transpose_macs, layer="conv")
register_op("MatMul", macs=_matmul_macs, int8="weighted", layer="matmul")
register_op("Gemm", macs=_gemm_macs, int8="weighted", layer="dense")


# --- INT8 roles (ONNX Runtime CPU QDQ fusions) ------------------------------------------

for _op, _role in {
    "Add": "binary",
    "Mul": "binary",
    "AveragePool": "pool",
    "GlobalAveragePool": "pool",
    "Concat": "concat",
    "Sigmoid": "unary",
    "LeakyRelu": "unary",
    "MaxPool": "shared",
    "Reshape": "shared",
    "Transpose": "shared",
    "Squeeze": "shared",
    "Unsqueeze": "shared",
    "Flatten": "shared",
    "Resize": "shared",
    "Identity": "shared",
    "Relu": "absorbed",
    "Clip": "absorbed",
}.items():
    register_op(_op, int8=_role)
