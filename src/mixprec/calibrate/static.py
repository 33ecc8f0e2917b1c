"""Statistics of initializers and Constant tensors, read from their data once (no ONNX
Runtime run): the observer's statistics, and for weights per-output-channel min/max."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.observers import (
    TensorStats,
    channel_range,
    chunks_of,
    is_float_array,
    make_observer,
)
from mixprec.core.graphs import all_graphs, is_constant_node
from mixprec.core.layers import is_layer
from mixprec.core.ops import weight_out_axis
from mixprec.io.external import RELEASE_EVERY, release_mapped_pages

__all__ = ["static_stats"]

logger = logging.getLogger(__name__)


def _channel_axis(value: ir.Value, ndim: int) -> int:
    """The output-channel axis of ``value`` (of rank ``ndim``) as the weight of the first
    layer that reads it (:func:`~mixprec.core.ops.weight_out_axis`); 0 otherwise."""
    for user, index in value.uses():
        axis = weight_out_axis(user, ndim) if index == 1 and is_layer(user) else None
        if axis is not None:
            return axis
    return 0


def _constant_array(node: ir.Node) -> np.ndarray | None:
    for key, attr in node.attributes.items():
        if key == "value":
            return attr.as_tensor().numpy()
        if key == "value_float":
            return np.asarray(attr.as_float(), np.float32)
        if key == "value_floats":
            return np.asarray(attr.as_floats(), np.float32)
    return None


def _weight_stats(array: np.ndarray, kind: str, bins: int, axis: int | None) -> TensorStats:
    observer = make_observer(kind, bins)
    if kind in ("absmax", "minmax"):
        for chunk in chunks_of(array):  # same result, no full-size temporaries
            observer.update(chunk)
    else:
        observer.update(array)
    stats = observer.stats()
    if axis is None or array.ndim < 2 or array.size == 0:
        return stats
    axis %= array.ndim
    lo, hi = channel_range(array, axis)
    return dataclasses.replace(stats, channel_axis=axis, channel_min=lo, channel_max=hi)


def static_stats(
    model: ir.Model,
    external: Mapping[str, np.ndarray],
    kind: str,
    bins: int,
    only: Collection[str] | None = None,
) -> dict[str, TensorStats]:
    """Statistics of initializers and Constant tensors of every graph, from their data
    (of the names in ``only`` when given)."""
    found: dict[str, TensorStats] = {}
    for graph in all_graphs(model.graph):
        for name, value in graph.initializers.items():
            if only is not None and name not in only:
                continue
            try:
                array = external[name] if name in external else value.const_value.numpy()  # type: ignore[union-attr]
            except Exception as e:  # placeholders without data, unreadable tensors
                logger.debug("range analysis: cannot read tensor %r: %s", name, e)
                continue
            if is_float_array(array):
                found[name] = _weight_stats(
                    np.asarray(array), kind, bins, _channel_axis(value, np.ndim(array))
                )
                if array.nbytes >= RELEASE_EVERY:
                    release_mapped_pages(model)  # read once: let a mapped file's pages go
        for node in graph:
            if not is_constant_node(node) or not node.outputs[0].name:
                continue
            if only is not None and node.outputs[0].name not in only:
                continue
            array = _constant_array(node)
            if array is not None and is_float_array(array):
                axis = _channel_axis(node.outputs[0], array.ndim)
                found[node.outputs[0].name] = _weight_stats(array, kind, bins, axis)
    return found
