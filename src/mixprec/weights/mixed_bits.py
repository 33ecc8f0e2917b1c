"""Layer sensitivity to 4 bits and the mixed 4/8-bit choice.

**The score.** A linear layer ``y = x W`` quantized to ``Q`` adds ``x (W - Q)`` to its
output; over the calibration rows its mean squared size is ``tr(D^T H D)`` with
``D = W - Q`` and ``H = X^T X / n`` (:mod:`mixprec.weights.stats`): the exact output error
of that layer alone, not an approximation. A layer's **gain** is what 8 bits saves of it,
``E(Q4) - E(Q8)``, with ``Q4`` the run's method (GPTQ's own result where it runs, kept for
the rewrite) and ``Q8`` round to nearest; its **score** is the gain per weight (what one
more byte at 8 bits buys), and layers rank by it, most sensitive first. Without data
``H`` is the identity (the weights' own error, NNCF's data-free criterion).

**The size budget.** Every 4/8-bit choice stays within one budget of parameter bytes:
``max_size`` times the float size when given; else, with ``ratio`` (the share of linear-
layer weights left at 4 bits, NNCF's meaning), all linear layers at 4 bits plus ``1 -
ratio`` of what 8 bits would add; else (the default) the same with
:data:`DEFAULT_RATIO`, and at most :data:`DEFAULT_MOST_LAYERS` of the linear layers. The
lm_head and embeddings count at their configured precision.

**Mixed bits.** With ``max_size`` or ``ratio``, the highest scores go to 8 bits while the
budget holds. By default only the layers whose score is more than :data:`OUTLIER` times
the median go, highest first, within the budget; the language-model guard's repair may
spend the rest of it (:mod:`mixprec.repair.language_guard`), never more: a miss at that size is
reported, not paid for in size.
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
from mixprec.inputs.feeds import Feeds
from mixprec.io.external import clone_model, release_mapped_pages
from mixprec.weights.awq import scale_inputs
from mixprec.weights.blocks import BlockSpec
from mixprec.weights.config import WeightsConfig
from mixprec.weights.inputs import LAYER_INPUTS, LayerData
from mixprec.weights.methods import METHODS, WeightMethod
from mixprec.weights.select import (
    WEIGHTS,
    SelectWeightsPass,
    WeightDecision,
    WeightSource,
    matmul_weight,
    weight_decision,
)
from mixprec.weights.slices import SLICE_BYTES, digest_in_slices, errors_in_slices
from mixprec.weights.stats import (
    Hessians,
    WeightsData,
    attach_hessians,
    collect_hessians,
    hessian_inputs,
)

__all__ = [
    "DEFAULT_MOST_LAYERS",
    "DEFAULT_RATIO",
    "OUTLIER",
    "LayerScore",
    "MixedChoice",
    "SizeBudget",
    "choose_mixed",
    "layer_scores",
    "packed_bytes",
    "plan_layers",
    "rank_layers",
    "recorded_scores",
    "size_budget",
]

#: The default mixed choice keeps at 8 bits the layers scoring above this many times the
#: median score (module doc).
OUTLIER = 4.0
#: Without ``ratio`` or ``max_size``, the size budget keeps at least this share of the
#: linear-layer weights stays at 4 bits (module doc): at most a tenth go to 8 bits.
DEFAULT_RATIO = 0.9
#: ... and at most this share of the linear layers (by count) leaves 4 bits.
DEFAULT_MOST_LAYERS = 0.125


@dataclasses.dataclass(frozen=True)
class LayerScore:
    """One linear layer's sensitivity: ``error4`` / ``error8`` the mean squared output
    error at 4 / 8 bits, ``weights`` its K*N, ``score`` (error4 - error8) / weights;
    ``extra8`` / ``extra_float`` the bytes 8 bits / float add over 4 bits."""

    name: str
    error4: float
    error8: float
    weights: int
    extra8: int = 0
    extra_float: int = 0

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
            error4, error8 = _data_errors(model, matrix, config, method, data)
            release_mapped_pages(model)  # a memory-mapped weight's pages, once read
        else:
            error4, error8 = _data_free(model, matrix, config, method)
        k, n = matrix.shape
        scores.append(LayerScore(node.name or "", error4, error8, k * n, *_extra(k, n, config)))
    return sorted(scores, key=lambda s: -s.score)


def _extra(k: int, n: int, config: WeightsConfig) -> tuple[int, int]:
    """The bytes 8 bits and float add over 4 bits to a ``[K, N]`` weight."""
    four = packed_bytes(k, n, config.spec("int4"))
    return packed_bytes(k, n, config.spec("int8")) - four, 4 * k * n - four


def recorded_scores(
    scores: dict[str, float], shapes: dict[str, tuple[int, int]], config: WeightsConfig
) -> list[LayerScore]:
    """A run's recorded ranking (the ``scores`` of its ``mixed`` section, :func:`plan_layers`)
    as :class:`LayerScore` rows with their costs, most sensitive first: ``shapes`` gives
    each layer's ``(K, N)``. The recorded score stands for the error difference."""
    rows = []
    for name in sorted(scores, key=lambda layer: -scores[layer]):  # the recorded order
        k, n = shapes[name]
        rows.append(
            LayerScore(name, float(scores[name]) * k * n, 0.0, k * n, *_extra(k, n, config))
        )
    return rows


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


