"""The Q/DQ layout OpenVINO's CPU plugin runs fastest, from the one ONNX Runtime needs.

:class:`~mixprec.int8.qdq.QuantizeQDQPass` places Q/DQ pairs as ONNX Runtime's QDQ
selectors want them: after each INT8 layer's output (QLinearConv needs its output
quantized) and right before each INT8 layer's input. OpenVINO reads a Q/DQ pair as a
FakeQuantize and fuses it into the op before it, so two things there cost time:

- a pair after a Conv/Gemm whose readers all run float: OpenVINO computes the layer in
  INT8, requantizes, then dequantizes for the float reader, where without the pair it
  would keep the float output in the layer's post-ops (MTCNN O-Net: a PRelu between each
  Conv and its MaxPool);
- a pair after data movement (MaxPool, Reshape, Flatten...) in front of a layer: the
  mover runs float and the FakeQuantize stands alone, where a pair before it is fused
  into the producer's post-ops and the mover runs on INT8 data.

:class:`FakeQuantizeLayoutPass` moves each pair of the second kind above its mover (exact:
a per-tensor quantizer is monotone, so it commutes with taking a maximum, and any
quantizer with selecting elements) and drops the pairs of the first kind (which only
removes a rounding). What it leaves is NNCF's placement for OpenVINO: FakeQuantize on
the inputs of the quantized layers, none on their outputs. On the Intel Xeon with AMX
(2026-12-03, OpenVINO 2026.4, bf16 hint; ``python -m bench.int8.layout``): MTCNN O-Net
all-INT8 ran 1.15x the bf16 hint with the ONNX Runtime layout, 0.86x with this one
(NNCF's INT8: 0.84x).

Only the main graph holds Q/DQ pairs (the plan keeps subgraph nodes float); subgraphs
are left as they are.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.layers import is_layer
from mixprec.core.registry import node_info
from mixprec.int8.plan import runs_int8

__all__ = ["FakeQuantizeLayoutPass", "FakeQuantizeLayoutResult"]

#: Data movement (registry role "shared") that a quantizer commutes with: element
#: selection (MaxPool picks the largest, a monotone quantizer keeps it the largest).
#: Resize is "shared" too but interpolates, so a pair does not move above it.
_INTERPOLATES = frozenset({"Resize"})


@dataclasses.dataclass
class FakeQuantizeLayoutResult(ir.passes.PassResult):
    """Counts for the report: pairs moved above data movement, pairs dropped."""

    hoisted: int = 0
    dropped: int = 0

    def summary(self) -> dict[str, object]:
        return {"kind": "fake-quantize", "hoisted": self.hoisted, "dropped": self.dropped}

    def note(self) -> str:
        return (
            f"Q/DQ laid out for a FakeQuantize runtime (OpenVINO): {self.hoisted} pair moves "
            f"above data movement, {self.dropped} pairs dropped after layers read float "
            "(ONNX Runtime's integer-kernel share does not apply)"
        )


class FakeQuantizeLayoutPass(ir.passes.InPlacePass):
    """Move Q/DQ pairs above data movement and drop those after layers read float (see
    the module's text)."""

    def call(self, model: ir.Model) -> FakeQuantizeLayoutResult:
        graph = model.graph
        result = FakeQuantizeLayoutResult(model, modified=False)
        for q in [n for n in graph if n.op_type == "QuantizeLinear"]:
            while _hoist(graph, q):
                result.hoisted += 1
        for q in [n for n in graph if n.op_type == "QuantizeLinear"]:
            if _drop_after_layer(graph, q):
                result.dropped += 1
        result.modified = bool(result.hoisted or result.dropped)
        return result


def _pair(q: ir.Node) -> ir.Node | None:
    """The DequantizeLinear that alone reads ``q`` with the same scale and zero point."""
    uses = list(q.outputs[0].uses())
    if len(uses) != 1 or q.outputs[0].is_graph_output():
        return None
    dq = uses[0].node
    if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx"):
        return None
    if list(dq.inputs[1:]) != list(q.inputs[1:]) or _axis(dq) != _axis(q):
        return None
    return dq


def _axis(node: ir.Node) -> int:
    attr = node.attributes.get("axis")
    return attr.as_int() if attr is not None else 1


def _per_tensor(q: ir.Node) -> bool:
    scale = const_tensor(q.inputs[1]) if len(q.inputs) > 1 and q.inputs[1] is not None else None
    return scale is not None and int(np.prod(scale.shape.numpy())) == 1


def _single_use(value: ir.Value) -> bool:
    return len(list(value.uses())) == 1 and not value.is_graph_output()


def _hoist(graph: ir.Graph, q: ir.Node) -> bool:
    """``src -> mover -> x -> Q -> DQ -> readers`` becomes ``src -> Q -> DQ -> mover ->
    readers``, where ``x`` and ``src`` have no other reader; False where it cannot."""
    x = q.inputs[0]
    mover = x.producer() if x is not None else None
    dq = _pair(q)
    if x is None or mover is None or dq is None or mover.graph is not graph:
        return False
    if node_info(mover).int8 != "shared" or mover.op_type in _INTERPOLATES:
        return False
    if len(mover.outputs) != 1 or not _single_use(x) or not mover.inputs:
        return False
    src = mover.inputs[0]
    if src is None or not _single_use(src):
        return False
    if (source := src.producer()) is not None and source.op_type == "DequantizeLinear":
        return False  # already INT8 there (ONNX Runtime's layout shares it through the mover)
    if mover.op_type != "MaxPool" and not _per_tensor(q):
        return False  # a per-axis scale would follow the axis through a reshape
    dq_out = dq.outputs[0]
    for use in list(dq_out.uses()):
        use.node.replace_input_with(use.idx, x)
    q.replace_input_with(0, src)
    mover.replace_input_with(0, dq_out)
    for value in (q.outputs[0], dq_out):
        value.shape = src.shape.copy() if src.shape is not None else None
    graph.remove([q, dq])
    graph.insert_before(mover, [q, dq])
    return True


def _drop_after_layer(graph: ir.Graph, q: ir.Node) -> bool:
    """Remove ``layer -> x -> Q -> DQ`` where no reader of the DQ runs INT8."""
    x = q.inputs[0]
    layer = x.producer() if x is not None else None
    dq = _pair(q)
    if x is None or layer is None or dq is None or not is_layer(layer):
        return False
    if not _single_use(x):
        return False
    dq_out = dq.outputs[0]
    if any(_integer_reader(use.node) for use in dq_out.uses()):
        return False
    for use in list(dq_out.uses()):
        use.node.replace_input_with(use.idx, x)
    if dq_out.is_graph_output():
        name = dq_out.name
        for k, out in enumerate(graph.outputs):
            if out is dq_out:
                graph.outputs[k] = x
        dq_out.name, x.name = None, name
    graph.remove([q, dq], safe=True)
    return True


def _integer_reader(node: ir.Node) -> bool:
    """A reader the plan made INT8, or a Q/DQ itself."""
    return node.op_type in ("QuantizeLinear", "DequantizeLinear") or runs_int8(node)
