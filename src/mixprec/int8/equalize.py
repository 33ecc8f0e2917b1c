"""Cross-layer equalization with high-bias absorption (Nagel et al. 2019, "Data-Free
Quantization Through Weight Equalization and Bias Correction", sections 4.1 and 4.2).

Two weighted layers joined by ops that commute with a positive per-channel scale
(``f(x / s) = f(x) / s``: ReLU, PReLU, LeakyReLU, ``Clip(0, inf)``, pools, Identity,
Mul/Div by a constant, Add/Sub of a per-channel constant) compute the same function when
output channel ``i`` of the first is divided by ``s_i`` and input channel ``i`` of the
second multiplied by it. With ``r1_i`` and ``r2_i`` the ranges (max ``|w|``) of those
channels, ``s_i = sqrt(r1_i / r2_i)`` gives both the range ``sqrt(r1_i * r2_i)``: a
channel that used a sliver of a per-tensor INT8 grid now uses as much of it as the rest.
Chains (Conv -> DWConv -> Conv) are swept pair by pair until the scales settle.

What ends a chain, with its reason in :attr:`EqualizeLayersResult.skipped`:

- ``Clip`` with a finite bound (ReLU6), HardSwish/HardSigmoid and other ops that do not
  commute with a per-channel scale. Nagel et al. replace ReLU6 by ReLU before equalizing,
  which changes the FP32 model; here the FP32 function stays exact, so the chain stops;
- a value read by more than one node (branches, residual adds), a weight or bias shared
  with another node (tied weights are never rescaled), a non-float32 or non-constant
  weight, a Conv feeding a Gemm/MatMul (their channel layouts differ), a batched MatMul
  weight, ConvTranspose with groups.

High-bias absorption: equalizing divides a bias by ``s_i`` too, and a channel that ReLU
always passes may end up carrying a large constant the next layer's activation range must
hold. Where the first layer had a BatchNormalization folded into it (its output is then
``N(beta, gamma^2)`` per channel: :data:`~mixprec.passes.fold.BN_STATS`, data-free, as the
paper does), ``c = max(0, beta - 3 gamma)`` (after the scale and any constant Mul/Add
before the activation) moves from the first layer's bias into the second's
(``b2 += W2 c``): exact wherever the pre-activation is at least ``c`` (99.87% of a normal
channel), so the FP32 model changes only in the tail. It needs a ReLU-like op between,
only max/global pools after it, and a consumer whose bias is added everywhere (a Conv
without padding, a Gemm with ``alpha = beta = 1``).

Subgraphs are handled like the main graph (pairs never cross a graph); model functions
are inlined by the prepare stage before this pass runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import UniqueNames, add_initializer, all_graphs
from mixprec.core.ops import trans_b
from mixprec.int8.chains import DEAD_RANGE, Layer, Link, Pair, channel_spread, find_pairs
from mixprec.passes.fold import BN_STATS

__all__ = ["EqualizeLayersPass", "EqualizeLayersResult"]

_MAX_SWEEPS = 100
_TOLERANCE = 1e-4  # max |log s| of a sweep at which the scales have settled
_SIGMAS = 3.0  # high-bias absorption keeps c below the pre-activation's mean - 3 std


@dataclasses.dataclass
class EqualizeLayersResult(ir.passes.PassResult):
    """What :class:`EqualizeLayersPass` did.

    Attributes:
        pairs: the equalized (first, second) node names, in graph order.
        sweeps: passes over all pairs until the scales settled.
        spread: node name -> (before, after) of :func:`channel_spread` of its weight.
        absorbed: node name of a pair's first layer -> channels whose bias moved on.
        skipped: node name -> why it starts no pair (only ops that could have).
    """

    pairs: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    sweeps: int = 0
    spread: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    absorbed: dict[str, int] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        """The report's numbers: pairs, sweeps, median and worst spread before/after."""
        before = [b for b, _ in self.spread.values()]
        after = [a for _, a in self.spread.values()]
        return {
            "pairs": len(self.pairs),
            "sweeps": self.sweeps,
            "spread_median": [_median(before), _median(after)],
            "spread_max": [max(before, default=1.0), max(after, default=1.0)],
            "bias_absorbed_channels": sum(self.absorbed.values()),
            "skipped": len(self.skipped),
        }

    def note(self) -> str:
        """One line for the report's notes."""
        spread = [_median([pair[k] for pair in self.spread.values()]) for k in (0, 1)]
        return (
            f"cross-layer equalization: {len(self.pairs)} layer pair(s); weight channel range "
            f"spread (median of max/min) {spread[0]:.1f} -> {spread[1]:.1f}; "
            f"{sum(self.absorbed.values())} bias channel(s) absorbed"
        )


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else 1.0


