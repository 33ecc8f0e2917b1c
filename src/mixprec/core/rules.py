"""The conditional rules: when an op that its list would paint low stays FP32, and why.

Each rule is data in the op registry (:class:`~mixprec.core.registry.OpRule`, keyed by
(domain, op_type)): inputs that always stay float32, and a condition that turns a node into
a DENY seed with the reason it returns. :data:`RULES` is a read-only view of them, and
:func:`register_rule` adds or replaces one (``mixprec.register_rule``). ``mixprec lists``
prints every rule's note.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.ops import is_onnx_domain
from mixprec.core.registry import (
    DEFAULT_RULE,
    OpRule,
    RuleContext,
    node_info,
    register_op,
    registered,
)

__all__ = ["RULES", "register_rule", "rule_for"]


class _RulesView(Mapping[tuple[str, str], OpRule]):
    """The registered rules by (domain, op_type): a read-only view of the op registry."""

    def _rules(self) -> dict[tuple[str, str], OpRule]:
        return {key: info.rule for key, info in registered() if info.rule is not None}

    def __getitem__(self, key: tuple[str, str]) -> OpRule:
        return self._rules()[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._rules())

    def __len__(self) -> int:
        return len(self._rules())


RULES: Mapping[tuple[str, str], OpRule] = _RulesView()


def register_rule(op_type: str, rule: OpRule, *, domain: str = "") -> None:
    """Register (or replace) the rule for ``(domain, op_type)`` in the op registry.

    Raises:
        TypeError: ``rule`` is not an :class:`OpRule`, or a name is not a str.
        MixprecError: an empty or malformed op type.
    """
    if not isinstance(rule, OpRule):
        raise TypeError(f"rule must be an OpRule, not {type(rule).__name__} {rule!r}")
    register_op(op_type, domain=domain, rule=rule)


def rule_for(node: ir.Node) -> OpRule:
    """Return the rule registered for ``node``'s op, or :data:`DEFAULT_RULE`."""
    return node_info(node).rule or DEFAULT_RULE


