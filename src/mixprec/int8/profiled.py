"""INT8 placed per layer by the runtime's own profile: the layers whose part of the model
ran no faster in INT8 than in FP32 stay float.

Whole-model timing of a few blanket placements (:mod:`mixprec.int8.speed`) cannot see
that one layer loses while its neighbours win. The runtime's profiler can
(:meth:`~mixprec.runtime.engine.Engine.layer_profile`): it times every kernel of the
graph it really runs. Its kernels are not the model's nodes (a QLinearConv with its
QuantizeLinear and DequantizeLinear stands where a Conv stood, and an FP32 Conv runs as
a blocked-layout Conv between two reorders), so times are compared by region: the nodes
that keep their name in the model and in both optimized graphs (a PRelu, a MaxPool, a
Softmax) are anchors, and every kernel counts towards the first anchor
downstream of it. A weighted layer's region is the first anchor downstream of it.

On MTCNN O-Net at batch 16 (AMD EPYC, avx512_vnni, 2 threads) the first Conv's region
ran 1.04x FP32 in INT8 (its 3-channel input quantized, its output dequantized for the
PRelu) while the next three ran 0.38x-0.70x.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable

import onnx

from mixprec.runtime.engine import LayerProfile
from mixprec.runtime.timing import MARGIN

__all__ = ["slower_layers"]


def slower_layers(
    original: onnx.GraphProto, layers: Collection[str], fp32: LayerProfile, int8: LayerProfile
) -> dict[str, float]:
    """The ``layers`` (node names of ``original``) whose region ran no faster in the INT8
    model's profile than in the FP32 model's, each with that region's ratio INT8 / FP32:
    at least ``1 + MARGIN`` (a region within the noise of one kernel's median is not
    read as slower; regions without FP32 time are left out)."""
    anchors = _common(original, fp32.graph, int8.graph) - set(layers)
    fp32_cost = _region_costs(fp32.graph, fp32.seconds, anchors)
    int8_cost = _region_costs(int8.graph, int8.seconds, anchors)
    region = _regions(original.node, anchors)
    found = {}
    for name in layers:
        key = region.get(name)
        before, after = fp32_cost.get(key, 0.0), int8_cost.get(key, 0.0)
        if before > 0 and after >= before * (1.0 + MARGIN):
            found[name] = after / before
    return found


def _common(*graphs: onnx.GraphProto) -> set[str]:
    """Names of the nodes every graph has (by name alone: OpenVINO calls a MaxPool a
    Pooling layer, and a PRelu fused with its quantization a Subgraph)."""
    return set.intersection(*({n.name for n in g.node if n.name} for g in graphs))


def _regions(nodes: Iterable[onnx.NodeProto], anchors: set[str]) -> dict[str, str | None]:
    """Each node's region: the first anchor (itself included) reached downstream of it,
    nearest first; None where no anchor follows (the graph's outputs)."""
    nodes = list(nodes)
    readers = defaultdict(list)
    for node in nodes:
        for name in node.input:
            readers[name].append(node)
    found: dict[str, str | None] = {}
    for node in (n for n in nodes if n.name):  # an unnamed node is nobody's layer
        frontier, seen, anchor = [node], set[int](), None
        while frontier and anchor is None:
            following = []
            for current in frontier:
                if current.name in anchors:
                    anchor = current.name
                    break
                if id(current) in seen:
                    continue
                seen.add(id(current))
                following += [r for out in current.output for r in readers.get(out, ())]
            frontier = following
        found[node.name] = anchor
    return found


def _region_costs(
    graph: onnx.GraphProto, seconds: dict[str, float], anchors: set[str]
) -> dict[str | None, float]:
    """Seconds per region: each kernel's median time added to its node's region."""
    region = _regions(graph.node, anchors)
    costs: dict[str | None, float] = defaultdict(float)
    for name, value in seconds.items():
        if name in region:
            costs[region[name]] += value
    return costs
