"""Rewrite the MatMuls and Gathers :class:`~mixprec.weights.select.SelectWeightsPass` marked
int4/int8 into ONNX Runtime's weight-only contrib ops.

* ``MatMul(x, W)`` -> ``com.microsoft.MatMulNBits(x, B, scales[, zero_points])`` with
  ``K``, ``N``, ``bits``, ``block_size`` and ``accuracy_level``; it keeps the MatMul's
  name, output and decision.
* ``Gather(table, ids)`` -> ``com.microsoft.GatherBlockQuantized(data, ids, scales[,
  zero_points])`` over the table's rows, blocks along the row (``H``). A Gather whose
  table an lm_head of the same precision quantizes reads that ``MatMulNBits``' ``B``
  itself (its codes are the table's, row by row), as ``[..., n_blocks, block_size]``
  reshaped (and sliced when the last block is padded) back to ``[..., H]``; the table is
  then stored once. A 4-bit table of odd width takes the same reshaped form.

The float weights no longer read are left for ``RemoveUnusedNodesPass`` to drop, and the
``com.microsoft`` opset (version 1) is declared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import UniqueNames, add_initializer
from mixprec.io.external import RELEASE_EVERY, release_mapped_pages
from mixprec.weights.blocks import (
    BlockQuant,
    BlockSpec,
    gather_arrays,
    matmul_nbits_arrays,
)
from mixprec.weights.config import WeightsConfig
from mixprec.weights.inputs import LAYER_INPUTS, LayerData
from mixprec.weights.methods import WeightMethod
from mixprec.weights.select import WEIGHTS, WeightDecision, WeightSource, weight_decision
from mixprec.weights.slices import SLICE_BYTES, quantize_in_slices

__all__ = ["MS_DOMAIN", "QuantizeWeightsPass", "QuantizeWeightsResult"]

MS_DOMAIN = "com.microsoft"


@dataclasses.dataclass
class QuantizeWeightsResult(ir.passes.PassResult):
    """What was quantized (node -> how), left float (node -> why), and the bytes.

    ``float_bytes``: the float weights the quantized nodes read (each tensor once);
    ``packed_bytes``: the codes, scales and zero points written in their place;
    ``methods``: the method each quantized node's codes came from, and ``fallbacks``
    why, for those where it is not the one asked for.
    """

    quantized: dict[str, str] = dataclasses.field(default_factory=dict)
    methods: dict[str, str] = dataclasses.field(default_factory=dict)
    fallbacks: dict[str, str] = dataclasses.field(default_factory=dict)
    left_float: dict[str, str] = dataclasses.field(default_factory=dict)
    float_bytes: int = 0
    packed_bytes: int = 0
    shared_tables: list[str] = dataclasses.field(default_factory=list)
    levels: dict[int, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Packed:
    """A MatMulNBits' initializers, made once per weight and precision. ``quant`` (the
    unpacked codes, 1 byte per weight) is kept only for a table's transpose, whose codes
    a tied Gather may read; others let it go once packed (a large model's would add up
    to a quarter of its float size)."""

    spec: BlockSpec
    method: str
    quant: BlockQuant | None
    b: ir.Value
    scales: ir.Value
    zero_points: ir.Value | None
    attributes: dict[str, int]


class QuantizeWeightsPass(ir.passes.InPlacePass):
    """Rewrite the nodes marked int4/int8 (module doc).

    Args:
        config: block size, symmetry, accuracy level.
        method: the quantization method (:func:`~mixprec.weights.methods.resolve_method`).
    """

    def __init__(self, config: WeightsConfig, method: WeightMethod) -> None:
        super().__init__()
        self.config = config
        self.method = method

    def call(self, model: ir.Model) -> QuantizeWeightsResult:
        self._model = model
        self._graph = model.graph
        self._names = UniqueNames(model)
        self._packed: dict[tuple[ir.Value, bool, str], _Packed] = {}
        self._seen: set[ir.Value] = set()
        result = QuantizeWeightsResult(model, modified=False)
        self._result = result
        marked = [(n, d) for n in model.graph if (d := weight_decision(n)) and d.quantized]
        for node, decision in marked:  # MatMuls first: a tied Gather reads their codes
            if node.op_type == "MatMul":
                self._matmul(node, decision)
        for node, decision in marked:
            if node.op_type == "Gather":
                self._gather(node, decision)
        if result.quantized:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            result.modified = True
        return result

    # --- quantization, once per weight ------------------------------------------------------

    def _quantized(self, source: WeightSource, precision: str, inputs: object) -> _Packed:
        key = (source.value, source.transposed, precision)
        if key not in self._packed:
            spec = self.config.spec(precision)
            quant = self._quantize(source, spec, inputs)
            arrays = matmul_nbits_arrays(quant)
            base = source.value.name or "weight"
            b = self._initializer(f"{base}_q{spec.bits}", arrays.b)
            scales = self._initializer(f"{base}_q{spec.bits}_scales", arrays.scales)
            zero = arrays.zero_points
            zp = None if zero is None else self._initializer(f"{base}_q{spec.bits}_zp", zero)
            kept = quant if source.transposed else None
            used = self.method.used_for(inputs)
            self._packed[key] = _Packed(spec, used, kept, b, scales, zp, arrays.attributes)
            self._count_float(source.value)
        return self._packed[key]

    def _quantize(self, source: WeightSource, spec: BlockSpec, inputs: object) -> BlockQuant:
        """The method's codes for ``source``: a large weight is quantized a slice of
        columns at a time (each slice with the layer's statistics, if any), and a
        memory-mapped weight's pages are let go after it is read
        (:mod:`mixprec.weights.slices`); a small one with statistics once, cached (the
        ranking made the same codes)."""
        matrix = source.matrix()
        if isinstance(inputs, LayerData) and matrix.nbytes <= SLICE_BYTES:
            return self.method.quantize(matrix, spec, inputs)
        data = inputs if isinstance(inputs, LayerData) else None

        def one(w: np.ndarray) -> BlockQuant:
            return self.method.quantize(w, spec, data.for_slice() if data else None)

        release = self._release
        quant = quantize_in_slices(one, matrix, release)
        if matrix.nbytes >= RELEASE_EVERY:
            release()
        return quant

    def _release(self) -> None:
        release_mapped_pages(self._model)

    def _count_float(self, value: ir.Value) -> None:
        if value not in self._seen:
            self._seen.add(value)
            tensor = const_tensor(value)
            self._result.float_bytes += tensor.nbytes if tensor is not None else 0

    def _initializer(self, base: str, array: np.ndarray) -> ir.Value:
        self._result.packed_bytes += array.nbytes
        return add_initializer(self._graph, self._names, base, array)

    # --- MatMul -> MatMulNBits --------------------------------------------------------------

    def _matmul(self, node: ir.Node, decision: WeightDecision) -> None:
        source = _source(node, decision, self._graph)
        packed = self._quantized(source, decision.precision, node.meta.get(LAYER_INPUTS))
        spec = packed.spec
        level, why = self.config.level(spec.bits)
        self._result.levels.setdefault(spec.bits, why)
        attrs = [ir.AttrInt64(k, v) for k, v in packed.attributes.items()]
        attrs.append(ir.AttrInt64("accuracy_level", level))
        inputs = [node.inputs[0], packed.b, packed.scales]
        if packed.zero_points is not None:
            inputs.append(packed.zero_points)
        new = self._node("MatMulNBits", inputs, attrs, node, MS_DOMAIN)
        self._replace(node, [new])
        self._result.quantized[node.name or ""] = f"{spec.describe()}, accuracy_level {level}"
        tied = "tied to an embedding table" if decision.table is not None else ""
        self._method(node, packed.method, tied or "no input statistics were recorded for it")

    def _method(self, node: ir.Node, used: str, why: str) -> None:
        """Record the method ``node``'s codes came from, and ``why`` when it is not the
        one asked for."""
        self._result.methods[node.name or ""] = used
        if used != self.method.name:
            self._result.fallbacks[node.name or ""] = f"{used}: {why}"

    # --- Gather -> GatherBlockQuantized -----------------------------------------------------

    def _gather(self, node: ir.Node, decision: WeightDecision) -> None:
        table, indices = node.inputs[0], node.inputs[1]
        assert table is not None and indices is not None
        source = WeightSource(table, True)  # the table's rows are the columns of table.T
        rank = indices.shape.rank() if indices.shape is not None else None
        key = (table, True, decision.precision)
        shared = decision.table is not None and key in self._packed
        spec = self.config.spec(decision.precision)
        tensor = const_tensor(table)
        assert tensor is not None
        width = int(tensor.shape.numpy()[1])
        odd = (width * spec.bits) % 8 != 0
        if rank is None and not odd:
            shared = False  # its own rows-layout copy: no reshape back needed
        reshaped = shared or odd
        if reshaped and rank is None:
            why = "indices of unknown rank: the codes cannot be reshaped back; stays float"
            node.meta[WEIGHTS] = WeightDecision("float", decision.role, why)
            self._result.left_float[node.name or ""] = why
            return
        if shared:
            kept = self._packed[key].quant
            assert kept is not None  # a table's transpose keeps its codes
            quant = kept
            data = self._packed[key].b
            self._result.shared_tables.append(table.name or "")
            used, why = self._packed[key].method, "codes shared with the lm_head"
        else:
            quant = self._quantize(source, spec, None)
            self._count_float(table)
            used, why = self.method.used_for(None), "an embedding table (no input statistics)"
        self._method(node, used, why)
        arrays = gather_arrays(quant, shared=reshaped)
        base = table.name or "table"
        if not shared:
            data = self._initializer(f"{base}_g{spec.bits}", arrays.data)
        inputs = [data, indices, self._initializer(f"{base}_g{spec.bits}_scales", arrays.scales)]
        if arrays.zero_points is not None:
            inputs.append(self._initializer(f"{base}_g{spec.bits}_zp", arrays.zero_points))
        attrs = [ir.AttrInt64(k, v) for k, v in arrays.attributes.items()]
        gather = self._node("GatherBlockQuantized", inputs, attrs, node, MS_DOMAIN)
        nodes = [gather]
        if reshaped:
            assert rank is not None
            nodes += self._back_to_rows(gather, rank, quant.n_blocks * spec.block_size, width)
        self._replace(node, nodes)
        how = spec.describe() + (", codes shared with the lm_head" if shared else "")
        self._result.quantized[node.name or ""] = how

    def _back_to_rows(self, gather: ir.Node, rank: int, padded: int, width: int) -> list[ir.Node]:
        """Reshape ``[..., n_blocks, block_size]`` to ``[..., n_blocks * block_size]`` and
        slice off the last block's padding."""
        base = gather.name or "gather"
        dims = np.array([0] * rank + [padded], dtype=np.int64)
        shape = self._initializer(f"{base}_rows", dims)
        reshape = self._node("Reshape", [gather.outputs[0], shape], [], gather, "", "Reshape")
        if padded == width:
            return [reshape]
        ends = [self._initializer(f"{base}_{k}", np.array([v], np.int64)) for k, v in
                (("starts", 0), ("ends", width), ("axes", -1))]  # fmt: skip
        slice_ = self._node("Slice", [reshape.outputs[0], *ends], [], gather, "", "Slice")
        return [reshape, slice_]

    # --- graph edits ------------------------------------------------------------------------

    def _node(
        self,
        op: str,
        inputs: Sequence[ir.Value | None],
        attributes: list[ir.Attr],
        like: ir.Node,
        domain: str,
        suffix: str = "",
    ) -> ir.Node:
        base = like.name or op
        name = self._names.fresh(f"{base}_{suffix}") if suffix else base
        output = ir.Value(
            name=self._names.fresh(f"{name}_out"), type=ir.TensorType(ir.DataType.FLOAT)
        )
        return ir.Node(domain, op, inputs, attributes=attributes, outputs=[output], name=name)

    def _replace(self, old: ir.Node, new: list[ir.Node]) -> None:
        """``new`` in place of ``old``: the first takes its name and meta (the report's
        row), the last its output value (name, type, readers, graph outputs)."""
        first = new[0]
        name = old.name
        first.meta.update(old.meta)
        ir.convenience.replace_nodes_and_values(
            self._graph, old, [old], new, [old.outputs[0]], [new[-1].outputs[0]]
        )
        first.name = name


def _source(node: ir.Node, decision: WeightDecision, graph: ir.Graph) -> WeightSource:
    """What a MatMul quantizes: the tied table (transposed) when its lm_head is tied to
    one, so a Gather of that table can read the same codes; else its own weight."""
    if decision.table is not None:
        table = _value_named(graph, decision.table)
        if table is not None and const_tensor(table) is not None:
            return WeightSource(table, True)
    weight = node.inputs[1]
    assert weight is not None
    if const_tensor(weight) is not None:
        return WeightSource(weight, False)
    producer = weight.producer()
    assert producer is not None and producer.inputs[0] is not None
    return WeightSource(producer.inputs[0], True)


def _value_named(graph: ir.Graph, name: str) -> ir.Value | None:
    """The initializer or node output called ``name`` in ``graph``."""
    if name in graph.initializers:
        return graph.initializers[name]
    return next((v for n in graph for v in n.outputs if v.name == name), None)
