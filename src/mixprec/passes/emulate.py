"""FP32 emulation of a float16/bfloat16 model: :class:`EmulateLowPrecisionPass`.

ONNX Runtime's CPU provider has almost no bfloat16 kernels, so a bfloat16 model usually
cannot run there. The pass rewrites a mixed-precision model into an FP32 model in which
every low-precision tensor is rounded through its low dtype by a
``Cast(to=LOW) -> Cast(to=FLOAT)`` pair; ORT's float->bfloat16 Cast rounds to nearest
even, bit-exact with ``ml_dtypes.bfloat16``. Arithmetic inside each op then happens in
FP32, so the emulation measures the effect of storing tensors in the low dtype (the main
source of error), not of low-precision accumulation inside kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import overload

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnx import shape_inference

from mixprec.core.errors import MixprecError
from mixprec.core.graphs import UniqueNames, all_graphs, iter_nodes
from mixprec.core.ops import DTYPE_ATTRS, LOW_TYPES, is_onnx_domain
from mixprec.core.registry import node_info
from mixprec.io.protos import light_copy, weightless_proto

__all__ = [
    "EmulateLowPrecisionPass",
    "EmulateLowPrecisionResult",
    "emulate_low_precision",
]

logger = logging.getLogger(__name__)

# Integer attributes that name an output element type.


@dataclasses.dataclass
class EmulateLowPrecisionResult(ir.passes.PassResult):
    """What :class:`EmulateLowPrecisionPass` changed.

    Attributes:
        round_trips: ``Cast(to=LOW) -> Cast(to=FLOAT)`` pairs inserted.
        upcast_tensors: low initializers and tensor attributes turned into float32.
        retyped_values: values whose declared low type became float32.
    """

    round_trips: int = 0
    upcast_tensors: int = 0
    retyped_values: int = 0


def _inferred_dtypes(model: ir.Model) -> dict[str, ir.DataType]:
    """Element types by value name from ONNX shape inference on a weightless copy.

    Read only to fill in values the model leaves untyped; the model is not changed.
    """
    try:
        proto, _ = weightless_proto(model, with_arrays=False)
        inferred = shape_inference.infer_shapes(
            light_copy(proto), check_type=False, strict_mode=False, data_prop=False
        )
    except Exception as e:
        logger.warning("shape inference failed, using declared types only: %s", e)
        return {}
    found: dict[str, ir.DataType] = {}
    graphs = [inferred.graph]
    while graphs:
        graph = graphs.pop()
        for vi in [*graph.value_info, *graph.output, *graph.input]:
            elem = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else 0
            if elem:
                found.setdefault(vi.name, ir.DataType(elem))
        for node in graph.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else list(attr.graphs))
    return found


def _guess_dtype(node: ir.Node, dtypes: dict[ir.Value, ir.DataType]) -> ir.DataType | None:
    """Element type of ``node``'s first output from its op alone (Cast, Constant, ...)."""
    if not is_onnx_domain(node.domain):
        return None
    if node.op_type == "Cast" and "to" in node.attributes:
        return ir.DataType(node.attributes["to"].as_int())
    if node.op_type == "Constant" and "value" in node.attributes:
        return node.attributes["value"].as_tensor().dtype
    if node_info(node).same_type and node.inputs:
        source = node.inputs[1] if node.op_type == "Where" and len(node.inputs) > 1 else None
        source = source or node.inputs[0]
        return dtypes.get(source) if source is not None else None
    return None


def element_types(model: ir.Model) -> dict[ir.Value, ir.DataType]:
    """Element type of every tensor value of ``model`` (subgraphs included) that is known.

    Declared types first; then ONNX shape inference (only when a node output is
    untyped); then Cast/Constant and the registry's ``same_type`` ops, node by node.
    """
    dtypes: dict[ir.Value, ir.DataType] = {}
    for graph in all_graphs(model.graph):
        for value in [*graph.inputs, *graph.initializers.values()]:
            if value.dtype is not None:
                dtypes[value] = value.dtype
    nodes = list(iter_nodes(model.graph))
    untyped = any(v.dtype is None for n in nodes for v in n.outputs if v.name)
    inferred = _inferred_dtypes(model) if untyped else {}
    for node in nodes:
        for value in node.outputs:
            if value.dtype is not None:
                dtypes[value] = value.dtype
            elif value.name in inferred:
                dtypes[value] = inferred[value.name]
        guess = _guess_dtype(node, dtypes)
        if guess is None:
            continue
        targets = node.outputs if node.op_type == "Split" else node.outputs[:1]
        for value in targets:
            dtypes.setdefault(value, guess)
    return dtypes


