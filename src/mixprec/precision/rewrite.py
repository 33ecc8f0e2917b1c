"""Rewriting passes: apply painted decisions, store weights in low precision, place casts.

Mechanism only: the decisions come from :mod:`mixprec.precision.paint`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

from mixprec.core.constants import const_tensor
from mixprec.core.graphs import (
    UniqueNames,
    all_graphs,
    if_branch_owners,
    is_constant_node,
    iter_nodes,
    keeps_io_dtype,
)
from mixprec.core.ops import FLOAT_TYPES, is_onnx_domain
from mixprec.core.policy import SHAPE_ONLY_OPS, Policy, rule_for
from mixprec.core.schema import SlotInfo
from mixprec.io.external import RELEASE_EVERY, SHARED_TENSORS, release_mapped_pages
from mixprec.precision.paint import Decision, Precision, painted, slots_of

__all__ = [
    "ApplyPrecisionPass",
    "ApplyPrecisionResult",
    "RemoveRedundantCastsPass",
    "RemoveRedundantCastsResult",
]

_NUMPY_DTYPE = {
    ir.DataType.FLOAT16: np.dtype(np.float16),
    ir.DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
}


#: Converted weight bytes after which the pages of memory-mapped external data are
#: released (a large model's float32 weights never all stay resident at once).


@dataclasses.dataclass
class WeightStats:
    """What happened to float32 constants (initializers and Constant nodes)."""

    converted: int = 0
    converted_bytes_before: int = 0
    converted_bytes_after: int = 0
    duplicated: int = 0  # small weights read by both precisions: a low copy was added
    cast_at_runtime: int = 0  # large weights read by both precisions: one Cast node
    flushed_to_zero: int = 0  # non-zero values that became 0 in the target dtype
    overflowed: int = 0  # finite values that became inf (only in force_all mode)
    clipped: int = 0  # values clipped to the target range (clip_weights=True)


@dataclasses.dataclass
class ApplyPrecisionResult(ir.passes.PassResult):
    casts_inserted: int = 0
    retargeted_casts: list[str] = dataclasses.field(default_factory=list)
    weights: WeightStats = dataclasses.field(default_factory=WeightStats)


def _short(dtype: ir.DataType) -> str:
    return {ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16", ir.DataType.FLOAT: "fp32"}[
        dtype
    ]


class ApplyPrecisionPass(ir.passes.InPlacePass):
    """Retype low-precision nodes, convert weights and insert shared casts.

    One Cast per (tensor, dtype), placed right after the tensor's producer (or at the
    top of the graph that owns a graph input or initializer) so nodes stay in
    topological order; every consumer needing that dtype shares it.

    Args:
        policy: the resolved policy (target dtype, output_fp32 ops).
        decisions: node decisions; None (the default) reads those
            :class:`~mixprec.precision.paint.PaintPass` recorded in ``node.meta``.
        slots: float slots per paintable node; None reads them from ``node.meta``.
        keep_io_types: True/False, or the names of main-graph inputs/outputs that keep
            float32.
        small_weight_bytes: a weight read by both precisions is duplicated (one low copy)
            when its float32 size is at most this; larger ones get one Cast node.
        clip_weights: clip constants to the target range instead of keeping their
            consumers in FP32 (only meaningful with force_all).
    """

    def __init__(
        self,
        policy: Policy,
        decisions: Mapping[ir.Node, Decision] | None = None,
        slots: Mapping[ir.Node, SlotInfo] | None = None,
        *,
        keep_io_types: bool | frozenset[str] = True,
        small_weight_bytes: int = 256 * 1024,
        clip_weights: bool = False,
    ) -> None:
        super().__init__()
        self.policy = policy
        self._given = (decisions, slots)
        self.decisions: Mapping[ir.Node, Decision] = {}
        self.slots: Mapping[ir.Node, SlotInfo] = {}
        self.keep_io_types = keep_io_types
        self.small_weight_bytes = small_weight_bytes
        self.clip_weights = clip_weights

    def _is_low(self, node: ir.Node) -> bool:
        d = self.decisions.get(node)
        return d is not None and d.precision is Precision.LOW

    def _keeps(self, value: ir.Value, main: ir.Graph) -> bool:
        return value.graph is not main or keeps_io_dtype(self.keep_io_types, value)

    def call(self, model: ir.Model) -> ApplyPrecisionResult:
        decisions, slots = self._given
        self.decisions = decisions if decisions is not None else dict(painted(model))
        if slots is None:
            found = ((n, slots_of(n)) for n in iter_nodes(model.graph))
            slots = {n: info for n, info in found if info is not None}
        self.slots = slots
        self._target = self.policy.target_type
        self._model = model
        self._main = model.graph
        self._names = UniqueNames(model)
        self._owners = if_branch_owners(model.graph)
        self._produced_low: set[ir.Value] = set()
        result = ApplyPrecisionResult(model, modified=False)
        need = self._needs()
        graph_outputs: dict[ir.Value, list[tuple[ir.Graph, int]]] = defaultdict(list)
        for graph in all_graphs(self._main):
            for k, value in enumerate(graph.outputs):
                if value.dtype == ir.DataType.FLOAT:
                    graph_outputs[value].append((graph, k))
        hand_fp32 = self._retype_low_nodes(result)
        self._lower_main_inputs(result)
        self._place_weights(need, graph_outputs, result)
        self._cast_boundaries(need, result)
        self._hand_on_fp32(hand_fp32, graph_outputs, result)
        self._cast_graph_outputs(graph_outputs, result)
        return result

    # -- the steps of call, in order -----------------------------------------------------

    def _needs(self) -> dict[ir.Value, dict[ir.DataType, list[tuple[ir.Node, int]]]]:
        """1. Which dtype each (value, use) needs, decided on the original types."""
        need: dict[ir.Value, dict[ir.DataType, list[tuple[ir.Node, int]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for node, info in self.slots.items():
            low = self._is_low(node)
            for i, value in enumerate(node.inputs):
                if value is None or value.dtype != ir.DataType.FLOAT:
                    continue
                want = self._target if low and i in info.inputs else ir.DataType.FLOAT
                need[value][want].append((node, i))
        # Float32 inputs of nodes that are not paintable (no convertible slot) need float32.
        for node in iter_nodes(self._main):
            if node in self.slots or is_constant_node(node) or node.op_type in SHAPE_ONLY_OPS:
                continue
            for i, value in enumerate(node.inputs):
                if value is not None and value.dtype == ir.DataType.FLOAT:
                    need[value][ir.DataType.FLOAT].append((node, i))
        return need

    def _retype_low_nodes(self, result: ApplyPrecisionResult) -> list[ir.Value]:
        """2. Retype the outputs of low-precision nodes; retarget Cast(to=float).

        Returns the values that output_fp32 ops hand on in float32.
        """
        target = self._target
        hand_fp32: list[ir.Value] = []
        for node, info in self.slots.items():
            if not self._is_low(node):
                continue
            if node.op_type == "Cast" and is_onnx_domain(node.domain):
                to = node.attributes.get("to")
                if to is not None and to.as_int() == ir.DataType.FLOAT:
                    node.attributes["to"] = ir.AttrInt64("to", int(target))
                    result.retargeted_casts.append(node.name or "")
                    result.modified = True
                else:
                    continue
            for j in info.outputs:
                value = node.outputs[j]
                # exact ``modified``: a rerun on its own output retypes nothing
                result.modified = result.modified or value.dtype != target
                value.dtype = target
                self._produced_low.add(value)
            if rule_for(node).output_fp32 or node.op_type in self.policy.output_fp32_ops:
                hand_fp32.extend(node.outputs[j] for j in info.outputs)
        return hand_fp32

    def _lower_main_inputs(self, result: ApplyPrecisionResult) -> None:
        """3. Main-graph inputs that do not keep float32 become low precision."""
        main = self._main
        for value in main.inputs:
            if value.dtype == ir.DataType.FLOAT and not self._keeps(value, main):
                if value.name in main.initializers:
                    continue
                value.dtype = self._target
                self._produced_low.add(value)
                result.modified = True

    def _place_weights(
        self,
        need: dict[ir.Value, dict[ir.DataType, list[tuple[ir.Node, int]]]],
        graph_outputs: Mapping[ir.Value, list[tuple[ir.Graph, int]]],
        result: ApplyPrecisionResult,
    ) -> None:
        """4. Weights: convert in place, duplicate or cast once."""
        target, main = self._target, self._main
        unreleased = 0  # float32 bytes read from mapped files since their pages were released
        for value, by_dtype in list(need.items()):
            if value in self._produced_low or value.is_graph_input():
                continue
            if not (value.is_initializer() or _constant_producer(value)):
                continue
            low_uses = by_dtype.get(target, [])
            f32_uses = by_dtype.get(ir.DataType.FLOAT, [])
            places = graph_outputs.get(value, [])
            wants = [self._output_want(g, k, main) for g, k in places]
            low_places = [place for place, w in zip(places, wants, strict=True) if w == target]
            keeps_f32 = bool(f32_uses) or ir.DataType.FLOAT in wants
            if not low_uses and not low_places:
                continue
            result.modified = True
            if not keeps_f32:
                self._convert_weight_in_place(value, target, result.weights)
                self._produced_low.add(value)
                del need[value]
                unreleased += _nbytes(value) * 2  # now low precision: half its float32 size
                if unreleased >= RELEASE_EVERY:
                    release_mapped_pages(self._model)
                    unreleased = 0
            elif _nbytes(value) <= self.small_weight_bytes:
                copy = self._low_copy(value, target, self._names, result.weights)
                for node, i in low_uses:
                    node.replace_input_with(i, copy)
                for graph, k in low_places:
                    graph.outputs[k] = copy
                result.weights.duplicated += 1
                by_dtype.pop(target, None)
            else:
                result.weights.cast_at_runtime += 1  # the generic cast below handles it

    def _cast_boundaries(
        self,
        need: Mapping[ir.Value, Mapping[ir.DataType, list[tuple[ir.Node, int]]]],
        result: ApplyPrecisionResult,
    ) -> None:
        """5. Casts at every remaining precision boundary, one per (tensor, dtype)."""
        for value, by_dtype in need.items():
            have = self._target if value in self._produced_low else ir.DataType.FLOAT
            for want, uses in by_dtype.items():
                if want == have or not uses:
                    continue
                cast_out = self._cast(value, want, self._names)
                for node, i in uses:
                    node.replace_input_with(i, cast_out)
                result.casts_inserted += 1
                result.modified = True

    def _hand_on_fp32(
        self,
        hand_fp32: list[ir.Value],
        graph_outputs: dict[ir.Value, list[tuple[ir.Graph, int]]],
        result: ApplyPrecisionResult,
    ) -> None:
        """6. Values handed on in float32 by output_fp32 ops: all uses read a float32 copy."""
        for value in hand_fp32:
            users = [(u.node, u.idx) for u in value.uses()]
            if not users and value not in graph_outputs:
                continue
            cast_out = self._cast(value, ir.DataType.FLOAT, self._names)
            for node, i in users:
                if node is not cast_out.producer():
                    node.replace_input_with(i, cast_out)
            for graph, k in graph_outputs.pop(value, []):
                graph.outputs[k] = cast_out
            result.casts_inserted += 1

    def _cast_graph_outputs(
        self,
        graph_outputs: Mapping[ir.Value, list[tuple[ir.Graph, int]]],
        result: ApplyPrecisionResult,
    ) -> None:
        """7. Graph outputs: the main graph's keep float32 (keep_io_types) under their
        names; an If branch's outputs follow the If node; Loop/Scan bodies' keep float32."""
        target, main, names = self._target, self._main, self._names
        for value, places in graph_outputs.items():
            have = target if value in self._produced_low else ir.DataType.FLOAT
            kept_main = [(g, k) for g, k in places if g is main and self._keeps(value, main)]
            if have == target and kept_main:
                cast_out = self._cast(value, ir.DataType.FLOAT, names)
                # The graph output keeps its name: the low-precision tensor is renamed.
                old_name = value.name or names.fresh("output")
                value.name = names.fresh(f"{old_name}_{_short(target)}")
                cast_out.name = old_name
                producer = cast_out.producer()
                assert producer is not None
                producer.name = names.fresh(f"{old_name}_cast_fp32")
                for graph, k in kept_main:
                    graph.outputs[k] = cast_out
                result.casts_inserted += 1
                result.modified = True
            for graph, k in places:
                if graph is main:
                    continue
                wanted = self._output_want(graph, k, main)
                if wanted is None or wanted == have or graph.outputs[k] is not value:
                    continue
                graph.outputs[k] = self._cast(value, wanted, names, graph=graph)
                result.casts_inserted += 1
                result.modified = True

    # -- helpers -------------------------------------------------------------------------

    def _output_want(self, graph: ir.Graph, k: int, main: ir.Graph) -> ir.DataType | None:
        """The dtype graph output ``k`` of ``graph`` must have; None: whatever is produced."""
        if graph is main:
            return ir.DataType.FLOAT if self._keeps(graph.outputs[k], main) else None
        owner = self._owners.get(graph)
        if owner is not None and self._is_low(owner) and k in self.slots[owner].outputs:
            return self.policy.target_type
        return ir.DataType.FLOAT

    def _cast(
        self, value: ir.Value, to: ir.DataType, names: UniqueNames, graph: ir.Graph | None = None
    ) -> ir.Value:
        base = value.name or "value"
        out = ir.Value(
            name=names.fresh(f"{base}_{_short(to)}"),
            type=ir.TensorType(to),
            shape=value.shape.copy() if value.shape is not None else None,
        )
        cast = ir.Node(
            "",
            "Cast",
            inputs=[value],
            attributes=[ir.AttrInt64("to", int(to))],
            outputs=[out],
            name=names.fresh(f"{base}_cast_{_short(to)}"),
        )
        producer = value.producer()
        if graph is not None:
            graph.append(cast)  # feeds an output of ``graph``: its end is always in order
        elif producer is not None and producer.graph is not None:
            producer.graph.insert_after(producer, cast)
        else:
            graph = value.graph
            assert graph is not None, f"value {value.name!r} belongs to no graph"
            if len(graph) > 0:
                graph.insert_before(graph.node(0), cast)
            else:
                graph.append(cast)
        return out

    def _to_low(self, arr: np.ndarray, target: ir.DataType, stats: WeightStats) -> np.ndarray:
        np_dtype = _NUMPY_DTYPE[target]
        finfo_max = float(ml_dtypes.finfo(np_dtype).max)
        src = arr.astype(np.float32, copy=False)
        if self.clip_weights:
            over = np.abs(src) > finfo_max
            stats.clipped += int(np.count_nonzero(over & np.isfinite(src)))
            src = np.clip(src, -finfo_max, finfo_max)
        low = src.astype(np_dtype)
        stats.flushed_to_zero += int(np.count_nonzero((low == 0) & (src != 0)))
        stats.overflowed += int(np.count_nonzero(np.isinf(low) & np.isfinite(src)))
        return low

    def _convert_weight_in_place(
        self, value: ir.Value, target: ir.DataType, stats: WeightStats
    ) -> None:
        before = _nbytes(value)
        producer = _constant_producer(value)
        tensor = const_tensor(value)
        assert tensor is not None
        low = self._to_low(tensor.numpy(), target, stats)
        new_tensor = ir.tensor(low, dtype=target, name=value.name)
        if producer is not None:
            for key in [k for k in producer.attributes if k.startswith("value")]:
                del producer.attributes[key]
            producer.attributes["value"] = ir.AttrTensor("value", new_tensor)
        else:
            value.const_value = new_tensor
        value.dtype = target
        shared = self._model.meta.get(SHARED_TENSORS, False)
        if (
            not shared
            and isinstance(tensor, ir.TensorProtoTensor)
            and tensor.raw.HasField("raw_data")
        ):
            # The float32 bytes belong to mixprec's private copy of the model and nothing
            # reads them any more: release them now rather than at the end (not when the
            # tensor is shared with another model: the guard's reused calibration).
            tensor.raw.ClearField("raw_data")
        stats.converted += 1
        stats.converted_bytes_before += before
        stats.converted_bytes_after += low.nbytes

    def _low_copy(
        self, value: ir.Value, target: ir.DataType, names: UniqueNames, stats: WeightStats
    ) -> ir.Value:
        tensor = const_tensor(value)
        assert tensor is not None
        low = self._to_low(tensor.numpy(), target, stats)
        name = names.fresh(f"{value.name or 'weight'}_{_short(target)}")
        new_tensor = ir.tensor(low, dtype=target, name=name)
        producer = _constant_producer(value)
        if producer is not None and producer.graph is not None:
            out = ir.Value(name=name, type=ir.TensorType(target), shape=value.shape)
            const = ir.Node(
                "",
                "Constant",
                inputs=[],
                attributes=[ir.AttrTensor("value", new_tensor)],
                outputs=[out],
                name=names.fresh(f"{name}_const"),
            )
            producer.graph.insert_after(producer, const)
            return out
        graph = value.graph
        assert graph is not None
        out = ir.Value(
            name=name, type=ir.TensorType(target), shape=value.shape, const_value=new_tensor
        )
        graph.register_initializer(out)
        return out


def _constant_producer(value: ir.Value) -> ir.Node | None:
    producer = value.producer()
    if producer is not None and is_constant_node(producer):
        return producer
    return None


def _nbytes(value: ir.Value) -> int:
    tensor = const_tensor(value)
    if tensor is None:
        return 0
    return int(tensor.size) * 4


@dataclasses.dataclass
class RemoveRedundantCastsResult(ir.passes.PassResult):
    removed: int = 0


class RemoveRedundantCastsPass(ir.passes.InPlacePass):
    """Rewire ``x -> Cast(a) -> Cast(b)`` to ``x`` when ``x`` already has dtype ``b``.

    Only float-to-float chains are touched (integer casts truncate). The second Cast is
    left without users; dead casts are removed here too.
    """

    def call(self, model: ir.Model) -> RemoveRedundantCastsResult:
        rewired = 0
        for node in list(iter_nodes(model.graph)):
            if node.op_type != "Cast" or not is_onnx_domain(node.domain):
                continue
            out = node.outputs[0]
            src = node.inputs[0]
            first = src.producer() if src is not None else None
            if first is None or first.op_type != "Cast" or not is_onnx_domain(first.domain):
                continue
            origin = first.inputs[0]
            if origin is None or src is None:
                continue
            if not {origin.dtype, src.dtype, out.dtype} <= FLOAT_TYPES:
                continue
            if origin.dtype != out.dtype or out.is_graph_output():
                continue
            out.replace_all_uses_with(origin)
            rewired += 1
        removed = 0
        dead = True
        while dead:
            dead = False
            for node in list(iter_nodes(model.graph)):
                if (
                    node.op_type == "Cast"
                    and is_onnx_domain(node.domain)
                    and not node.outputs[0].uses()
                    and not node.outputs[0].is_graph_output()
                    and node.graph is not None
                ):
                    node.graph.remove(node, safe=True)
                    removed += 1
                    dead = True
        return RemoveRedundantCastsResult(model, modified=bool(rewired or removed), removed=removed)
