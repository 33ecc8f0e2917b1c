"""SmoothQuant (Xiao et al. 2022): move activation outlier channels into the weights.

A transformer's MatMul/Gemm inputs carry a few channels whose values are 10-100x the
others'; one per-tensor activation scale cannot hold them and the rest together. With a
constant weight, ``X W = (X diag(1/s)) (diag(s) W)`` for any positive ``s``: dividing
channel ``j`` of the activation by ``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` flattens
the outliers, and multiplying row ``j`` of the weight by ``s_j`` moves the difficulty to
the weights, whose per-output-channel scales absorb it better. The FP32 function is
unchanged.

Where the division goes:

* into the producer, when every reader of the activation (``Shape`` aside) is one of the
  smoothed MatMul/Gemm: ``LayerNormalization``'s scale and bias, or the constant ``Mul``
  (and the ``Add`` after it) that end a decomposed layer norm;
* else into a new ``Mul`` by the constant ``1/s`` before those nodes (a BERT layer norm
  also feeds its residual ``Add``, which must see the original values); the ``Mul``
  carries :data:`~mixprec.int8.plan.KEEP_FLOAT` and stays float.

Every MatMul/Gemm with a constant weight reading one activation (attention's Q, K and V)
shares one ``s``, computed from the largest of their weight rows.

Only inputs with outlier channels are smoothed: their largest channel ``max |x|`` is at
least :data:`MIN_RATIO` times the median channel's (a Mul for a percent of error is not
worth its time). A fixed ``alpha`` applies to each of them. ``None`` (``smooth="auto"``)
searches :data:`ALPHAS` per input, scoring each by the relative squared error of the
quantized layers' outputs (the activation per tensor over ``[-m, m]`` in 255 steps, the
weights symmetric int8 per output channel, or per tensor) on rows of the calibration
samples (:data:`ROWS_PER_SAMPLE` per sample: a few small matrix products per input)
against leaving the input as it is; an input is smoothed only when its best alpha lowers
that error by :data:`MARGIN` or more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.runner import calibrate
from mixprec.core.constants import const_tensor
from mixprec.core.graphs import NodeExclusions, UniqueNames, add_initializer
from mixprec.core.layers import is_layer, match_layer
from mixprec.core.ops import is_onnx_domain, trans_b
from mixprec.int8.plan import KEEP_FLOAT
from mixprec.io.protos import weightless_proto
from mixprec.passes.macs import concrete_shapes, count_macs

try:  # not a dependency: only keeps the alpha search's small products on one thread
    import threadpoolctl as _threadpoolctl
except ImportError:  # pragma: no cover - numpy's BLAS keeps its threads
    _threadpoolctl = None

__all__ = [
    "ALPHAS",
    "AUTO_MAC_SHARE",
    "MARGIN",
    "MIN_RATIO",
    "ROWS_PER_SAMPLE",
    "SAMPLES",
    "SCORED_COLUMNS",
    "SmoothQuantPass",
    "SmoothQuantResult",
    "SmoothedInput",
    "head_of",
    "smoothable_share",
    "smoothing_scales",
]

#: The alphas ``smooth="auto"`` tries per input.
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: Inputs are smoothed only when their largest channel max |x| is this many medians.
MIN_RATIO = 4.0
#: ``smooth="auto"`` keeps an alpha that lowers the layers' error by this share.
MARGIN = 0.1
#: Calibration samples the statistics are taken from (the head of the stream).
SAMPLES = 16
#: Rows of each sample the alpha search scores on.
ROWS_PER_SAMPLE = 64
#: Output columns of each layer the alpha search scores (a seeded draw).
SCORED_COLUMNS = 256
#: ``smooth="auto"`` runs where the layers it could smooth hold this share of the MACs.
AUTO_MAC_SHARE = 0.5
# s is kept within [1/_S_LIMIT, _S_LIMIT]; channel maxima below _FLOOR count as _FLOOR.
_S_LIMIT = 1e4
_FLOOR = 1e-5


@dataclasses.dataclass(frozen=True)
class SmoothedInput:
    """One activation read by MatMul/Gemm with constant weights, smoothed or not.

    Attributes:
        tensor: The activation's name.
        nodes: The MatMul/Gemm nodes that read it.
        alpha: The migration strength used, or None when left as it was.
        how: Where ``1/s`` went, or why the input was left as it was.
        ratio_before: Largest channel max |x| over the median channel's, before (None:
            not measured).
        ratio_after: The same after smoothing (equal to ``ratio_before`` when left).
        error_before: The layers' relative squared INT8 output error unsmoothed
            (searched inputs only).
        error_after: The same at the chosen alpha.
    """

    tensor: str
    nodes: tuple[str, ...]
    alpha: float | None
    how: str
    ratio_before: float | None
    ratio_after: float | None
    error_before: float | None = None
    error_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SmoothQuantResult(ir.passes.PassResult):
    """What :class:`SmoothQuantPass` did, per activation input."""

    inputs: list[SmoothedInput] = dataclasses.field(default_factory=list)
    samples: int = 0
    alpha: float | str = "auto"
    skipped: str | None = None

    @property
    def smoothed(self) -> list[SmoothedInput]:
        return [i for i in self.inputs if i.alpha is not None]

    def summary(self) -> str:
        if self.skipped is not None:
            return f"SmoothQuant (alpha {self.alpha}) skipped: {self.skipped}"
        done = self.smoothed
        head = f"SmoothQuant (alpha {self.alpha}): {len(done)} of {len(self.inputs)} "
        head += "MatMul/Gemm input(s) smoothed"
        if not done:
            return head
        alphas = sorted({i.alpha for i in done if i.alpha is not None})
        before = max(i.ratio_before or 0.0 for i in done)
        after = max(i.ratio_after or 0.0 for i in done)
        return (
            f"{head} (alpha {alphas[0]:g}-{alphas[-1]:g}; largest channel max/median "
            f"{before:.3g} -> {after:.3g})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha": self.alpha,
            "samples": self.samples,
            "smoothed": len(self.smoothed),
            "skipped": self.skipped,
            "inputs": [i.to_dict() for i in self.inputs],
            "summary": self.summary(),
        }


@dataclasses.dataclass
class _Layer:
    node: ir.Node
    tensor: ir.TensorProtocol  # the constant weight, read when needed
    transposed: bool  # Gemm transB: stored as [N, K]

    @functools.cached_property
    def weight(self) -> np.ndarray:
        """[K, N]: rows are the activation's channels."""
        array = self.tensor.numpy()
        return array.T if self.transposed else array


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The search's verdict on one input: alpha and ``s``, or why it is left as it is."""

    alpha: float | None = None
    s: np.ndarray | None = None
    why: str = ""
    before: float | None = None
    after: float | None = None