def _data_errors(
    model: ir.Model,
    matrix: np.ndarray,
    config: WeightsConfig,
    method: WeightMethod,
    data: LayerData,
) -> tuple[float, float]:
    """(error4, error8) of a weight with its layer's statistics: a small weight at once
    (its codes cached for the rewrite), a large one a slice of columns at a time (the
    errors are sums over columns), its products with ``H`` in float32."""
    if matrix.nbytes <= SLICE_BYTES:
        return _errors(matrix.astype(np.float32), config, method, data)
    hessian = np.asarray(data.hessian, np.float32)

    def one(w: np.ndarray) -> tuple[float, float]:
        q4 = method.quantize(w, config.spec("int4"), data.for_slice()).dequantize()
        q8 = METHODS["rtn"].quantize(w, config.spec("int8"), None).dequantize()
        return _error32(w, q4, hessian), _error32(w, q8, hessian)

    release = functools.partial(release_mapped_pages, model)
    return errors_in_slices(matrix, one, release)


def _error32(weight: np.ndarray, quant: np.ndarray, hessian: np.ndarray) -> float:
    d = weight - quant
    return float(np.sum(d * (hessian @ d), dtype=np.float64))


@dataclasses.dataclass(frozen=True)
class SizeBudget:
    """The parameter bytes a 4/8-bit run may reach (module doc): the float model's, all
    linear layers at 4 bits (``base_bytes``), the ``goal_bytes``, the rule, and (by
    default) the most linear layers at 8 bits."""

    float_bytes: int
    base_bytes: int
    goal_bytes: int
    rule: str
    #: the most linear layers at 8 bits (the default budget's; None: bytes alone)
    most_layers: int | None = None

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @staticmethod
    def of(section: object) -> SizeBudget | None:
        """The budget a report's ``mixed`` section recorded (None: none)."""
        found = section.get("budget") if isinstance(section, dict) else None
        return SizeBudget(**found) if isinstance(found, dict) else None


@dataclasses.dataclass(frozen=True)
class MixedChoice:
    """The layers moved to 8 bits and why, and the estimated parameter bytes."""

    int8: dict[str, str]
    rule: str
    budget: SizeBudget
    bytes_after: int


def check_reachable(model: ir.Model, config: WeightsConfig) -> tuple[int, int]:
    """``(FP32 bytes, smallest reachable bytes)`` of a 4-bit run on the select pass's
    decisions; a ``max_size`` below the smallest is one error naming it, raised before
    any statistics are collected (on a 0.5B decoder they take minutes)."""
    before = _float_bytes(model)
    base = _estimate(model, config, set())
    if config.max_size is not None and base > config.max_size * before:
        smaller = [
            *(["--lm-head int4"] if config.lm_head != "int4" else []),
            *(["--embeddings int4"] if config.embeddings != "int4" else []),
            *(["a larger --block-size"] if config.block_size < 128 else []),
        ]
        hint = f"; {', '.join(smaller)} make it smaller" if smaller else ""
        raise MixprecError(
            f"size budget {config.max_size:g}x FP32 cannot be met: the smallest reachable "
            f"is {base / before:.4f}x (every linear layer at 4 bits, block "
            f"{config.block_size}, lm_head {config.lm_head}, embeddings {config.embeddings})"
            f"{hint}"
        )
    return before, base


def size_budget(model: ir.Model, config: WeightsConfig, scores: Sequence[LayerScore]) -> SizeBudget:
    """The run's budget (module doc); a ``max_size`` below the smallest reachable size
    is one error naming it."""
    before, base = check_reachable(model, config)
    extra = sum(s.extra8 for s in scores if s.name not in config.layers)
    if config.max_size is not None:
        goal = int(config.max_size * before)
        rule = f"max size {config.max_size:g}x FP32"
    else:
        ratio = DEFAULT_RATIO if config.ratio is None else config.ratio
        goal = base + int((1.0 - ratio) * extra)
        rule = f"ratio {ratio:g}: at most {1 - ratio:.0%} of linear weights at 8 bits"
        if config.ratio is None:
            most = int(DEFAULT_MOST_LAYERS * len(scores))
            rule = f"default {rule} and {most} of {len(scores)} linear layers"
            return SizeBudget(before, base, goal, rule, most)
    return SizeBudget(before, base, goal, rule)


