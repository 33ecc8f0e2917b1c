"""Layer inputs for data-aware weight quantization: what a Conv, Gemm or MatMul reads.

:func:`capture_inputs` runs the FP32 model on a few calibration samples in ONNX Runtime
(:func:`~mixprec.calibrate.runner.stream_tensors`, which fetches tensors as calibration
does) and keeps, per layer, a uniform random sample of the rows its weight multiplies:

* Gemm / MatMul: rows of the activation's last axis (``[n, K]``; Gemm ``transA`` reads
  columns);
* Conv: im2col patches at random output positions (``[n, C, prod(kernel)]``, zero
  padding included), so that ``W.reshape(O, C/group, -1)`` times a patch is the output.

The bound: a reservoir of at most ``rows`` rows (and of :data:`ROWS_PER_WEIGHT` per weight
of one output channel, at least 256) and ``layer_bytes`` per layer (reservoir
sampling by random keys, so every output position of every sample is equally likely,
whatever the tensors' sizes), and at most ``group_bytes`` of reservoirs held at once:
the layers are captured a group at a time, one pass over the samples per group. The
raw activations are never kept, only the sampled rows. Learned rounding
(:mod:`mixprec.int8.rounding`) reads them; data-aware weight-only methods can too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.runner import stream_tensors
from mixprec.core.batching import runs_within
from mixprec.core.constants import const_tensor
from mixprec.core.layers import is_layer
from mixprec.core.ops import trans_b
from mixprec.core.registry import node_info
from mixprec.inputs.feeds import Feeds

__all__ = [
    "DEFAULT_GROUP_BYTES",
    "DEFAULT_LAYER_BYTES",
    "DEFAULT_ROWS",
    "ROWS_PER_WEIGHT",
    "LayerInput",
    "capture_inputs",
    "layer_input",
]

#: Most rows kept per layer.
DEFAULT_ROWS = 4096
#: Most bytes of rows kept per layer (wide depthwise patches get fewer rows).
DEFAULT_LAYER_BYTES = 32 << 20
#: Most bytes of reservoirs held at once (layers are captured in groups under it).
DEFAULT_GROUP_BYTES = 256 << 20
#: Rows wanted per weight of one output channel (a Conv group's width): more would add
#: little to a fit of that many unknowns.
ROWS_PER_WEIGHT = 8
#: Fewest rows a layer is given, whatever its width.
_MIN_ROWS = 256


@dataclass(frozen=True)
class LayerInput:
    """The activation input of one layer and how its rows are cut.

    Attributes:
        node: the layer's node name.
        value: the activation tensor's name.
        kind: "rows" (Gemm/MatMul) or "patches" (Conv).
        width: floats per captured row (``K``, or ``C * prod(kernel)``).
        transpose: Gemm ``transA``: the rows are the input's columns.
        kernel, strides, dilations: the Conv's spatial geometry.
        pads: begin pads then end pads; None with ``auto_pad`` SAME_* (computed per tensor).
        auto_pad: the Conv's ``auto_pad``.
        group: the Conv's ``group`` (each group's rows are ``width / group`` wide).
    """

    node: str
    value: str
    kind: str
    width: int
    transpose: bool = False
    kernel: tuple[int, ...] = ()
    strides: tuple[int, ...] = ()
    dilations: tuple[int, ...] = ()
    pads: tuple[int, ...] | None = None
    auto_pad: str = "NOTSET"
    group: int = 1


def _ints(node: ir.Node, name: str, default: Sequence[int]) -> tuple[int, ...]:
    attr = node.attributes.get(name)
    return tuple(int(v) for v in attr.as_ints()) if attr is not None else tuple(default)


def layer_input(node: ir.Node) -> LayerInput | None:
    """What to capture for a Conv, Gemm or MatMul with a constant weight (None otherwise)."""
    if not is_layer(node) or node_info(node).int8 != "weighted" or len(node.inputs) < 2:
        return None  # the layers INT8 quantizes (ConvTranspose: none)
    x, w = node.inputs[0], node.inputs[1]
    tensor = const_tensor(w) if w is not None else None
    if x is None or not x.name or tensor is None:
        return None
    shape = list(tensor.shape.numpy())
    name = node.name or ""
    if node.op_type == "Conv":
        if len(shape) < 3:
            return None
        kernel = tuple(shape[2:])
        group = node.attributes.get("group")
        groups = group.as_int() if group is not None else 1
        channels = shape[1] * groups
        auto = node.attributes.get("auto_pad")
        auto_pad = auto.as_string() if auto is not None else "NOTSET"
        pads = None if auto_pad.startswith("SAME") else _ints(node, "pads", [0] * 2 * len(kernel))
        return LayerInput(
            name,
            x.name,
            "patches",
            channels * math.prod(kernel),
            kernel=kernel,
            strides=_ints(node, "strides", [1] * len(kernel)),
            dilations=_ints(node, "dilations", [1] * len(kernel)),
            pads=pads,
            auto_pad=auto_pad,
            group=max(1, groups),
        )
    if len(shape) != 2:
        return None  # batched MatMul weights: not one matrix
    trans = node.attributes.get("transA")
    transpose = node.op_type == "Gemm" and trans is not None and bool(trans.as_int())
    width = shape[1] if node.op_type == "Gemm" and trans_b(node) else shape[0]
    return LayerInput(name, x.name, "rows", width, transpose=transpose)


def _pads(layer: LayerInput, spatial: Sequence[int]) -> tuple[list[int], list[int]]:
    """Begin and end pads of the Conv for an input of ``spatial`` size."""
    rank = len(layer.kernel)
    if layer.pads is not None:
        return list(layer.pads[:rank]), list(layer.pads[rank:])
    begin, end = [], []
    for size, k, s, d in zip(spatial, layer.kernel, layer.strides, layer.dilations, strict=True):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        low = total // 2 if layer.auto_pad == "SAME_UPPER" else total - total // 2
        begin.append(low)
        end.append(total - low)
    return begin, end


def _positions(layer: LayerInput, x: np.ndarray) -> tuple[list[int], list[int], list[int]] | None:
    """The Conv's begin pads, end pads and output size for input ``x`` (None: wrong rank)."""
    if x.ndim != len(layer.kernel) + 2:
        return None
    begin, end = _pads(layer, x.shape[2:])
    reach = [(k - 1) * d + 1 for k, d in zip(layer.kernel, layer.dilations, strict=True)]
    out = [
        (size + b + e - r) // s + 1
        for size, b, e, r, s in zip(x.shape[2:], begin, end, reach, layer.strides, strict=True)
    ]
    return begin, end, out


