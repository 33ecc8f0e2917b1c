"""Layer sensitivity to 4 bits and the mixed 4/8-bit choice.

**The score.** A linear layer ``y = x W`` quantized to ``Q`` adds ``x (W - Q)`` to its
output; over the calibration rows its mean squared size is ``tr(D^T H D)`` with
``D = W - Q`` and ``H = X^T X / n`` (:mod:`mixprec.weights.stats`): the exact output error
of that layer alone, not an approximation. A layer's **gain** is what 8 bits saves of it,
``E(Q4) - E(Q8)``, with ``Q4`` the run's method (GPTQ's own result where it runs, kept for
the rewrite) and ``Q8`` round to nearest; its **score** is the gain per weight (what one
more byte at 8 bits buys), and layers rank by it, most sensitive first. Without data
``H`` is the identity (the weights' own error, NNCF's data-free criterion).

**Mixed bits.** ``ratio`` (the share of linear-layer weights left at 4 bits, NNCF's
meaning) moves the highest scores to 8 bits while at most ``1 - ratio`` of the weights are.
Without ``ratio`` (the default) the choice comes from the scores: the layers whose score
is more than :data:`OUTLIER` times the median go to 8 bits, highest first, while the model
stays within :data:`SIZE_GOAL` of its float size (the lm_head and embeddings count).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.errors import MixprecError
from mixprec.io.external import clone_model, release_mapped_pages
from mixprec.io.feeds import Feeds
from mixprec.weights.blocks import BlockSpec
from mixprec.weights.config import WeightsConfig
from mixprec.weights.methods import LAYER_INPUTS, METHODS, LayerData, WeightMethod
from mixprec.weights.select import (
    WEIGHTS,
    SelectWeightsPass,
    WeightDecision,
    WeightSource,
    matmul_weight,
    weight_decision,
)
from mixprec.weights.slices import digest_in_slices, errors_in_slices
from mixprec.weights.stats import (
    Hessians,
    WeightsData,
    attach_hessians,
    collect_hessians,
    hessian_inputs,
)

__all__ = [
    "OUTLIER",
    "SIZE_GOAL",
    "LayerScore",
    "MixedChoice",
    "choose_mixed",
    "layer_scores",
    "packed_bytes",
    "plan_layers",
    "rank_layers",
]

#: The default mixed choice keeps at 8 bits the layers scoring above this many times the
#: median score (module doc).
OUTLIER = 4.0
#: The default mixed choice keeps the model within this share of its float size.
SIZE_GOAL = 0.35


@dataclasses.dataclass(frozen=True)
class LayerScore:
    """One linear layer's sensitivity: ``error4`` / ``error8`` the mean squared output
    error at 4 / 8 bits, ``weights`` its K*N, ``score`` (error4 - error8) / weights."""

    name: str
    error4: float
    error8: float
    weights: int

    @property
    def score(self) -> float:
        return max(self.error4 - self.error8, 0.0) / max(self.weights, 1)


def packed_bytes(k: int, n: int, spec: BlockSpec) -> int:
    """Bytes of a ``[K, N]`` weight as MatMulNBits stores it (codes, scales, zero points)."""
    blocks = -(-k // spec.block_size)
    codes = n * blocks * spec.block_size * spec.bits // 8
    zero = 0 if spec.symmetric else n * -(-blocks * spec.bits // 8)
    return codes + 4 * n * blocks + zero


def _error(weight: np.ndarray, quant: np.ndarray, hessian: np.ndarray | None) -> float:
    d = (weight - quant).astype(np.float64)
    if hessian is None:
        return float(np.sum(d * d))
    return float(np.sum(d * (hessian @ d)))


def layer_scores(model: ir.Model, config: WeightsConfig, method: WeightMethod) -> list[LayerScore]:
    """The score of each MatMul the select pass put at 4 bits as a plain linear layer
    (module doc), most sensitive first; the ``LayerData`` recorded on a node (its ``H``
    and the cache of quantizations) is used where present."""
    scores = []
    inputs = set(model.graph.inputs)
    for node in model.graph:
        d = weight_decision(node)
        if node.op_type != "MatMul" or d is None or d.role != "linear" or d.precision != "int4":
            continue
        source, _ = matmul_weight(node, inputs)
        if source is None:
            continue
        data = node.meta.get(LAYER_INPUTS)
        matrix = source.matrix()
        if isinstance(data, LayerData):
            error4, error8 = _errors(matrix.astype(np.float32), config, method, data)
        else:
            error4, error8 = _data_free(model, matrix, config, method)
        k, n = matrix.shape
        scores.append(LayerScore(node.name or "", error4, error8, k * n))
    return sorted(scores, key=lambda s: -s.score)


#: Data-free (error4, error8) by weight digest, shape, method and specs: a repair
#: quantizes the model several times and scores the same weights each time.
_DATA_FREE: dict[tuple[object, ...], tuple[float, float]] = {}
_DATA_FREE_MOST = 1 << 16


def _data_free(
    model: ir.Model, matrix: np.ndarray, config: WeightsConfig, method: WeightMethod
) -> tuple[float, float]:
    """(error4, error8) of a weight without data, cached: the same weight scores the same
    in every requantization. Read a slice of columns at a time (a large weight of a
    memory-mapped model stays out of memory: :mod:`mixprec.weights.slices`)."""
    release = functools.partial(release_mapped_pages, model)
    digest = digest_in_slices(matrix, release)
    key = (digest, matrix.shape, method.name, config.spec("int4"), config.spec("int8"))
    if key not in _DATA_FREE:
        if len(_DATA_FREE) >= _DATA_FREE_MOST:
            _DATA_FREE.clear()
        _DATA_FREE[key] = errors_in_slices(
            matrix, lambda w: _errors(w, config, method, None), release
        )
    return _DATA_FREE[key]


def _errors(
    weight: np.ndarray, config: WeightsConfig, method: WeightMethod, data: LayerData | None
) -> tuple[float, float]:
    """The layer's output error at 4 bits (the run's method) and 8 bits (RTN)."""
    hessian = data.hessian if data is not None else None
    q4 = method.quantize(weight, config.spec("int4"), data).dequantize()
    q8 = METHODS["rtn"].quantize(weight, config.spec("int8"), data).dequantize()
    return _error(weight, q4, hessian), _error(weight, q8, hessian)


@dataclasses.dataclass(frozen=True)
class MixedChoice:
    """The layers moved to 8 bits and why, and the estimated parameter bytes."""

    int8: dict[str, str]
    rule: str
    bytes_before: int
    bytes_after: int


def _float_bytes(model: ir.Model) -> int:
    return sum(t.nbytes for v in model.graph.initializers.values() if (t := const_tensor(v)))


def _estimate(model: ir.Model, config: WeightsConfig, moved: set[str]) -> int:
    """Parameter bytes after quantizing as decided (``moved``: also at 8 bits)."""
    total = _float_bytes(model)
    seen: set[tuple[ir.Value, str]] = set()
    inputs = set(model.graph.inputs)
    for node in model.graph:
        d = weight_decision(node)
        if d is None or not d.quantized:
            continue
        precision = "int8" if node.name in moved else d.precision
        if node.op_type == "MatMul":
            source, _ = matmul_weight(node, inputs)
        else:
            source = WeightSource(node.inputs[0], True) if node.inputs[0] else None
        if source is None or (source.value, precision) in seen:
            continue
        first = not any(v is source.value for v, _ in seen)
        seen.add((source.value, precision))
        k, n = source.shape
        total += packed_bytes(k, n, config.spec(precision)) - (4 * k * n if first else 0)
    return total


def choose_mixed(
    model: ir.Model, config: WeightsConfig, scores: Sequence[LayerScore]
) -> MixedChoice:
    """Move the most sensitive layers to 8 bits (module doc): records each one's
    decision (int8, with its score as the reason) and returns what was moved. Layers a
    ``layers=`` map names are left as it says."""
    before = _float_bytes(model)
    free = [s for s in scores if s.name not in config.layers]
    total = sum(s.weights for s in free)
    moved: dict[str, str] = {}
    if config.ratio is not None:
        rule = f"ratio {config.ratio:g}: {1 - config.ratio:.0%} of linear weights at 8 bits"
        budget = (1.0 - config.ratio) * total
        spent = 0
        for s in free:  # at most 1 - ratio of the weights at 8 bits
            if spent + s.weights <= budget + 1e-9:
                spent += s.weights
                moved[s.name] = f"8 bits by sensitivity (score {s.score:.3g}, {rule})"
    else:
        median = float(np.median([s.score for s in free])) if free else 0.0
        goal = SIZE_GOAL * before
        rule = f"score > {OUTLIER:g}x the median {median:.3g}, within {SIZE_GOAL:g}x float size"
        for s in free:
            if s.score <= OUTLIER * median:
                break
            if _estimate(model, config, {*moved, s.name}) > goal:
                continue
            moved[s.name] = f"8 bits by sensitivity (score {s.score:.3g} > {OUTLIER:g}x median)"
    for node in model.graph:
        if node.name in moved:
            d = weight_decision(node)
            assert d is not None
            node.meta[WEIGHTS] = WeightDecision("int8", d.role, moved[node.name], d.table)
    return MixedChoice(moved, rule, before, _estimate(model, config, set()))


def rank_layers(
    model: ir.Model | onnx.ModelProto,
    config: WeightsConfig,
    data: Sequence[Feeds] | Hessians | None,
    *,
    method: str = "rtn",
) -> list[tuple[str, float]]:
    """``(node name, score)`` of each 4-bit linear layer, most sensitive first (module
    doc): ``data`` the calibration samples (a few; run once) or sums already collected,
    None for the data-free score. ``method`` quantizes the 4-bit side ("rtn" is quick;
    "gptq" scores what GPTQ leaves). ``model`` (FP32) is read, not changed."""
    # a copy of the graph that shares the weights (a memory-mapped model stays mapped)
    work = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else clone_model(model)
    SelectWeightsPass(dataclasses.replace(config, bits=4, ratio=1.0))(work)
    if data is not None:
        hessians = data if isinstance(data, Hessians) else None
        if hessians is None:
            samples = list(itertools.islice(data, 64))  # type: ignore[arg-type]
            hessians = collect_hessians(work, samples, hessian_inputs(work))
        attach_hessians(work, hessians)
    chosen = METHODS[method]
    return [(s.name, s.score) for s in layer_scores(work, config, chosen)]


def plan_layers(
    model: ir.Model, config: WeightsConfig, method: WeightMethod, data: WeightsData | None
) -> tuple[list[str], dict[str, object]]:
    """Between the select pass and the rewrite: record each MatMul's input statistics
    when ``data`` is given, then, at 4 bits with ``ratio`` not 1, move the most sensitive
    layers to 8 bits (:func:`choose_mixed`). Returns notes for the report and its
    ``mixed`` section (empty when nothing was mixed)."""
    notes: list[str] = []
    if data is not None and data.samples:
        widths = hessian_inputs(model)
        try:
            collect_hessians(model, data.samples, widths, into=data.hessians, threads=data.threads)
        except MixprecError as e:  # the FP32 model does not run here: no statistics
            notes.append(f"no layer statistics ({e}): round to nearest, data-free scores")
            data = None
    if data is not None and data.samples:
        count = attach_hessians(model, data.hessians)
        rows = sum(data.hessians.rows.get(name, 0) for name in widths)
        notes.append(
            f"layer statistics: X^T X of {len(widths)} MatMul inputs ({count} MatMuls) over "
            f"{data.hessians.samples} calibration samples, {rows // max(len(widths), 1)} rows each"
        )
    if config.bits != 4 or config.ratio == 1.0:
        return notes, {}
    scores = layer_scores(model, config, method)
    if not scores:
        return notes, {}
    choice = choose_mixed(model, config, scores)
    basis = "output error on the calibration data" if data else "weight error (no data)"
    size = f"{choice.bytes_after / 1e6:.1f} MB ({choice.bytes_after / choice.bytes_before:.2f}x)"
    notes.append(
        f"mixed bits by sensitivity ({basis}): {len(choice.int8)} of {len(scores)} linear "
        f"layers at 8 bits ({choice.rule}); estimated parameters {size}"
    )
    section = {
        "rule": choice.rule,
        "basis": basis,
        "int8": choice.int8,
        "estimated_bytes": choice.bytes_after,
        "scores": {s.name: s.score for s in scores},
    }
    return notes, section