def choose_mixed(
    model: ir.Model, config: WeightsConfig, scores: Sequence[LayerScore]
) -> MixedChoice:
    """Move the most sensitive layers to 8 bits within the size budget (module doc):
    records each one's decision (int8, with its score as the reason) and returns what was
    moved. Layers a ``layers=`` map names are left as it says."""
    budget = size_budget(model, config, scores)
    free = [s for s in scores if s.name not in config.layers]
    median = float(np.median([s.score for s in free])) if free else 0.0
    outliers_only = config.ratio is None and config.max_size is None
    rule = budget.rule
    if outliers_only:
        rule = f"score > {OUTLIER:g}x the median {median:.3g}, within {budget.rule}"
    moved: dict[str, str] = {}
    spent = budget.base_bytes
    for s in free:
        if outliers_only and s.score <= OUTLIER * median:
            break
        if budget.most_layers is not None and len(moved) >= budget.most_layers:
            break
        if spent + s.extra8 > budget.goal_bytes:
            continue
        spent += s.extra8
        moved[s.name] = f"8 bits by sensitivity (score {s.score:.3g}; {rule})"
    for node in model.graph:
        if node.name in moved:
            d = weight_decision(node)
            assert d is not None
            node.meta[WEIGHTS] = WeightDecision("int8", d.role, moved[node.name], d.table)
    return MixedChoice(moved, rule, budget, _estimate(model, config, set(moved)))


def _float_bytes(model: ir.Model) -> int:
    return sum(_tensor_bytes(v) for v in model.graph.initializers.values())


def _tensor_bytes(value: ir.Value) -> int:
    tensor = const_tensor(value)
    return tensor.nbytes if tensor is not None else 0


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
            if source is not None and d.table is not None:  # reads the lm_head's codes
                if not any(v is source.value for v, _ in seen):
                    total -= _tensor_bytes(source.value)
                seen.add((source.value, "shared"))
                k, n = source.shape  # its own copy of the scales and zero points
                spec = config.spec(precision)
                codes = n * -(-k // spec.block_size) * spec.block_size * spec.bits // 8
                total += packed_bytes(k, n, spec) - codes
                continue
        if source is None or (source.value, precision) in seen:
            continue
        first = not any(v is source.value for v, _ in seen)
        seen.add((source.value, precision))
        k, n = source.shape
        total += packed_bytes(k, n, config.spec(precision)) - (4 * k * n if first else 0)
    return total


def rank_layers(
    model: ir.Model | onnx.ModelProto,
    config: WeightsConfig,
    data: Sequence[Feeds] | Hessians | None,
    *,
    method: str = "rtn",
    streamed: bool = False,
) -> list[LayerScore]:
    """The score of each 4-bit linear layer (:class:`LayerScore`), most sensitive first (module
    doc): ``data`` the calibration samples (a few; run once) or sums already collected,
    None for the data-free score. ``method`` quantizes the 4-bit side ("rtn" is quick;
    "gptq" scores what GPTQ leaves); ``streamed``: the samples run the model in pieces.
    ``model`` (FP32) is read, not changed."""
    # a copy of the graph that shares the weights (a memory-mapped model stays mapped)
    work = ir.from_proto(model) if isinstance(model, onnx.ModelProto) else clone_model(model)
    SelectWeightsPass(dataclasses.replace(config, bits=4, ratio=1.0, max_size=None))(work)
    if data is not None:
        hessians = data if isinstance(data, Hessians) else None
        if hessians is None:
            samples = list(itertools.islice(data, 64))  # type: ignore[arg-type]
            hessians = collect_hessians(work, samples, hessian_inputs(work), streamed=streamed)
        attach_hessians(work, hessians)
    chosen = METHODS[method]
    return layer_scores(work, config, chosen)


def plan_layers(
    model: ir.Model, config: WeightsConfig, method: WeightMethod, data: WeightsData | None
) -> tuple[list[str], dict[str, object]]:
    """Between the select pass and the rewrite: record each MatMul's input statistics
    when ``data`` is given, then, at 4 bits with ``ratio`` not 1, move the most sensitive
    layers to 8 bits (:func:`choose_mixed`). Returns notes for the report and its
    ``mixed`` section (empty when nothing was mixed)."""
    notes: list[str] = []
    if config.bits == 4:
        check_reachable(model, config)  # a budget below reach fails before the statistics
    if data is not None and data.samples:
        widths = hessian_inputs(model)
        try:
            collect_hessians(
                model,
                data.samples,
                widths,
                into=data.hessians,
                threads=data.threads,
                streamed=data.streamed,
            )
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
        if method.scales:
            notes += scale_inputs(model, config, data.scales)
    if config.bits != 4:
        return notes, {}
    scores = layer_scores(model, config, method)
    if not scores:
        return notes, {}
    choice = choose_mixed(model, config, scores)
    basis = "output error on the calibration data" if data else "weight error (no data)"
    before = choice.budget.float_bytes
    size = f"{choice.bytes_after / 1e6:.1f} MB ({choice.bytes_after / before:.3f}x)"
    goal = choice.budget.goal_bytes
    notes.append(
        f"mixed bits by sensitivity ({basis}): {len(choice.int8)} of {len(scores)} linear "
        f"layers at 8 bits ({choice.rule}); estimated parameters {size}, budget "
        f"{goal / 1e6:.1f} MB ({goal / before:.3f}x)"
    )
    section = {
        "rule": choice.rule,
        "basis": basis,
        "int8": choice.int8,
        "estimated_bytes": choice.bytes_after,
        "budget": choice.budget.to_json(),
        "scores": {s.name: s.score for s in scores},
    }
    return notes, section
