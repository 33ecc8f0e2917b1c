"""Precision policy as data: the four op lists per target dtype and the per-op rule registry.

Nothing here touches a graph. The painter (``_paint``) reads a resolved :class:`Policy`
and the rules registered in :data:`RULES`; the rewriter (``_rewrite``) applies the result.

The four lists (names follow TensorFlow grappler's auto-mixed-precision and Intel ITEX):

* ``ALLOW``: always computed in low precision (compute-bound, numerically robust).
* ``DENY``: always FP32; the deny colour spreads downstream through INFER and CLEAR ops.
* ``INFER``: low precision only when fed by a low-precision op and not downstream of DENY.
* ``CLEAR``: precision-neutral (data movement, max/min style ops); they follow their
  neighbours so that casts are not placed around them.

An op in no list (and any op of an unknown domain) keeps its original precision; casts are
placed around it where its neighbours are in low precision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import onnx.defs
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.graphs import exclude_patterns
from mixprec.core.ops import TARGET_TYPES, parse_dtype
from mixprec.core.registry import (
    OpClass,
    OpRule,
    RuleContext,
    op_info,
    register_op,
    registered,
)
from mixprec.core.rules import RULES, register_rule, rule_for

__all__ = [
    "DEFAULT_LISTS",
    "RULES",
    "OpClass",
    "OpRule",
    "Policy",
    "RuleContext",
    "default_policy",
    "register_rule",
    "rule_for",
]


#: The fp16/bf16 targets by canonical name (one home: :mod:`mixprec.core.ops`).
TARGET_DTYPES = TARGET_TYPES


def normalize_dtype(name: str) -> str:
    """Return the canonical target dtype name ("float16" or "bfloat16"): the fp16/bf16
    spellings of :func:`~mixprec.core.ops.parse_dtype`.

    Raises:
        MixprecError: ``name`` is not a supported low-precision dtype.
    """
    return parse_dtype(name, allowed=TARGET_TYPES, what="target dtype")


# --- Default lists ------------------------------------------------------------------------
# The reason for each group is documented in docs/policy.md (generated from this table by
# `mixprec lists --markdown`); keep the two in sync by editing only this table.

_ALLOW_COMMON = (
    "Conv",
    "ConvTranspose",
    "MatMul",
    "Gemm",
    "Einsum",
)
# Elementwise arithmetic and activations: safe in low precision when their inputs already are.
_INFER_COMMON = (
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Sum",  # TF AddN
    "Mean",  # elementwise mean of inputs (not a reduction)
    "BatchNormalization",
    "InstanceNormalization",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Gelu",
    "HardSigmoid",
    "HardSwish",
    "LeakyRelu",
    "PRelu",
    "Elu",
    "Selu",
    "Celu",
    "Mish",
    "Softsign",
    "ThresholdedRelu",
    "Sqrt",
    "AveragePool",
    "GlobalAveragePool",
    "LpPool",
    "LRN",
    "Softmax",
    "LayerNormalization",  # statistics in float32 (stash_type) by the ONNX spec
    "LSTM",
    "GRU",
    "RNN",
    "Sin",
    "Cos",
)
# Data movement and value-preserving ops.
_CLEAR_COMMON = (
    "Relu",
    "Abs",
    "Neg",
    "Sign",
    "Floor",
    "Ceil",
    "Round",
    "Clip",
    "Max",
    "Min",
    "ReduceMax",
    "ReduceMin",
    "ArgMax",
    "ArgMin",
    "TopK",
    "MaxPool",
    "GlobalMaxPool",
    "MaxRoiPool",
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Concat",
    "Split",
    "Slice",
    "Gather",
    "GatherElements",
    "GatherND",
    "ScatterND",
    "ScatterElements",
    "Expand",
    "Tile",
    "Pad",
    "Identity",
    "Dropout",
    "DepthToSpace",
    "SpaceToDepth",
    "Resize",
    "Upsample",
    "Where",
    "Cast",
    "CastLike",
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "NonZero",
    "Compress",
    "ReverseSequence",
    "Trilu",
    "IsNaN",
    "IsInf",
)
# FP16 has a 5-bit exponent (max 65504): exponentials, powers, logs of small numbers,
# long accumulations and normalisations over many elements overflow or lose precision.
_DENY_FP16 = (
    "Exp",
    "Log",
    "Pow",
    "Reciprocal",
    "Softplus",
    "LogSoftmax",
    "ReduceSum",
    "ReduceMean",
    "ReduceProd",
    "ReduceSumSquare",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "CumSum",
    "GroupNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss",
    "Acos",
    "Asin",
    "Acosh",
    "Asinh",
    "Atanh",
    "Cosh",
    "Sinh",
    "Tan",
)
# BF16 keeps FP32's 8-bit exponent: overflow-prone ops (Exp, Pow, Log, Reciprocal, Softplus)
# are range-safe and become INFER; long accumulations and normalisations still lose
# precision with an 8-bit mantissa and stay DENY.
_BF16_RANGE_SAFE = ("Exp", "Log", "Pow", "Reciprocal", "Softplus")
_DENY_BF16 = tuple(op for op in _DENY_FP16 if op not in _BF16_RANGE_SAFE)


def _lists(allow: Iterable[str], deny: Iterable[str], infer: Iterable[str], clear: Iterable[str]):
    return {
        OpClass.ALLOW: frozenset(allow),
        OpClass.DENY: frozenset(deny),
        OpClass.INFER: frozenset(infer),
        OpClass.CLEAR: frozenset(clear),
    }


# fp16 DENY ops that are unsafe only through their range: with a calibration run that saw
# every tensor they touch within range, they are painted as INFER instead.
_RANGE_CHECKED_FP16 = frozenset(
    {
        "Exp",
        "Pow",
        "Reciprocal",
        "Softplus",
        "ReduceSum",
        "ReduceMean",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
    }
)
_RANGE_CHECKED = {
    "float16": _RANGE_CHECKED_FP16,
    "bfloat16": frozenset(),  # bf16 has fp32's range: its DENY ops are about precision
}

# The lists and range facts go into the op registry; the tables below are read back
# from it, so the registry is the one place that says what an op is.
for _target, _table in {
    "float16": _lists(_ALLOW_COMMON, _DENY_FP16, _INFER_COMMON, _CLEAR_COMMON),
    "bfloat16": _lists(_ALLOW_COMMON, _DENY_BF16, _INFER_COMMON + _BF16_RANGE_SAFE, _CLEAR_COMMON),
}.items():
    for _cls, _ops in _table.items():
        for _op in _ops:
            register_op(_op, classes={_target: _cls})
    for _op in _RANGE_CHECKED[_target]:
        register_op(_op, range_checked=op_info(_op).range_checked | {_target})


def _from_registry(target: str) -> dict[OpClass, frozenset[str]]:
    lists: dict[OpClass, set[str]] = {c: set() for c in OpClass if c is not OpClass.NONE}
    for (domain, op), info in registered():
        cls = info.classes.get(target)
        if domain == "" and cls is not None and cls is not OpClass.NONE:
            lists[cls].add(op)
    return {cls: frozenset(ops) for cls, ops in lists.items()}


DEFAULT_LISTS: Mapping[str, Mapping[OpClass, frozenset[str]]] = {
    target: _from_registry(target) for target in TARGET_DTYPES
}
RANGE_CHECKED: Mapping[str, frozenset[str]] = {
    target: frozenset(op for (d, op), info in registered() if target in info.range_checked)
    for target in TARGET_DTYPES
}

#: Ops that read only the shape of their input: they take any dtype, are never painted
#: and never get a cast.
SHAPE_ONLY_OPS: frozenset[str] = frozenset(
    op for (domain, op), info in registered() if domain == "" and info.shape_only
)

KNOWN_OPS: frozenset[str] = (
    frozenset(op for lists in DEFAULT_LISTS.values() for ops in lists.values() for op in ops)
    | SHAPE_ONLY_OPS
)


# --- Resolved policy ----------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A resolved policy: target dtype, the four lists, exclusions and modes.

    Build it with :func:`default_policy` and :meth:`with_changes`; it validates itself.
    """

    target: str
    lists: Mapping[OpClass, frozenset[str]]
    exclude_nodes: tuple[str, ...] = ()
    force_all: bool = False
    output_fp32_ops: frozenset[str] = field(default_factory=frozenset)
    range_checked: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.target, str) or self.target not in TARGET_DTYPES:
            raise MixprecError(
                f"Policy target must be one of {', '.join(TARGET_DTYPES)}, got {self.target!r}"
            )
        if not isinstance(self.lists, Mapping):
            raise TypeError(f"Policy lists must be a mapping, not {type(self.lists).__name__}")
        missing = [c.value for c in _LIST_CLASSES if c not in self.lists]
        if missing or any(not isinstance(c, OpClass) for c in self.lists):
            raise MixprecError(
                f"Policy lists must have one entry per OpClass (allow, deny, infer, clear); "
                f"missing: {', '.join(missing) or 'none'}"
            )
        _check_names("Policy exclude_nodes", self.exclude_nodes, tuple)
        exclude_patterns(self.exclude_nodes)
        _check_names("Policy output_fp32_ops", self.output_fp32_ops, frozenset)
        _check_names("Policy range_checked", self.range_checked, frozenset)
        if not isinstance(self.force_all, bool):
            raise TypeError(f"Policy force_all must be a bool, not {self.force_all!r}")
        seen: dict[str, OpClass] = {}
        for cls, ops in self.lists.items():
            _check_names(f"Policy {cls.value} list", ops, frozenset)
            for op in ops:
                if op in seen:
                    raise MixprecError(
                        f"op {op!r} is in both the {seen[op].value} and {cls.value} lists"
                    )
                seen[op] = cls

    @property
    def target_type(self) -> ir.DataType:
        return TARGET_DTYPES[self.target]

    def op_class(self, op_type: str) -> OpClass:
        for cls, ops in self.lists.items():
            if op_type in ops:
                return cls
        return OpClass.NONE

    def with_changes(
        self,
        add: Mapping[OpClass, Iterable[str]] | None = None,
        remove: Mapping[OpClass, Iterable[str]] | None = None,
        *,
        exclude_nodes: Iterable[str] = (),
        force_all: bool | None = None,
        output_fp32_ops: Iterable[str] = (),
    ) -> Policy:
        """Return a new policy with ops added to / removed from lists.

        An op added to a list leaves the list it was in. Removing an op that is not in
        that list is an error, as is an op name that is not a plausible ONNX op type.
        """
        lists = {cls: set(ops) for cls, ops in self.lists.items()}
        for cls, ops in (remove or {}).items():
            for op in ops:
                _check_op_name(op)
                if op not in lists[cls]:
                    raise MixprecError(f"cannot remove {op!r} from the {cls.value} list: not in it")
                lists[cls].discard(op)
        for cls, ops in (add or {}).items():
            for op in ops:
                _check_op_name(op)
                for other in lists.values():
                    other.discard(op)
                lists[cls].add(op)
        output_fp32_ops = tuple(output_fp32_ops)
        for op in output_fp32_ops:
            _check_op_name(op)
        return Policy(
            target=self.target,
            lists={cls: frozenset(ops) for cls, ops in lists.items()},
            exclude_nodes=self.exclude_nodes + tuple(exclude_nodes),
            force_all=self.force_all if force_all is None else force_all,
            output_fp32_ops=self.output_fp32_ops | frozenset(output_fp32_ops),
            range_checked=self.range_checked,
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "target": self.target,
            **{cls.value: sorted(ops) for cls, ops in self.lists.items()},
            "exclude_nodes": list(self.exclude_nodes),
            "force_all": self.force_all,
            "output_fp32_ops": sorted(self.output_fp32_ops),
            "range_checked": sorted(self.range_checked),
            "rules": {
                f"{domain or 'ai.onnx'}::{op}": rule.note for (domain, op), rule in RULES.items()
            },
        }


_LIST_CLASSES = (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR)


def _check_names(what: str, names: object, kind: type) -> None:
    if not isinstance(names, kind):
        raise TypeError(f"{what} must be a {kind.__name__} of str, not {type(names).__name__}")
    for name in names:  # type: ignore[attr-defined]
        if not isinstance(name, str):
            raise TypeError(f"{what} must hold str, got {name!r}")


def _check_op_name(op: str) -> None:
    if not isinstance(op, str):
        raise TypeError(f"op types must be str, got {op!r}")
    if not op or not op.replace("_", "").isalnum() or not op[0].isalpha():
        raise MixprecError(f"malformed op type {op!r}")
    if op in KNOWN_OPS or onnx.defs.has(op):
        return
    raise MixprecError(
        f"unknown op type {op!r}: not an ONNX operator (names are case-sensitive, e.g. MatMul)"
    )


def default_policy(target: str) -> Policy:
    """The default policy for ``target`` ("float16"/"fp16" or "bfloat16"/"bf16")."""
    target = normalize_dtype(target)
    return Policy(
        target=target, lists=dict(DEFAULT_LISTS[target]), range_checked=RANGE_CHECKED[target]
    )
