"""INT8 annotation: which nodes run in integer kernels, and why the others stay float.

pt2e's shape: this pass only annotates (``node.meta[INT8]``); calibration observes, and
:mod:`mixprec.int8.qdq` converts. The op roles come from the op registry
(:data:`mixprec.core.registry.INT8_ROLES`), so the policy is data.

Rules:
- a "weighted" op (Conv, MatMul, Gemm) runs in INT8 when its weight is a float constant
  (a MatMul of two activations, attention's, stays float);
- every other INT8-capable op runs in INT8 when one of its float inputs comes from an
  INT8 node, so Q/DQ pairs sit only where ONNX Runtime can keep the integer domain
  (placement "chains"); with placement "every", whenever it has a float input, as ONNX
  Runtime's ``quantize_static`` places Q/DQ (the speed plan times both); with placement
  "weighted", never (only Conv/MatMul/Gemm, and a Relu/Clip they absorb);
- excluded nodes, custom domains, nodes inside subgraphs and nodes marked
  :data:`KEEP_FLOAT` (a pass's own helper, such as SmoothQuant's ``Mul``) stay float.
"""

from __future__ import annotations

import dataclasses

import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.errors import InternalError
from mixprec.core.graphs import NodeExclusions, iter_nodes
from mixprec.core.layers import is_layer, match_layer
from mixprec.core.ops import is_onnx_domain
from mixprec.core.registry import node_info
from mixprec.int8.spec import DYNAMIC_ACTIVATION, BackendQuantizer, QuantSpec

__all__ = [
    "INT8",
    "IN_SUBGRAPH",
    "KEEP_FLOAT",
    "AnnotateInt8Pass",
    "Int8Decision",
    "activation_spec",
    "dynamic_candidate",
    "int8_decision",
    "int8_spec_decision",
    "runs_int8",
    "weight_spec",
]

#: ``node.meta`` key of the INT8 decision.
INT8 = "mixprec.int8"
#: ``node.metadata_props`` key of a node that stays float whatever the plan (the value
#: says why); kept in the saved model, where it tells the reader what the node is for.
KEEP_FLOAT = "mixprec.keep_float"
#: Why a node inside an If/Loop/Scan body stays float: calibration reads the main graph's
#: values only (a branch's are not outputs ONNX Runtime can return).
IN_SUBGRAPH = "inside a subgraph (If/Loop/Scan body): its activations cannot be calibrated"


@dataclasses.dataclass(frozen=True)
class Int8Decision:
    """Whether a node runs in INT8, its role, and why; an INT8 node also carries how its
    activations and its weight are quantized (the backend quantizer's specs)."""

    int8: bool
    role: str | None
    reason: str
    activation: QuantSpec | None = None
    weight: QuantSpec | None = None

    def as_float(self, reason: str) -> Int8Decision:
        """This node kept float after all, for ``reason``."""
        return Int8Decision(False, self.role, reason)


def int8_decision(node: ir.Node) -> Int8Decision | None:
    found = node.meta.get(INT8)
    return found if isinstance(found, Int8Decision) else None


def runs_int8(node: ir.Node) -> bool:
    """Annotate made ``node`` INT8."""
    decision = int8_decision(node)
    return decision is not None and decision.int8


def int8_spec_decision(node: ir.Node) -> Int8Decision:
    """The decision of a node annotate made INT8, with its specs.

    Raises:
        InternalError: the node has no such decision (a pass ran out of order).
    """
    decision = int8_decision(node)
    if decision is None or not decision.int8 or decision.activation is None:
        raise InternalError(f"node {node.name!r} ({node.op_type}) carries no INT8 spec")
    return decision


def activation_spec(node: ir.Node) -> QuantSpec:
    """How an INT8 node's activations are quantized."""
    spec = int8_spec_decision(node).activation
    assert spec is not None
    return spec


def weight_spec(node: ir.Node) -> QuantSpec:
    """How an INT8 weighted layer's weight is quantized.

    Raises:
        InternalError: the node is no INT8 weighted layer.
    """
    spec = int8_spec_decision(node).weight
    if spec is None:
        raise InternalError(f"node {node.name!r} ({node.op_type}) carries no weight spec")
    return spec


def _float(value: ir.Value | None) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT


def weight_index(node: ir.Node) -> int | None:
    """The input index of a weighted op's constant weight (None: no constant weight)."""
    layer = match_layer(node)
    return 1 if not isinstance(layer, str) and layer.int8 else None