def _patches(layer: LayerInput, x: np.ndarray, chosen: np.ndarray, out: list[int]) -> np.ndarray:
    """The im2col patches ``[m, C, prod(kernel)]`` of ``x`` at the flat output positions
    ``chosen`` (``x`` already padded)."""
    rank = len(layer.kernel)
    where = np.unravel_index(chosen, (x.shape[0], *out))
    offsets = np.indices(layer.kernel).reshape(rank, -1)  # [rank, prod(kernel)]
    index = [
        (where[i + 1][:, None] * layer.strides[i] + offsets[i][None, :] * layer.dilations[i])[
            :, None, :
        ]
        for i in range(rank)
    ]
    channels = np.arange(x.shape[1])[None, :, None]
    return np.asarray(x[(where[0][:, None, None], channels, *index)], np.float32)


class _Reservoir:
    """A uniform sample of at most ``size`` rows over every row (output position) seen:
    each gets a random key and the largest keys are kept, so only the rows that enter the
    reservoir are ever cut out of a tensor."""

    def __init__(self, layer: LayerInput, size: int, seed: int) -> None:
        self.layer = layer
        self.size = size
        self.rng = np.random.default_rng(seed)
        self.rows: np.ndarray | None = None
        self.keys = np.zeros(0)

    def _winners(self, total: int) -> tuple[np.ndarray, np.ndarray]:
        """The positions (of ``total``) whose keys enter the reservoir, and their keys."""
        keys = self.rng.random(total)
        if len(self.keys) >= self.size:
            chosen = np.flatnonzero(keys > self.keys.min())
        else:
            chosen = np.arange(total)
        if len(chosen) > self.size:
            chosen = chosen[np.argpartition(-keys[chosen], self.size - 1)[: self.size]]
        return chosen, keys[chosen]

    def add(self, x: np.ndarray) -> None:
        if self.layer.kind == "patches":
            found = _positions(self.layer, x)
            if found is None or min(found[2], default=1) <= 0:
                return
            begin, end, out = found
            chosen, keys = self._winners(x.shape[0] * math.prod(out))
            padded = np.pad(x, [(0, 0), (0, 0), *zip(begin, end, strict=True)])
            drawn = _patches(self.layer, padded, chosen, out)
        else:
            matrix = x.T if self.layer.transpose and x.ndim == 2 else x
            if matrix.ndim < 1 or matrix.shape[-1] != self.layer.width:
                return
            matrix = matrix.reshape(-1, self.layer.width)
            chosen, keys = self._winners(len(matrix))
            drawn = np.asarray(matrix[chosen], np.float32)
        if len(drawn):
            self._merge(drawn, keys)

    def _merge(self, drawn: np.ndarray, keys: np.ndarray) -> None:
        """Keep the ``size`` largest keys; new rows take the slots of dropped ones."""
        if self.rows is None:
            self.rows = np.empty((self.size, *drawn.shape[1:]), np.float32)
        held = len(self.keys)
        both = np.concatenate([self.keys, keys])
        top = np.arange(len(both))
        if len(both) > self.size:
            top = np.argpartition(-both, self.size - 1)[: self.size]
        kept = np.zeros(len(both), bool)
        kept[top] = True
        slots = np.flatnonzero(~kept[:held])  # old rows dropped ...
        slots = np.concatenate([slots, np.arange(held, self.size)])  # ... and empty slots
        new = np.flatnonzero(kept[held:])
        self.rows[slots[: len(new)]] = drawn[new]
        self.keys = np.concatenate([self.keys, np.zeros(max(0, self.size - held))])[: self.size]
        self.keys[slots[: len(new)]] = keys[new]
        self.keys = self.keys[: min(self.size, held + len(new))]  # filled slots stay first

    def result(self) -> np.ndarray:
        if self.rows is None:
            return np.zeros((0, self.layer.width), np.float32)
        return self.rows[: len(self.keys)]


