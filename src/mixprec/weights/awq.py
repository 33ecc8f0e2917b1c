"""Activation-aware scaling (AWQ: Lin et al. 2024, "AWQ: Activation-aware Weight
Quantization for LLM Compression and Acceleration") before the weights are rounded.

An input channel that carries large activations makes its weights' rounding error count
more. Scaling that channel's weights up by ``s`` (and the input down by ``s``) leaves the
float product unchanged, ``x W = (x / s)(s W)``, but gives those weights a finer share of
their block's grid. Per group of MatMuls reading one input (q/k/v, gate/up), ``s`` is
``d ** alpha`` with ``d`` the input channels' RMS (``sqrt(diag(H))``, normalised by
``sqrt(max * min)``), and ``alpha`` is searched on :data:`ALPHAS` for the least output
error ``sum tr(D^T H D)`` over the group (``D = W - Q(s W) / s``, rounded to nearest as
the paper searches; 0 is plain quantization, so scaling never makes the searched error
worse).

**The fold.** ``1 / s`` goes into the op that produces the input, so the model gains no
node and its float output is unchanged up to rounding:

* a ``Mul`` by a constant along the last axis (an RMSNorm's weight): the constant;
* a ``LayerNormalization``: its scale and bias;
* a ``Mul`` of two activations where one is a MatMul's output (the gated MLP's
  ``act(gate) * up``, read by ``down_proj``): that MatMul's weight columns, and the bias
  ``Add`` after it if any.

An input produced otherwise (attention's output, read by ``o_proj``; a GELU), read by
anything but the group's MatMuls (``Shape`` aside), or whose constants are shared, is
left unscaled, and the note counts it. Each scaled group's ``H`` becomes that of the scaled input,
``H / (s s^T)``, for the rounding and the sensitivity scores that follow (made when read:
:class:`~mixprec.weights.inputs.LayerData`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from mixprec.core.ops import is_onnx_domain
from mixprec.weights.blocks import BlockSpec, quantize_rtn
from mixprec.weights.config import WeightsConfig
from mixprec.weights.inputs import LAYER_INPUTS, LayerData
from mixprec.weights.scaled import rescale
from mixprec.weights.select import WeightSource, matmul_weight, weight_decision
from mixprec.weights.slices import column_slices

__all__ = ["ALPHAS", "ScaleGroup", "scale_groups", "scale_inputs", "search_alpha"]

#: The exponents searched (0: no scaling): the quarters, then the eighths beside the best.
ALPHAS = tuple(float(a) for a in np.linspace(0.0, 1.0, 9))


@dataclasses.dataclass
class ScaleGroup:
    """The MatMuls reading one input, their weights, the input's statistics, and the
    constants ``1 / s`` folds into (each with the axis of length K)."""

    input: ir.Value
    nodes: list[ir.Node]
    sources: list[WeightSource]
    data: LayerData
    fold: list[tuple[ir.Value, int]]
    fold_kind: str


def scale_groups(model: ir.Model) -> tuple[list[ScaleGroup], dict[str, int]]:
    """The groups that can be scaled, and the count of the others by reason."""
    readers: dict[ir.Value, list[ir.Node]] = {}
    for node in model.graph:
        data = node.meta.get(LAYER_INPUTS)
        d = weight_decision(node)
        if node.op_type == "MatMul" and isinstance(data, LayerData) and d and d.quantized:
            readers.setdefault(node.inputs[0], []).append(node)  # type: ignore[arg-type]
    groups: list[ScaleGroup] = []
    skipped: dict[str, int] = {}
    for x, nodes in readers.items():
        group, why = _group(x, nodes)
        if group is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            groups.append(group)
    return groups, skipped


#: Ops that read only a value's shape: a scaled input means nothing to them.
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _group(x: ir.Value, nodes: list[ir.Node]) -> tuple[ScaleGroup | None, str]:
    readers = {id(u.node) for u in x.uses() if u.node.op_type not in _SHAPE_ONLY}
    if len(readers) != len(nodes):
        return None, "the input is read by other ops too"
    sources = []
    for node in nodes:
        source, _ = matmul_weight(node, set())
        if source is None or not _only_use(source.value, 2 if source.transposed else 1):
            return None, "a weight is shared"
        sources.append(source)
    k = sources[0].shape[0]
    fold, kind = _fold_target(x, k)
    if fold is None:
        return None, kind
    data = nodes[0].meta[LAYER_INPUTS]
    assert isinstance(data, LayerData)
    return ScaleGroup(x, nodes, sources, data, fold, kind), ""


def _only_use(value: ir.Value, most: int) -> bool:
    """``value`` is read by one node (``most`` 2: through its own Transpose)."""
    uses = list(value.uses())
    if len(uses) != 1:
        return False
    return most == 1 or len(uses[0].node.outputs[0].uses()) == 1


def _initializer(value: ir.Value | None, k: int) -> int | None:
    """The axis of length ``k`` of a one-use float initializer whose other dims are 1
    (a per-channel constant), else None."""
    if value is None or value.const_value is None or not value.is_initializer():
        return None
    shape = [int(d) for d in value.const_value.shape.numpy()]
    if not shape or shape[-1] != k or any(d != 1 for d in shape[:-1]):
        return None
    if value.const_value.dtype != ir.DataType.FLOAT or len(value.uses()) != 1:
        return None
    return len(shape) - 1


def _fold_target(x: ir.Value, k: int) -> tuple[list[tuple[ir.Value, int]] | None, str]:
    producer = x.producer()
    if producer is None or not is_onnx_domain(producer.domain):
        return None, "the input is not made by an op the scale folds into"
    if producer.op_type == "LayerNormalization":
        axis = producer.attributes.get_int("axis", -1)
        found = [(v, _initializer(v, k)) for v in producer.inputs[1:3] if v is not None]
        if axis in (-1, len(x.shape or []) - 1) and all(a is not None for _, a in found):
            return [(v, a) for v, a in found if a is not None], "LayerNormalization"
        return None, "a LayerNormalization whose scale is not a per-channel initializer"
    if producer.op_type != "Mul" or len(producer.inputs) != 2:
        return None, "the input is not made by an op the scale folds into"
    for value in producer.inputs:
        at = _initializer(value, k)
        if value is not None and at is not None:
            return [(value, at)], "a per-channel Mul (a norm's weight)"
    for value in producer.inputs:
        fold = _matmul_columns(value, k)
        if fold is not None:
            return fold, "the MatMul that makes one factor of a gated product"
    return None, "a Mul with no per-channel constant and no MatMul factor"


def _matmul_columns(value: ir.Value | None, k: int) -> list[tuple[ir.Value, int]] | None:
    """The weight columns (and bias) of the MatMul making ``value`` alone, else None."""
    if value is None or len(value.uses()) != 1:
        return None
    node = value.producer()
    bias: list[tuple[ir.Value, int]] = []
    if node is not None and node.op_type == "Add" and is_onnx_domain(node.domain):
        for i, other in ((0, 1), (1, 0)):
            axis = _initializer(node.inputs[i], k)
            made = node.inputs[other]
            if axis is not None and made is not None and len(made.uses()) == 1:
                bias, node = [(node.inputs[i], axis)], made.producer()  # type: ignore[list-item]
                break
        else:
            return None
    if node is None or node.op_type != "MatMul" or not is_onnx_domain(node.domain):
        return None
    source, _ = matmul_weight(node, set())
    if source is None or source.shape[1] != k:
        return None
    if not _only_use(source.value, 2 if source.transposed else 1):
        return None
    if not source.value.is_initializer():
        return None
    return [(source.value, 0 if source.transposed else 1), *bias]


def _rms_scales(hessian: np.ndarray, alpha: float) -> np.ndarray:
    """``d ** alpha`` normalised by ``sqrt(max * min)`` (module doc); unseen channels 1."""
    d = np.sqrt(np.maximum(np.diag(hessian), 0.0))
    seen = d > 0
    if not seen.any() or alpha == 0:
        return np.ones(len(d), np.float32)
    s = np.where(seen, d, d[seen].min()) ** alpha
    s = s / np.sqrt(s.max() * s.min())
    return s.astype(np.float32)


def search_alpha(
    weights: list[np.ndarray], hessian: np.ndarray, spec: BlockSpec
) -> tuple[float, np.ndarray, float, float]:
    """``(alpha, s, error, error at alpha 0)`` of the least summed output error (module
    doc) over ``weights`` (each ``[K, N]``) reading one input of second moment
    ``hessian``: :data:`ALPHAS`' quarters first, then the eighths beside the best. A
    large weight is read a slice of columns at a time (a memory-mapped one stays mapped)."""
    h = np.asarray(hessian, np.float32)
    errors: dict[float, tuple[np.ndarray, float]] = {}

    def error(alpha: float) -> float:
        if alpha not in errors:
            s = _rms_scales(hessian, alpha)
            total = 0.0
            for matrix in weights:  # a slice of columns at a time: the error sums columns
                for part in column_slices(*matrix.shape):
                    w = np.asarray(matrix[:, part], np.float32)
                    d = w - quantize_rtn(w * s[:, None], spec).dequantize() / s[:, None]
                    total += float(np.einsum("kn,kn->", d, h @ d))
            errors[alpha] = (s, total)
        return errors[alpha][1]

    best = min(ALPHAS[::2], key=error)
    step = ALPHAS[1]
    best = min((a for a in (best - step, best, best + step) if 0 <= a <= 1), key=error)
    s, found = errors[best]
    return best, s, found, error(0.0)


def _divide(value: ir.Value, axis: int, s: np.ndarray) -> None:
    tensor = value.const_value
    assert tensor is not None
    shape = [1] * len(tensor.shape)
    shape[axis] = len(s)
    rescale(value, s.reshape(shape), divide=True)


def _scale_weight(source: WeightSource, s: np.ndarray) -> None:
    rescale(source.value, s[None, :] if source.transposed else s[:, None])


def scale_inputs(
    model: ir.Model,
    config: WeightsConfig,
    cache: dict[str, np.ndarray] | None = None,
    say: Callable[[str], None] | None = None,
) -> list[str]:
    """Search and fold each group's scales (module doc), each searched at the bits its
    MatMuls are marked for; ``cache`` keeps the chosen ``s`` by input name across
    quantizations of one run. Returns the report's notes."""
    groups, skipped = scale_groups(model)
    cache = {} if cache is None else cache
    gains, alphas = [], []
    for group in groups:
        name = group.input.name or ""
        if name not in cache:
            weights = [src.matrix() for src in group.sources]
            alpha, s, error, plain = search_alpha(weights, group.data.hessian, _spec(group, config))
            cache[name] = s
            alphas.append(alpha)
            gains.append(error / plain if plain > 0 else 1.0)
        s = cache[name]
        if np.all(s == 1):
            continue
        for source in group.sources:
            _scale_weight(source, s)
        for value, axis in group.fold:
            _divide(value, axis, s)
        shared: dict[str, np.ndarray] = {}
        data = group.data
        total = s if data.scale is None else data.scale * s
        for node in group.nodes:  # one H (and GPTQ's factor of it), a cache each
            node.meta[LAYER_INPUTS] = LayerData(
                data.measured, data.rows, shared=shared, scale=total
            )
    if say is not None and gains:
        say(f"activation-aware scaling searched on {len(gains)} inputs")
    return [_note(groups, skipped, cache, gains, alphas)]


def _spec(group: ScaleGroup, config: WeightsConfig) -> BlockSpec:
    """The block spec of the group's fewest bits."""
    marked = [d.precision for n in group.nodes if (d := weight_decision(n)) is not None]
    return config.spec("int4" if "int4" in marked else "int8")


def _note(
    groups: list[ScaleGroup],
    skipped: dict[str, int],
    cache: dict[str, np.ndarray],
    gains: list[float],
    alphas: list[float],
) -> str:
    scaled = sum(1 for g in groups if not np.all(cache[g.input.name or ""] == 1))
    kinds = sorted({g.fold_kind for g in groups})
    text = (
        f"activation-aware scaling (AWQ): {scaled} of {len(groups) + sum(skipped.values())} "
        f"MatMul inputs scaled, folded into {'; '.join(kinds) or 'nothing'}"
    )
    if gains:
        text += (
            f"; searched output error x{float(np.median(gains)):.2f} of plain rounding "
            f"(median; alpha median {float(np.median(alphas)):.1f})"
        )
    if skipped:
        text += "; not scaled: " + "; ".join(f"{k}x {why}" for why, k in sorted(skipped.items()))
    return text