class EqualizeLayersPass(ir.passes.InPlacePass):
    """Cross-layer equalization of Conv/Gemm/MatMul pairs, then high-bias absorption.

    The FP32 function is unchanged (up to float32 rounding of the rescaled weights), except
    for the absorbed biases' tail (see the module docstring). ``modified`` is True when a
    weight, bias or constant was rewritten.

    Args:
        absorb_bias: move the constant part of channels ReLU always passes into the next
            layer's bias, where folded BatchNormalization statistics say what it is.

    Example:
        >>> result = EqualizeLayersPass()(model)          # doctest: +SKIP
        >>> result.pairs, result.summary()["spread_median"]  # doctest: +SKIP
    """

    def __init__(self, *, absorb_bias: bool = True) -> None:
        super().__init__()
        self.absorb_bias = absorb_bias

    def call(self, model: ir.Model) -> EqualizeLayersResult:
        result = EqualizeLayersResult(model, modified=False)
        pairs: list[Pair] = []
        for graph in all_graphs(model.graph):
            pairs += find_pairs(graph, result.skipped)
        if not pairs:
            return result
        before = {id(p): _spreads(p) for p in pairs}
        result.sweeps = _equalize(pairs)
        if self.absorb_bias:
            for pair in pairs:
                count = _absorb(pair, result.skipped)
                if count:
                    result.absorbed[pair.first.node.name or ""] = count
        names = UniqueNames(model)
        for pair in pairs:
            result.pairs.append((pair.first.node.name or "", pair.second.node.name or ""))
            for layer, old in zip((pair.first, pair.second), before[id(pair)], strict=True):
                spread = channel_spread(layer.weight, layer.out_axis)
                result.spread[layer.node.name or ""] = (old, spread)
            result.modified |= _write_links(pair, names)
        for layer in _unique_layers(pairs):
            result.modified |= _write_layer(layer, names)
        return result


def _spreads(pair: Pair) -> tuple[float, float]:
    return (
        channel_spread(pair.first.weight, pair.first.out_axis),
        channel_spread(pair.second.weight, pair.second.out_axis),
    )


def _unique_layers(pairs: list[Pair]) -> Iterator[Layer]:
    seen: set[int] = set()
    for pair in pairs:
        for layer in (pair.first, pair.second):
            if id(layer) not in seen:
                seen.add(id(layer))
                yield layer


# --- equalizing ----------------------------------------------------------------------------