def _row_budget(layer: LayerInput, rows: int, per_weight: int | None, layer_bytes: int) -> int:
    if per_weight is not None:
        rows = min(rows, max(_MIN_ROWS, per_weight * layer.width // layer.group))
    return max(min(_MIN_ROWS, rows), min(rows, layer_bytes // max(1, 4 * layer.width)))


def _feeder(by_value: dict[str, list[_Reservoir]]) -> Callable[[int, str, np.ndarray], None]:
    def consume(_index: int, name: str, array: np.ndarray) -> None:
        for reservoir in by_value.get(name, []):
            reservoir.add(array)

    return consume


def capture_inputs(
    model: ir.Model,
    samples: Sequence[Feeds],
    layers: Sequence[LayerInput],
    *,
    rows: int = DEFAULT_ROWS,
    per_weight: int | None = ROWS_PER_WEIGHT,
    layer_bytes: int = DEFAULT_LAYER_BYTES,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    seed: int = 0,
    threads: int = 2,
    external: Mapping[str, np.ndarray] | None = None,
) -> Iterator[tuple[LayerInput, np.ndarray]]:
    """Each layer's sampled input rows, a group of layers at a time (module docstring).

    Args:
        model: the FP32 model (an ``onnx_ir`` model; read, not changed).
        samples: feed dicts; read once per group of layers, so a list (keep it short:
            a few samples already give thousands of Conv positions).
        layers: what to capture (:func:`layer_input`).
        rows: most rows per layer.
        per_weight: most rows per weight of one output channel (at least 256; None: no
            such bound).
        layer_bytes: most bytes of rows per layer (at least 64 rows).
        group_bytes: most bytes of reservoirs held at once.
        seed: the sampling seed (the same seed and samples give the same rows).
        threads: ONNX Runtime intra-op threads.
        external: arrays of in-memory placeholder initializers.

    Yields:
        ``(layer, rows)`` in the order of ``layers``: ``[n, width]`` float32 for "rows",
        ``[n, C, prod(kernel)]`` for "patches"; a layer whose input was never seen (or
        of another rank) yields an empty array.
    """
    sizes = [_row_budget(layer, rows, per_weight, layer_bytes) for layer in layers]
    held = [4 * layer.width * size for layer, size in zip(layers, sizes, strict=True)]
    for group in runs_within(range(len(layers)), held.__getitem__, group_bytes):
        reservoirs = {k: _Reservoir(layers[k], sizes[k], seed + k) for k in group}
        by_value: dict[str, list[_Reservoir]] = {}
        for reservoir in reservoirs.values():
            by_value.setdefault(reservoir.layer.value, []).append(reservoir)

        stream_tensors(
            model, samples, list(by_value), _feeder(by_value), threads=threads, external=external
        )
        for k in group:
            found = reservoirs.pop(k)
            yield found.layer, found.result()