def head_of(data: Any, most: int = SAMPLES) -> tuple[list[Any], Any]:
    """The first ``most`` samples of ``data`` (one feed dict, a list, or a stream) and an
    equivalent of ``data`` for the calibration that follows: a list as it is, a stream
    re-chained after its buffered head (only the head is held in memory)."""
    if isinstance(data, Mapping):
        return [data], data
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return list(data[:most]), data
    if not isinstance(data, Iterable):
        return [data], data  # calibration reports the bad argument
    stream = iter(data)
    head = list(itertools.islice(stream, most))
    return head, itertools.chain(head, stream)


def _layer(node: ir.Node) -> _Layer | None:
    """The MatMul/Gemm's constant 2-D float weight as [channels, outputs], or None."""
    layer = match_layer(node)
    if isinstance(layer, str) or layer.kind == "conv":
        return None
    if node.op_type == "Gemm":
        trans_a = node.attributes.get("transA")
        if trans_a is not None and trans_a.as_int():
            return None
    tensor = layer.tensor
    if tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return None
    return _Layer(node, tensor, node.op_type == "Gemm" and trans_b(node))


def _groups(model: ir.Model, exclude: NodeExclusions) -> dict[ir.Value, list[_Layer]]:
    """Activation -> the MatMul/Gemm layers with a constant weight that read it."""
    groups: dict[ir.Value, list[_Layer]] = {}
    for node in model.graph:
        layer = _layer(node)
        if layer is not None and exclude.reason(node) is None:
            groups.setdefault(node.inputs[0], []).append(layer)  # type: ignore[arg-type]
    return groups


def smoothable_share(
    model: ir.Model, sample: Mapping[str, Any], exclude_nodes: Sequence[str] = ()
) -> float:
    """The share of the model's Conv/MatMul/Gemm multiply-accumulates in the MatMul/Gemm
    layers :class:`SmoothQuantPass` could smooth, at ``sample``'s input shapes (dims that
    inference leaves unknown, such as a batch a Reshape hides, count 1); 1.0 when no MAC
    can be counted (not a reason to skip)."""
    groups = _groups(model, NodeExclusions(exclude_nodes))
    return _mac_share(model, groups, sample) if groups else 0.0