class AnnotateInt8Pass(ir.passes.InPlacePass):
    """Record an :class:`Int8Decision` on every node of the main graph (analysis only).

    Args:
        exclude_nodes: node names or regular expressions kept float.
        dynamic: plan dynamic INT8 (:mod:`mixprec.int8.dynamic`): only MatMul/Gemm with a
            constant 2-D weight, activations quantized at run time.
        placement: "chains" (an op without weights runs INT8 when an INT8 node feeds it),
            "every" (whenever it has a float input) or "weighted" (never).
        quantizer: the backend quantizer whose specs each INT8 node carries
            (:meth:`mixprec.int8.config.QuantizeConfig.quantizer`).
    """

    def __init__(
        self,
        exclude_nodes: tuple[str, ...] = (),
        *,
        quantizer: BackendQuantizer,
        dynamic: bool = False,
        placement: str = "chains",
    ) -> None:
        super().__init__()
        self._quantizer = quantizer
        self._exclude = NodeExclusions(exclude_nodes)
        self._dynamic = dynamic
        self._every = placement == "every"
        self._weighted = placement == "weighted"
        self._constant: set[ir.Value] = set()

    def _int8(self, node: ir.Node, role: str | None, reason: str) -> Int8Decision:
        return Int8Decision(True, role, reason, *self._quantizer.specs(node))

    def _excluded(self, node: ir.Node) -> str | None:
        return node.metadata_props.get(KEEP_FLOAT) or self._exclude.reason(node)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        for node in iter_nodes(model.graph):
            node.meta.pop(INT8, None)
        main = set(model.graph)
        for node in iter_nodes(model.graph):
            if node not in main:
                node.meta[INT8] = Int8Decision(False, node_info(node).int8, IN_SUBGRAPH)
        self._constant = _constant_values(model.graph)
        for node in model.graph:  # topological order: producers are decided first
            node.meta[INT8] = self._decide_dynamic(node) if self._dynamic else self._decide(node)
        return ir.passes.PassResult(model, modified=False)

    def _decide_dynamic(self, node: ir.Node) -> Int8Decision:
        role = node_info(node).int8
        why = dynamic_candidate(node) or self._excluded(node)
        if why is not None:
            return Int8Decision(False, role, why)
        weight = self._quantizer.specs(node)[1]
        reason = f"{node.op_type}: dynamic INT8 (DynamicQuantizeMatMul)"
        return Int8Decision(True, role, reason, DYNAMIC_ACTIVATION, weight)

    def _decide(self, node: ir.Node) -> Int8Decision:
        info = node_info(node)
        role = info.int8
        if role is None:
            why = "custom domain" if not is_onnx_domain(node.domain) else "no INT8 kernel"
            return Int8Decision(False, None, f"{node.op_type}: {why}; stays float")
        excluded = self._excluded(node)
        if excluded:
            return Int8Decision(False, role, excluded)
        if not any(_float(v) for v in node.inputs):
            return Int8Decision(False, role, "no float input")
        if all(v is None or v in self._constant for v in node.inputs):
            # Silero VAD slices and concatenates its LSTM's weights at run time: Q/DQ there
            # quantized weights twice over, and OpenVINO 2026.4 crashed compiling it
            return Int8Decision(False, role, "computed from constants alone: no activation")
        if role == "weighted":
            if not _float(node.inputs[0]):
                return Int8Decision(False, role, "input is not float32")
            if weight_index(node) is None:
                # A MatMul of two activations (attention scores and context) stays float:
                # measured on MiniLM, quantizing it takes the sentence-embedding cosine from
                # 0.83 to 0.75.
                return Int8Decision(False, role, "weight is not a float32 constant")
            return self._int8(node, role, f"{node.op_type}: integer kernel")
        if role == "shared" and all(v.is_graph_output() and not v.uses() for v in node.outputs):
            # Q/DQ before an output only rounds it (and OpenVINO 2026.4 crashed compiling
            # one before Silero VAD's state output, fed through an Identity)
            return Int8Decision(False, role, "feeds only graph outputs: nothing runs after it")
        fed = [
            v
            for v in node.inputs
            if _float(v) and (p := v.producer()) is not None and runs_int8(p)  # type: ignore[union-attr]
        ]
        if self._every and role != "absorbed":
            return self._int8(node, role, f"{role}: INT8 wherever it has a float input")
        if self._weighted and role != "absorbed":
            return Int8Decision(False, role, "placement 'weighted': only Conv/MatMul/Gemm")
        if not fed:
            return Int8Decision(False, role, "not fed by an INT8 node: stays float")
        return self._int8(node, role, f"{role}: stays in the integer domain")


def _constant_values(graph: ir.Graph) -> set[ir.Value]:
    """The values of ``graph`` computed from constants alone (initializers that are not
    graph inputs, Constant nodes, and what only they feed)."""
    inputs = set(graph.inputs)
    found = {v for v in graph.initializers.values() if v not in inputs}
    for node in graph:  # topological order
        if (node.inputs or node.op_type == "Constant") and all(
            v is None or v in found for v in node.inputs
        ):
            found.update(node.outputs)
    return found


def dynamic_candidate(node: ir.Node) -> str | None:
    """None when ``node`` can run as a dynamic INT8 MatMul, else why not."""
    if not is_layer(node) or node_info(node).layer == "conv":
        return f"{node.op_type}: dynamic mode quantizes MatMul/Gemm weights only"
    x = node.inputs[0]
    w = node.inputs[1] if len(node.inputs) > 1 else None
    if x is None or x.dtype != ir.DataType.FLOAT:
        return "input is not float32"
    tensor = const_tensor(w) if w is not None else None
    if tensor is None or tensor.dtype != ir.DataType.FLOAT or len(tensor.shape) != 2:
        return "weight is not a 2-D float32 constant"
    if node.op_type == "Gemm":
        attrs = node.attributes
        if attrs.get("transA") is not None and attrs["transA"].as_int():
            return "Gemm with transA"
        for key in ("alpha", "beta"):
            if attrs.get(key) is not None and attrs[key].as_float() != 1.0:
                return f"Gemm with {key} != 1"
    return None