def _float_type(tp: ir.TypeProtocol | None) -> ir.TypeProtocol | None:
    """``tp`` with every float16/bfloat16 element type made float32; None if unchanged."""
    if isinstance(tp, ir.TensorType) and tp.dtype in LOW_TYPES:
        return ir.TensorType(ir.DataType.FLOAT)
    if isinstance(tp, ir.SequenceType | ir.OptionalType):
        inner = _float_type(tp.elem_type)
        if inner is not None:
            return type(tp)(inner)
    return None


def _upcast(tensor: ir.TensorProtocol, name: str | None) -> ir.TensorProtocol:
    """The float32 tensor of exactly the values of a float16/bfloat16 tensor."""
    try:
        values = tensor.numpy().astype(np.float32)
    except Exception as e:
        raise MixprecError(f"cannot read low-precision tensor {name!r}: {e}") from e
    return ir.tensor(values, name=name)


class EmulateLowPrecisionPass(ir.passes.InPlacePass):
    """Rewrites a float16/bfloat16 model into an FP32 model with the same rounding.

    * low initializers and Constant/attribute tensors become float32 tensors of the same
      values;
    * each node output typed low is computed in float32 and followed by
      ``Cast(to=LOW) -> Cast(to=FLOAT)``; the rounded value takes the original name, so
      consumers and graph outputs see it (low graph outputs become float32);
    * ``Cast(to=LOW)`` (and other ``to``/``dtype`` attributes naming a low type) name
      float32 instead, followed by that round trip;
    * low main-graph inputs become float32 inputs followed by the round trip (they are
      then fed as float32);
    * If/Loop/Scan bodies are handled the same way; their low inputs and outputs become
      float32 (rounding happens at the producers).

    A node output whose type is unknown (some custom-domain ops) is computed in float32
    without rounding. Model-local functions are inlined first. ``modified`` is False
    exactly when the model has no low-precision tensor, type or function.

    Example:
        >>> result = EmulateLowPrecisionPass()(model)             # doctest: +SKIP
        >>> result.modified, result.round_trips                    # doctest: +SKIP
        (True, 3)
    """

    def call(self, model: ir.Model) -> EmulateLowPrecisionResult:
        inlined = bool(model.functions)
        if inlined:
            common.InlinePass()(model)
        dtypes = element_types(model)
        result = EmulateLowPrecisionResult(model, inlined)
        self._mids: set[ir.Value] = set()  # the low values of the round trips
        names = UniqueNames(model)
        for graph in all_graphs(model.graph):
            self._upcast_initializers(graph, result)
            for node in list(graph):
                self._upcast_attributes(node, result)
                for value in node.outputs:
                    low = dtypes.get(value)
                    if low in LOW_TYPES and value.name:
                        self._round_after(graph, node, value, low, names)
                        result.round_trips += 1
        for value in list(model.graph.inputs):
            low = dtypes.get(value)
            if low in LOW_TYPES and value.uses():
                self._round_inputs(model.graph, value, low, names)
                result.round_trips += 1
        result.retyped_values = self._retype_values(model, self._mids)
        result.modified = bool(
            inlined or result.round_trips or result.upcast_tensors or result.retyped_values
        )
        return result

    @staticmethod
    def _upcast_initializers(graph: ir.Graph, result: EmulateLowPrecisionResult) -> None:
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if tensor is not None and tensor.dtype in LOW_TYPES:
                value.const_value = _upcast(tensor, name)
                value.dtype = ir.DataType.FLOAT
                result.upcast_tensors += 1

    @staticmethod
    def _upcast_attributes(node: ir.Node, result: EmulateLowPrecisionResult) -> None:
        standard = is_onnx_domain(node.domain)
        for key, attr in list(node.attributes.items()):
            new: ir.Attr | None = None
            if attr.type == ir.AttributeType.TENSOR and attr.as_tensor().dtype in LOW_TYPES:
                new = ir.AttrTensor(key, _upcast(attr.as_tensor(), attr.as_tensor().name))
            elif attr.type == ir.AttributeType.TENSORS and any(
                t.dtype in LOW_TYPES for t in attr.as_tensors()
            ):
                tensors = [
                    _upcast(t, t.name) if t.dtype in LOW_TYPES else t for t in attr.as_tensors()
                ]
                new = ir.AttrTensors(key, tensors)
            elif attr.type == ir.AttributeType.TYPE_PROTO:
                floated = _float_type(attr.value.type)
                if floated is not None:
                    new = ir.AttrTypeProto(key, ir.TypeAndShape(floated, attr.value.shape))
            elif (
                attr.type == ir.AttributeType.INT
                and standard
                and key in DTYPE_ATTRS
                and attr.as_int() in LOW_TYPES
            ):
                new = ir.AttrInt64(key, ir.DataType.FLOAT)
            if new is not None:
                node.attributes[key] = new
                result.upcast_tensors += 1

    def _round_trip(
        self, source: ir.Value, low: ir.DataType, rounded: ir.Value, names: UniqueNames
    ) -> list[ir.Node]:
        """``rounded = Cast(Cast(source, to=low), to=FLOAT)``."""
        base = rounded.name or "value"
        mid = ir.Value(name=names.fresh(f"{base}__mixprec_{low.name.lower()}"))
        # Left untyped: no value_info then names a low type (checkers read the Cast).
        self._mids.add(mid)
        return [
            ir.Node(
                "",
                "Cast",
                [source],
                attributes=[ir.AttrInt64("to", low)],
                outputs=[mid],
                name=names.fresh(f"{mid.name}__cast"),
            ),
            ir.Node(
                "",
                "Cast",
                [mid],
                attributes=[ir.AttrInt64("to", ir.DataType.FLOAT)],
                outputs=[rounded],
                name=names.fresh(f"{base}__mixprec_fp32__cast"),
            ),
        ]

    def _round_after(
        self,
        graph: ir.Graph,
        node: ir.Node,
        value: ir.Value,
        low: ir.DataType,
        names: UniqueNames,
    ) -> None:
        """Rounds ``value`` through ``low`` right after ``node``; the result keeps its name."""
        original = value.name
        rounded = ir.Value(shape=value.shape, type=ir.TensorType(ir.DataType.FLOAT))
        value.replace_all_uses_with(rounded, replace_graph_outputs=True)
        value.name = names.fresh(f"{original}__mixprec_raw")
        rounded.name = original
        graph.insert_after(node, self._round_trip(value, low, rounded, names))

    def _round_inputs(
        self, graph: ir.Graph, value: ir.Value, low: ir.DataType, names: UniqueNames
    ) -> None:
        """Feeds every use of the graph input ``value`` its rounded copy."""
        rounded = ir.Value(
            name=names.fresh(f"{value.name}__mixprec_rounded"),
            shape=value.shape,
            type=ir.TensorType(ir.DataType.FLOAT),
        )
        for user, index in list(value.uses()):
            user.replace_input_with(index, rounded)
        nodes = self._round_trip(value, low, rounded, names)
        if len(graph):
            graph.insert_before(graph.node(0), nodes)
        else:
            graph.extend(nodes)

    @staticmethod
    def _retype_values(model: ir.Model, keep: set[ir.Value]) -> int:
        count = 0
        for graph in all_graphs(model.graph):
            values = [*graph.inputs, *graph.outputs, *graph.initializers.values()]
            values += [v for node in graph for v in node.outputs]
            for value in dict.fromkeys(values):
                if value in keep:
                    continue
                floated = _float_type(value.type)
                if floated is not None:
                    value.type = floated
                    count += 1
        return count


@overload
def emulate_low_precision(model: onnx.ModelProto) -> onnx.ModelProto: ...
@overload
def emulate_low_precision(model: ir.Model) -> ir.Model: ...
def emulate_low_precision(model: onnx.ModelProto | ir.Model) -> onnx.ModelProto | ir.Model:
    """An FP32 model that reproduces the rounding of a float16/bfloat16 model.

    A copy of ``model`` rewritten by :class:`EmulateLowPrecisionPass`, in the form it was
    given (proto or ``onnx_ir``).

    Args:
        model: A mixed-precision model (not modified).

    Returns:
        The FP32 emulation model.

    Raises:
        MixprecError: A low-precision tensor's data cannot be read (external data not
            loaded).

    Example:
        >>> emulated = emulate_low_precision(onnx.load("m_bf16.onnx"))  # doctest: +SKIP
    """
    if isinstance(model, ir.Model):
        work = ir.from_proto(ir.to_proto(model))
        EmulateLowPrecisionPass()(work)
        return work
    work = ir.from_proto(model)  # tensors are wrapped, never written: ``model`` is intact
    EmulateLowPrecisionPass()(work)
    return ir.to_proto(work)