def _mac_share(model: ir.Model, groups: Mapping[ir.Value, list[_Layer]], sample: Any) -> float:
    if not isinstance(sample, Mapping):
        return 1.0
    inputs = {k: [int(d) for d in np.shape(v)] for k, v in sample.items()}
    proto, _ = weightless_proto(model, with_arrays=False)
    shaped, shapes = concrete_shapes(proto, inputs)
    known = {k: [1 if d is None else d for d in v] for k, v in shapes.items()}
    macs = count_macs(shaped, known)
    total = sum(macs.get(n.name or "", 0) for n in model.graph if is_layer(n))
    grouped = sum(macs.get(layer.node.name or "", 0) for ls in groups.values() for layer in ls)
    return grouped / total if total else 1.0


def _ratio(absmax: np.ndarray) -> float:
    median = float(np.median(absmax))
    return float(np.max(absmax)) / median if median > 0 else float("inf")


def smoothing_scales(act_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` (maxima floored, ``s`` bounded)."""
    a = np.maximum(np.asarray(act_max, np.float64), _FLOOR)
    w = np.maximum(np.asarray(weight_max, np.float64), _FLOOR)
    return np.clip(a**alpha / w ** (1.0 - alpha), 1.0 / _S_LIMIT, _S_LIMIT)


def _one_blas_thread() -> contextlib.AbstractContextManager[object]:
    """numpy's BLAS on one thread while scoring, where threadpoolctl is installed: the
    products are small, and on a loaded 2-core machine OpenBLAS's own threads made them
    10x slower (MiniLM's search: 7 s against 0.7 s)."""
    if _threadpoolctl is None:
        return contextlib.nullcontext()
    return _threadpoolctl.threadpool_limits(1, user_api="blas")


class _Scorer:
    """The relative squared error of a group's INT8 outputs on calibration rows, for any
    ``s``: activation per tensor over ``[-m, m]`` in 255 steps, weights symmetric int8 per
    output channel (or per tensor). At most :data:`SCORED_COLUMNS` output columns of each
    layer are scored (a seeded draw; per-channel weights quantize each column alone)."""

    def __init__(
        self, rows: np.ndarray, act_max: np.ndarray, layers: list[_Layer], per_channel: bool
    ) -> None:
        self.rows = rows
        self.act_max = act_max
        self.per_channel = per_channel
        rng = np.random.default_rng(0)
        self.layers: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for layer in layers:
            n = layer.weight.shape[1]
            cols = (
                np.sort(rng.choice(n, SCORED_COLUMNS, replace=False))
                if n > SCORED_COLUMNS
                else None
            )
            weight = layer.weight if cols is None else layer.weight[:, cols]
            self.layers.append((layer.weight, weight, rows @ weight))

    def error(self, s: np.ndarray) -> float:
        bound = float(np.max(self.act_max / s))
        step = 2.0 * bound / 255.0 if bound > 0 else 1.0
        s32 = s.astype(np.float32)
        xq = (np.clip(np.round(self.rows / s32 / step), -128, 127) * step).astype(np.float32)
        err = ref = 0.0
        for full, weight, exact in self.layers:
            w = weight * s32[:, None]
            if self.per_channel:
                bound_w = np.max(np.abs(w), axis=0)
            else:
                bound_w = np.full(w.shape[1], np.max(np.abs(full * s32[:, None])))
            scale = np.where(bound_w > 0, bound_w / 127.0, 1.0).astype(np.float32)
            wq = np.clip(np.round(w / scale), -127, 127) * scale
            err += float(np.sum((xq @ wq - exact) ** 2))
            ref += float(np.sum(exact**2))
        return err / ref if ref > 0 else 0.0


class SmoothQuantPass(ir.passes.InPlacePass):
    """Smooth the activation inputs of MatMul/Gemm with constant weights (see the module).

    Args:
        data: Calibration samples (a list of feed dicts; :func:`head_of` takes them from
            a stream) the activation statistics come from.
        alpha: The migration strength in (0, 1), or None to search :data:`ALPHAS` per
            input.
        per_channel: The weights will be quantized per output channel (the search's
            weight quantizer).
        exclude_nodes: Node names or patterns kept float: not smoothed either.
        threads: ONNX Runtime threads for the statistics run.
        min_mac_share: Skip the model (no statistics run) when the MatMul/Gemm layers
            that could be smoothed hold less than this share of the Conv/MatMul/Gemm
            multiply-accumulates at the first sample's shapes (a CNN's classifier head
            is not worth 16 inferences).
    """

    def __init__(
        self,
        data: Sequence[Mapping[str, Any]],
        *,
        alpha: float | None = None,
        per_channel: bool = True,
        exclude_nodes: Sequence[str] = (),
        threads: int = 2,
        min_mac_share: float = 0.0,
    ) -> None:
        super().__init__()
        self.min_mac_share = min_mac_share
        self.data = data
        self.alpha = alpha
        self.per_channel = per_channel
        self.exclude = NodeExclusions(exclude_nodes)
        self.threads = threads

    def call(self, model: ir.Model) -> SmoothQuantResult:
        result = SmoothQuantResult(model, False, alpha="auto" if self.alpha is None else self.alpha)
        groups = {x: layers for x, layers in _groups(model, self.exclude).items() if x.name}
        if not groups:
            return result
        share = 1.0
        if self.min_mac_share > 0 and self.data:
            share = _mac_share(model, groups, self.data[0])
        if share < self.min_mac_share:
            result.skipped = (
                f"the MatMul/Gemm layers it could smooth hold {share:.0%} of the MACs "
                f"(< {self.min_mac_share:.0%})"
            )
            return result
        names = {x.name: -1 for x in groups if x.name}
        # Rows for the search; a tensor of unknown rank has no in-graph probe: fetched
        # whole, its channel maxima come from the data.
        rows = {
            x.name: ROWS_PER_SAMPLE if self.alpha is None else 1
            for x in groups
            if x.name and (self.alpha is None or x.shape is None)
        }
        stats = calibrate(
            model,
            self.data,
            observer="absmax",
            channel_absmax=names,
            rows=rows,
            only=set(names),
            threads=self.threads,
        )
        result.samples = stats.samples
        unique = UniqueNames(model)
        for x, layers in groups.items():
            act_max = stats.channel_absmax.get(x.name or "")
            nodes = tuple(layer.node.name or "" for layer in layers)
            if act_max is None or act_max.shape != (layers[0].weight.shape[0],):
                result.inputs.append(
                    SmoothedInput(x.name or "", nodes, None, "not measured", None, None)
                )
                continue
            weight_max = np.max([np.max(np.abs(lay.weight), axis=1) for lay in layers], axis=0)
            chosen = self._choose(act_max, weight_max, layers, stats.rows.get(x.name or ""))
            smoothed = self._apply(model, unique, x, layers, act_max, chosen)
            result.inputs.append(dataclasses.replace(smoothed, nodes=nodes))
            result.modified = result.modified or smoothed.alpha is not None
        return result

    def _choose(
        self,
        act_max: np.ndarray,
        weight_max: np.ndarray,
        layers: list[_Layer],
        rows: np.ndarray | None,
    ) -> _Choice:
        ratio = _ratio(act_max)
        if ratio < MIN_RATIO:
            return _Choice(why=f"no outlier channels (largest/median {ratio:.3g} < {MIN_RATIO:g})")
        if self.alpha is not None:
            return _Choice(self.alpha, smoothing_scales(act_max, weight_max, self.alpha))
        if rows is None or not len(rows):
            return _Choice(why="no rows to score the alphas on")
        candidates = [(alpha, smoothing_scales(act_max, weight_max, alpha)) for alpha in ALPHAS]
        with _one_blas_thread():
            scorer = _Scorer(rows, act_max, layers, self.per_channel)
            before = scorer.error(np.ones_like(act_max, dtype=np.float64))
            scored = [(scorer.error(s), alpha, s) for alpha, s in candidates]
        error, alpha, s = min(scored, key=lambda t: t[0])
        if not error <= (1.0 - MARGIN) * before:
            why = f"no alpha lowers the layers' INT8 error by {MARGIN:.0%} ({before:.3g})"
            return _Choice(why=why, before=before, after=before)
        return _Choice(alpha, s, before=before, after=error)

    def _apply(
        self,
        model: ir.Model,
        unique: UniqueNames,
        x: ir.Value,
        layers: list[_Layer],
        act_max: np.ndarray,
        chosen: _Choice,
    ) -> SmoothedInput:
        alpha, s, before, after = chosen.alpha, chosen.s, chosen.before, chosen.after
        ratio = _ratio(act_max)
        if alpha is None or s is None:
            return SmoothedInput(x.name or "", (), None, chosen.why, ratio, ratio, before, after)
        graph = model.graph
        for layer in layers:
            scaled = (layer.weight * s[:, None]).astype(np.float32)
            array = scaled.T if layer.transposed else scaled
            _set_input(graph, unique, layer.node, 1, array, "smoothed")
        how = _fold(graph, unique, x, {id(layer.node) for layer in layers}, s)
        if how is None:
            how = _insert_mul(graph, unique, x, [layer.node for layer in layers], s)
        return SmoothedInput(
            x.name or "", (), alpha, how, ratio, _ratio(act_max / s), before, after
        )


def _set_input(
    graph: ir.Graph, unique: UniqueNames, node: ir.Node, index: int, array: np.ndarray, tag: str
) -> None:
    """Feeds ``node``'s input ``index`` from a new initializer holding ``array``; the old
    initializer goes when nothing else reads it."""
    old = node.inputs[index]
    base = f"{old.name}_{tag}" if old is not None and old.name else tag
    node.replace_input_with(index, add_initializer(graph, unique, base, array))
    if old is None or not old.name or old.name not in graph.initializers or old.uses():
        return
    if not old.is_graph_input() and not old.is_graph_output():
        graph.initializers.pop(old.name)


def _per_channel(tensor: ir.TensorProtocol | None, channels: int) -> bool:
    """Whether ``tensor`` is a float constant that varies at most along its last axis,
    of 1 or ``channels`` entries (dividing it by ``s`` divides channel j by ``s_j``)."""
    if tensor is None or tensor.dtype != ir.DataType.FLOAT:
        return False
    shape = tuple(tensor.shape)
    return not shape or (all(d == 1 for d in shape[:-1]) and shape[-1] in (1, channels))


def _channel_constant(node: ir.Node, channels: int) -> int | None:
    """The input index of ``node``'s per-channel constant (:func:`_per_channel`)."""
    for index, value in enumerate(node.inputs):
        if _per_channel(const_tensor(value), channels):
            return index
    return None


def _fold(
    graph: ir.Graph, unique: UniqueNames, x: ir.Value, layers: set[int], s: np.ndarray
) -> str | None:
    """Divides ``x`` by ``s`` inside its producer when the smoothed layers (and Shape) are
    its only readers; returns what was changed, or None when it cannot be folded."""
    producer = x.producer()
    if producer is None or x.is_graph_output() or not is_onnx_domain(producer.domain):
        return None
    if any(id(user) not in layers and user.op_type != "Shape" for user, _ in x.uses()):
        return None
    channels = len(s)
    targets: list[tuple[ir.Node, int]] = []
    if producer.op_type == "LayerNormalization" and x is producer.outputs[0]:
        if producer.inputs[1] is None:
            return None
        targets = [(producer, i) for i in (1, 2) if i < len(producer.inputs) and producer.inputs[i]]
    elif producer.op_type in ("Mul", "Add"):
        index = _channel_constant(producer, channels)
        if index is None:
            return None
        targets = [(producer, index)]
        if producer.op_type == "Add":  # Add(Mul(u, gamma), beta): scale both
            inner = producer.inputs[1 - index]
            mul = inner.producer() if inner is not None else None
            if mul is None or mul.op_type != "Mul" or len(inner.uses()) != 1:  # type: ignore[union-attr]
                return None
            gamma = _channel_constant(mul, channels)
            if gamma is None:
                return None
            targets.append((mul, gamma))
    else:
        return None
    if not all(_per_channel(const_tensor(node.inputs[i]), channels) for node, i in targets):
        return None
    for node, index in targets:
        tensor = const_tensor(node.inputs[index])
        array = (tensor.numpy() / s).astype(np.float32)  # type: ignore[union-attr]
        _set_input(graph, unique, node, index, array, "smoothed")
    kinds = sorted({node.op_type for node, _ in targets})
    return f"1/s folded into {'/'.join(kinds)} {producer.name!r}"


def _insert_mul(
    graph: ir.Graph, unique: UniqueNames, x: ir.Value, readers: list[ir.Node], s: np.ndarray
) -> str:
    """A new ``Mul(x, 1/s)`` (kept float) feeding ``readers``."""
    base = x.name or "smooth"
    inverse = add_initializer(graph, unique, f"{base}_smooth_inv", (1.0 / s).astype(np.float32))
    out = ir.Value(name=unique.fresh(f"{base}_smoothed"), type=x.type, shape=x.shape)
    mul = ir.Node("", "Mul", [x, inverse], outputs=[out], name=unique.fresh(f"{base}_smooth"))
    mul.metadata_props[KEEP_FLOAT] = "SmoothQuant's 1/s: stays float"
    order = {id(node): k for k, node in enumerate(graph)}
    graph.insert_before(min(readers, key=lambda n: order[id(n)]), mul)
    for reader in readers:
        for index, value in enumerate(reader.inputs):
            if value is x:
                reader.replace_input_with(index, out)
    return f"Mul by 1/s inserted ({mul.name!r}, float)"