def _scales(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """``s_i = sqrt(r1_i / r2_i)``; 1 for a channel either side barely uses."""
    live = (r1 > DEAD_RANGE * r1.max(initial=0.0)) & (r2 > DEAD_RANGE * r2.max(initial=0.0))
    s = np.ones_like(r1)
    s[live] = np.sqrt(r1[live] / r2[live])
    return s


def _equalize(pairs: list[Pair]) -> int:
    """Sweep the pairs until no scale moves by more than :data:`_TOLERANCE`; the sweeps."""
    for sweep in range(1, _MAX_SWEEPS + 1):
        worst = 0.0
        for pair in pairs:
            s = _scales(pair.first.out_ranges(), pair.second.in_ranges())
            if np.all(s == 1.0):
                continue
            pair.first.scale_out(s)
            pair.second.scale_in(s)
            pair.scale = pair.scale * s
            worst = max(worst, float(np.abs(np.log(s)).max()))
        if worst < _TOLERANCE:
            return sweep
    return _MAX_SWEEPS


# --- high-bias absorption ------------------------------------------------------------------


def _absorb(pair: Pair, skipped: dict[str, str]) -> int:
    """Move ``c = max(0, mean - 3 std)`` of the pre-activation from the first layer's bias
    into the second's; the number of channels moved."""
    stats = pair.first.node.meta.get(BN_STATS)
    if stats is None or pair.first.node.op_type == "MatMul":
        return 0
    mean, std = (np.asarray(a, np.float64).reshape(-1) / pair.scale for a in stats)
    affine = _pre_activation(pair.links, pair.first.channels)
    if affine is None:
        return 0
    alpha, beta = affine
    c = np.maximum(0.0, alpha * mean + beta - _SIGMAS * np.abs(alpha) * std)
    c[alpha == 0] = 0.0
    if not np.any(c > 0):
        return 0
    shift = _input_shift(pair.second, c)
    if isinstance(shift, str):
        skipped.setdefault(pair.first.node.name or "", f"bias not absorbed: {shift}")
        return 0
    first, second = pair.first, pair.second
    first.bias = (first.bias if first.bias is not None else 0.0) - c / np.where(
        alpha == 0, 1.0, alpha
    )
    second.bias = (second.bias if second.bias is not None else 0.0) + shift
    first.changed = second.changed = True
    return int(np.count_nonzero(c))


def _pre_activation(links: list[Link], channels: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(alpha, beta)`` with pre-activation ``= alpha * y + beta`` per channel when the
    links are constant Mul/Add ops, one ReLU-like op, then shift-commuting pools; else None."""
    alpha: np.ndarray | float = 1.0
    beta: np.ndarray | float = 0.0
    active = False
    for link in links:
        if active:
            if link.kind in ("pool", "identity") and link.shifts:
                continue
            return None
        if link.kind == "act":
            active = True
        elif link.kind in ("scale", "shift") and link.const is not None:
            alpha, beta = _through(link, alpha, beta)
        elif link.kind != "identity":
            return None
    if not active:
        return None
    return np.broadcast_to(alpha, channels).copy(), np.broadcast_to(beta, channels).copy()


def _through(
    link: Link, alpha: np.ndarray | float, beta: np.ndarray | float
) -> tuple[np.ndarray | float, np.ndarray | float]:
    k = link.const
    assert k is not None
    op = link.node.op_type
    if op == "Mul":
        return alpha * k, beta * k
    if op == "Div":
        return alpha / k, beta / k
    if op == "Add":
        return alpha, beta + k
    if link.index == 1:  # Sub(y, k)
        return alpha, beta - k
    return -alpha, k - beta  # Sub(k, y)


def _input_shift(layer: Layer, c: np.ndarray) -> np.ndarray | str:
    """What ``layer``'s bias gains when its input channels lose ``c``: ``W c``."""
    node, w = layer.node, layer.weight
    if node.op_type == "Conv":
        pads = node.attributes.get("pads")
        auto = node.attributes.get("auto_pad")
        if (pads is not None and any(pads.as_ints())) or (
            auto is not None and auto.as_string() not in ("NOTSET", "VALID")
        ):
            return "the next Conv pads its input (a shifted border would differ)"
        out, per_group = w.shape[:2]
        summed = w.reshape(out, per_group, -1).sum(axis=2)
        return (summed * c[layer.in_index().reshape(out, per_group)]).sum(axis=1)
    if node.op_type == "Gemm":
        alpha = node.attributes.get("alpha")
        beta = node.attributes.get("beta")
        if any(a is not None and a.as_float() != 1.0 for a in (alpha, beta)):
            return "the next Gemm has alpha or beta other than 1"
        return w @ c if trans_b(node) else c @ w
    return f"the next {node.op_type} has no bias input"


# --- writing -------------------------------------------------------------------------------


def _write_links(pair: Pair, names: UniqueNames) -> bool:
    """Divide the Add/Sub constants between the layers by the pair's scale."""
    if np.all(pair.scale == 1.0):
        return False
    changed = False
    for link in pair.links:
        if link.kind != "shift" or link.const is None:
            continue
        value = link.node.inputs[link.index]
        assert value is not None
        old = const_tensor(value)
        assert old is not None
        rank = max(old.numpy().ndim, -pair.axis)
        shape = [1] * rank
        shape[pair.axis] = -1
        array = (link.const / pair.scale).reshape(shape).astype(np.float32)
        graph = link.node.graph
        assert graph is not None
        new = add_initializer(graph, names, f"{value.name or 'shift'}_equalized", array)
        link.node.replace_input_with(link.index, new)
        changed = True
    return changed


def _write_layer(layer: Layer, names: UniqueNames) -> bool:
    """Hand ``layer``'s node its new weight and bias (new initializers)."""
    if not layer.changed:
        return False
    node, graph = layer.node, layer.node.graph
    assert graph is not None
    base = node.name or node.op_type
    weight = add_initializer(graph, names, f"{base}_W_equalized", layer.weight.astype(np.float32))
    node.replace_input_with(1, weight)
    if layer.bias is not None and node.op_type != "MatMul":
        bias = np.asarray(layer.bias, np.float64).reshape(-1).astype(np.float32)
        value = add_initializer(graph, names, f"{base}_B_equalized", bias)
        if len(node.inputs) < 3:
            node.resize_inputs(3)
        node.replace_input_with(2, value)
    return True