def _const_array(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = const_tensor(value)
    if tensor is None:
        return None
    try:
        return tensor.numpy()
    except Exception:  # pragma: no cover - exotic tensor kinds
        return None


def _pow_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    if ctx.target != "float16":
        return None
    exponent = _const_array(node.inputs[1] if len(node.inputs) > 1 else None)
    if exponent is None:
        return "Pow with a non-constant exponent can overflow float16"
    if exponent.size and float(np.max(np.abs(exponent.astype(np.float64)))) > 2.0:
        return f"Pow exponent {float(np.max(np.abs(exponent))):g} > 2 can overflow float16"
    return None


def _reduced_count(node: ir.Node, ctx: RuleContext) -> int | None:
    """Number of elements reduced into each output element, from known shapes."""
    dims = ctx.shape(node.inputs[0] if node.inputs else None)
    if dims is None:
        return None
    axes_attr = node.attributes.get("axes")
    axes: list[int] | None = None
    if axes_attr is not None:
        axes = list(axes_attr.as_ints())
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = _const_array(node.inputs[1])
        if arr is None:
            return None
        axes = [int(a) for a in arr.reshape(-1)]
    if not axes:
        noop = node.attributes.get("noop_with_empty_axes")
        if noop is not None and noop.as_int():
            return 1
        axes = list(range(len(dims)))
    count = 1
    for a in axes:
        d = dims[a % len(dims)]
        if d is None:
            return None
        count *= int(d)
    return count


_MAX_REDUCED = {"float16": 4096, "bfloat16": 256}


def _reduce_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    limit = _MAX_REDUCED[ctx.target]
    count = _reduced_count(node, ctx)
    if count is None:
        return f"{node.op_type} over axes of unknown length"
    if count > limit:
        return f"{node.op_type} accumulates {count} elements (> {limit} for {ctx.target})"
    return None


_MAX_SOFTMAX_AXIS = {"float16": 8192, "bfloat16": 8192}


def _softmax_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    if ctx.target == "bfloat16":
        # bf16 probabilities keep 2-3 significant digits; OpenVINO's own bf16 keeps
        # Softmax in f32 too (MTCNN R-Net's face scores: rel L2 0.0022 bf16 vs 0.0009)
        return "Softmax in bf16 keeps 2-3 significant digits of each probability"
    shape = ctx.shape(node.inputs[0] if node.inputs else None)
    if not shape:
        return "Softmax over an axis of unknown length"
    axis_attr = node.attributes.get("axis")
    default_axis = -1 if ctx.opset >= 13 else 1
    axis = axis_attr.as_int() if axis_attr is not None else default_axis
    rank = len(shape)
    dims = shape[axis % rank :] if ctx.opset < 13 else [shape[axis % rank]]
    if not all(isinstance(d, int) for d in dims):
        return "Softmax over an axis of unknown length"
    width = int(np.prod([int(d) for d in dims if d is not None]))
    if width > _MAX_SOFTMAX_AXIS[ctx.target]:
        return f"Softmax over {width} elements (> {_MAX_SOFTMAX_AXIS[ctx.target]})"
    return None


register_rule(
    "Resize",
    OpRule(frozenset({1, 2}), note="roi and scales stay float32 (sizes are int64)"),
)
register_rule("Upsample", OpRule(frozenset({1}), note="scales stays float32"))
register_rule(
    "Pow",
    OpRule(fp32_if=_pow_condition, note="fp16: FP32 when the exponent is not a constant <= 2"),
)
for _op in ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2"):
    register_rule(
        _op,
        OpRule(
            fp32_if=_reduce_condition,
            note="FP32 when it accumulates > 4096 (fp16) / 256 (bf16) elements",
        ),
    )
register_rule(
    "Softmax",
    OpRule(
        fp32_if=_softmax_condition,
        note="FP32 in bf16; in fp16 when the axis is unknown or > 8192 wide",
    ),
)


def _bf16_inexact(array: np.ndarray) -> bool:
    """Whether a float constant changes when rounded to bfloat16."""
    values = array.astype(np.float32)
    return bool(np.any(values.astype(ml_dtypes.bfloat16).astype(np.float32) != values))


def _affine_constant_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    """bf16: an element-wise affine op with a constant operand stays FP32 when bf16
    cannot hold the constant exactly (or it divides): unlike a weight's rounding, which
    averages out over a dot product, a rounded scale or shift is the same error on every
    element (1/6 -> 0.16699, +0.2%), and a chain of them after every Conv (folded
    normalisations, HardSwish's x * (x + 3) / 6) compounds. OpenVINO's blanket bf16
    runs such chains in f32, fused into the Conv before its output is rounded."""
    if ctx.target != "bfloat16":
        return None
    for index, value in enumerate(node.inputs):
        array = _const_array(value)
        if array is None or array.dtype.kind != "f" or array.size == 0:
            continue
        if node.op_type == "Div" and index == 1:
            return "Div by a constant: bf16 rounds the quotient of every element"
        if _bf16_inexact(array):
            shown = float(array.reshape(-1)[0])
            return (
                f"{node.op_type} by a constant bf16 cannot hold exactly ({shown:.6g} -> "
                f"{float(np.float32(shown).astype(ml_dtypes.bfloat16)):.6g}): the same error "
                "on every element"
            )
    return None


for _op in ("Add", "Sub", "Mul", "Div", "BatchNormalization"):
    register_rule(
        _op,
        OpRule(
            fp32_if=_affine_constant_condition,
            note="bf16: FP32 when a constant operand is not exact in bf16, or divides",
        ),
    )


def _stash_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    stash = node.attributes.get("stash_type")
    if stash is not None and stash.as_int() != ir.DataType.FLOAT:
        return "LayerNormalization with a stash_type other than float32"
    return None


register_rule(
    "LayerNormalization",
    OpRule(
        fp32_if=_stash_condition,
        note="low precision computes its statistics in float32 (stash_type=1, the default)",
    ),
)


# --- a float rounded into a count or a shape ----------------------------------------------

#: Ops that hand a rounded count on (arithmetic on it, moving or summing it): the count
#: rule follows a rounded value through them to an input that takes a count
#: (``OpInfo.count_inputs``: Range, Expand, Tile, Reshape's shape, ConstantOfShape,
#: Slice's bounds, Resize's sizes, TopK's k, CumSum, OneHot's depth, Pad's pads).
_COUNT_CARRIERS = frozenset(
    {
        "Abs", "Add", "Cast", "CastLike", "Ceil", "Clip", "Concat", "Div", "Expand",
        "Flatten", "Floor", "Gather", "Identity", "Max", "Min", "Mul", "Neg", "ReduceMax",
        "ReduceMin", "ReduceSum", "Relu", "Reshape", "Round", "Slice", "Split", "Squeeze",
        "Sub", "Sum", "Tile", "Transpose", "Unsqueeze",
    }
)  # fmt: skip
#: How many ops the rule follows a rounded value through.
_COUNT_DEPTH = 16


def _count_reader(node: ir.Node) -> str | None:
    """The first input downstream of ``node`` (through :data:`_COUNT_CARRIERS`) that
    takes a count, as ``"Range 'frames' (input 1)"``; None when there is none."""
    seen = {node}
    frontier = [node]
    for _ in range(_COUNT_DEPTH):
        following: list[ir.Node] = []
        for current in frontier:
            for out in current.outputs:
                for use in out.uses():
                    user = use.node
                    if not is_onnx_domain(user.domain):
                        continue
                    if use.idx in node_info(user).count_inputs:
                        return f"{user.op_type} {user.name!r} (input {use.idx})"
                    if user.op_type in _COUNT_CARRIERS and user not in seen:
                        seen.add(user)
                        following.append(user)
        if not following:
            return None
        frontier = following
    return None


def _count_condition(node: ir.Node, ctx: RuleContext) -> str | None:
    """Ceil, Floor, Round, or a Cast from float to an integer type, whose result a
    count input reads: a rounding of the value before it moves the count by one (fp16
    holds 10.001 as 10: Ceil gives 10, not 11), and with it an output's length."""
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        source = node.inputs[0] if node.inputs else None
        if (
            to is None
            or source is None
            or source.dtype is None
            or not source.dtype.is_floating_point()
            or not ir.DataType(to.as_int()).is_integer()
        ):
            return None
    reader = _count_reader(node)
    if reader is None:
        return None
    return f"decides a count: rounded into {reader}"


for _op in ("Ceil", "Floor", "Round", "Cast"):
    _what = "it casts a float to an integer that" if _op == "Cast" else "its result"
    register_rule(
        _op,
        OpRule(
            fp32_if=_count_condition,
            fp32_upstream=True,
            note=(
                f"decides a count: FP32, with the float path that feeds only it, when {_what} "
                "reaches a count or shape input (Range, Expand, Tile, Reshape, Slice, "
                "ConstantOfShape, Resize sizes, TopK k, CumSum, OneHot, Pad)"
            ),
        ),
    )
