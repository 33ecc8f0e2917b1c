"""Painting: decide, for every node, whether it runs in low precision or FP32, and why.

The algorithm follows TensorFlow grappler's auto mixed precision (and Intel ITEX), in steps:

0. ``prepare``: nodes that cannot change are fixed first: no float32 tensors, a schema that
   admits no low-precision type, excluded by name, control flow (If/Loop/Scan keep a
   float32 interface; their bodies are painted like the rest), unknown output types,
   constants outside the target range, and calibrated activations beyond the threshold.
   Conditional rules turn a node into a DENY seed (``rule``); a rule that says
   ``fp32_upstream`` (a float rounded into a count: Ceil before a Range) also keeps the
   float path that feeds only that node FP32, back to the first value something else
   reads.
1. ``allow``: ALLOW ops go low.
2. ``deny``: DENY ops (and rule seeds) stay FP32 and spread downstream through INFER and
   CLEAR ops.
3. ``infer``: INFER and CLEAR ops fed by a low-precision op go low (forward, transitively).
4. ``weights``: INFER and CLEAR ops that sit between constants and low-precision ops (a
   Transpose of a weight feeding a MatMul) go low, so the weight is stored in low precision.
5. ``rest``: everything else stays FP32.

The pass never modifies the model's content (``modified`` is always False): it records
each node's :class:`Decision` in ``node.meta[DECISION]`` (and the float slots of paintable
nodes in ``node.meta[SLOTS]``), where :mod:`mixprec.precision.rewrite`, the report and the tuner
read them. A new run replaces the previous run's records.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.measure import SHAPES as SHAPE_META
from mixprec.calibrate.measure import calibration_of
from mixprec.calibrate.observers import absmax_of
from mixprec.core.constants import const_tensor
from mixprec.core.errors import InternalError
from mixprec.core.graphs import (
    NodeExclusions,
    if_branch_owners,
    is_constant_node,
    iter_nodes,
    keeps_io_dtype,
    opset_of,
)
from mixprec.core.ops import is_onnx_domain
from mixprec.core.policy import SHAPE_ONLY_OPS, OpClass, OpRule, Policy, RuleContext, rule_for
from mixprec.core.registry import node_info
from mixprec.core.schema import SlotInfo, slot_info
from mixprec.io.external import RELEASE_EVERY, release_mapped_pages

__all__ = [
    "DECISION",
    "SLOTS",
    "Decision",
    "PaintPass",
    "PaintResult",
    "Precision",
    "decision_of",
    "painted",
    "slots_of",
]

#: ``node.meta`` keys where the decision and the float slots of a painted node live.
DECISION = "mixprec.decision"
SLOTS = "mixprec.slots"

_FINFO_MAX = {
    ir.DataType.FLOAT16: float(np.finfo(np.float16).max),
    ir.DataType.BFLOAT16: 3.3895313892515355e38,
}


class Precision(enum.Enum):
    LOW = "low"
    FP32 = "fp32"


@dataclass(frozen=True)
class Decision:
    """The final precision of one node and why."""

    precision: Precision
    step: str
    reason: str
    op_class: OpClass


@dataclasses.dataclass
class PaintResult(ir.passes.PassResult):
    """Decisions per node, plus the float slots of every paintable node."""

    decisions: dict[ir.Node, Decision] = dataclasses.field(default_factory=dict)
    slots: dict[ir.Node, SlotInfo] = dataclasses.field(default_factory=dict)


class PaintPass(ir.passes.InPlacePass):
    """Paint every node LOW or FP32 according to ``policy``; analysis only.

    Args:
        policy: the resolved policy.
        absmax: calibrated absolute maxima of activations by value name; None reads the
            calibration attached to the model (``mixprec.calibrate.measure.CALIBRATION``).
        range_threshold: activations whose calibrated |x| max exceeds this keep their
            producer and consumers in FP32.
        keep_io_types: graph outputs of the main graph keep float32 (affects step 4).
        shapes: concrete shapes by value name for shape-dependent rules; None reads those
            attached to the model (``mixprec.calibrate.measure.SHAPES``).
    """

    def __init__(
        self,
        policy: Policy,
        *,
        absmax: Mapping[str, float] | None = None,
        range_threshold: float | None = None,
        keep_io_types: bool | frozenset[str] = True,
        shapes: Mapping[str, Sequence[int | None]] | None = None,
    ) -> None:
        super().__init__()
        self._given = (absmax, shapes)
        self.shapes: dict[str, Sequence[int | None]] = {}
        self.policy = policy
        self.absmax: dict[str, float] = {}
        target = policy.target_type
        self.range_threshold = (
            range_threshold if range_threshold is not None else _FINFO_MAX[target] / 4
        )
        self.keep_io_types = keep_io_types
        self._exclude = NodeExclusions(policy.exclude_nodes)

    # -- helpers -------------------------------------------------------------------------

    def _excluded(self, node: ir.Node) -> str | None:
        return self._exclude.reason(node)

    def _const_absmax(self, value: ir.Value) -> float | None:
        """|x| max of a constant (0 when empty), once per value; None if not constant."""
        if value not in self._const_peaks:
            tensor = const_tensor(value)
            if tensor is None:
                self._const_peaks[value] = None
            else:
                arr = tensor.numpy()
                self._const_peaks[value] = absmax_of(arr)
                if arr.nbytes >= RELEASE_EVERY:
                    release_mapped_pages(self._model)  # read once: let a mapped file's pages go
        return self._const_peaks[value]

    def _range_block(self, node: ir.Node, slots: SlotInfo) -> str | None:
        limit = _FINFO_MAX[self.policy.target_type]
        for i in sorted(slots.inputs):
            value = node.inputs[i]
            assert value is not None
            peak = self._const_absmax(value)
            if peak is not None:
                if peak > limit:
                    return (
                        f"constant {value.name!r} holds |x|={peak:.3g}"
                        f" > {self.policy.target} max {limit:.6g}"
                    )
                continue
            seen = self.absmax.get(value.name or "")
            if seen is not None and seen > self.range_threshold:
                return (
                    f"input {value.name!r} reached |x|={seen:.3g} in calibration "
                    f"(> threshold {self.range_threshold:.6g})"
                )
        for i in sorted(slots.outputs):
            value = node.outputs[i]
            seen = self.absmax.get(value.name or "")
            if seen is not None and seen > self.range_threshold:
                return (
                    f"output {value.name!r} reached |x|={seen:.3g} in calibration "
                    f"(> threshold {self.range_threshold:.6g})"
                )
        return None

    def _calibrated(self, node: ir.Node, slots: SlotInfo) -> bool:
        """Every float tensor the node touches is a constant or was seen in calibration."""
        values = [node.inputs[i] for i in slots.inputs] + [node.outputs[j] for j in slots.outputs]
        return bool(self.absmax) and all(
            v is not None and ((v.name or "") in self.absmax or const_tensor(v) is not None)
            for v in values
        )

    def _branch_owner(self, value: ir.Value) -> tuple[ir.Node, int] | None:
        """(If node, output index) when ``value`` is an output of one of its branches."""
        graph = value.graph
        if graph is None or graph not in self._owners or not value.is_graph_output():
            return None
        return self._owners[graph], list(graph.outputs).index(value)

    def _keeps_output_fp32(self, value: ir.Value) -> bool:
        if not value.is_graph_output():
            return False
        graph = value.graph
        if graph is not None and graph in self._owners:
            return False  # an If branch output follows the If node
        if graph is None or graph is not self._main_graph:
            return True  # Loop/Scan body outputs keep their type
        return keeps_io_dtype(self.keep_io_types, value)

    # -- the pass ------------------------------------------------------------------------

    def call(self, model: ir.Model) -> PaintResult:
        absmax, shapes = self._given
        self.absmax = dict(absmax if absmax is not None else calibration_of(model).absmax)
        self.shapes = dict(shapes if shapes is not None else model.meta.get(SHAPE_META, {}))
        self._main_graph = model.graph
        self._model = model
        self._const_peaks: dict[ir.Value, float | None] = {}
        self._owners = if_branch_owners(model.graph)
        painter = _Painter(self, model)
        painter.prepare()
        painter.allow()
        painter.deny()
        # Steps 3 and 4 feed each other: repeat to a fixed point.
        painter.forward()
        while painter.backward():
            painter.forward()
        painter.rest()
        for node in iter_nodes(model.graph):
            node.meta.pop(DECISION, None)
            node.meta.pop(SLOTS, None)
        for node, decision in painter.decisions.items():
            node.meta[DECISION] = decision
        for node, info in painter.slots.items():
            node.meta[SLOTS] = info
        return PaintResult(model, modified=False, decisions=painter.decisions, slots=painter.slots)


def decision_of(node: ir.Node) -> Decision | None:
    """The decision :class:`PaintPass` recorded on ``node`` (None: not painted)."""
    found = node.meta.get(DECISION)
    return found if isinstance(found, Decision) else None


def slots_of(node: ir.Node) -> SlotInfo | None:
    """The float slots :class:`PaintPass` recorded on a paintable ``node``."""
    found = node.meta.get(SLOTS)
    return found if isinstance(found, SlotInfo) else None


def painted(model: ir.Model) -> Iterator[tuple[ir.Node, Decision]]:
    """Every painted node of the model (subgraphs included) with its decision."""
    for node in iter_nodes(model.graph):
        decision = decision_of(node)
        if decision is not None:
            yield node, decision


class _Painter:
    """The state of one painting run; each step is a method (see the module docstring)."""

    def __init__(self, owner: PaintPass, model: ir.Model) -> None:
        self.owner = owner
        self.model = model
        self.policy = owner.policy
        self.decisions: dict[ir.Node, Decision] = {}
        self.slots: dict[ir.Node, SlotInfo] = {}
        self.classes: dict[ir.Node, OpClass] = {}
        self.seeds: list[tuple[ir.Node, str]] = []
        self.range_ok: set[ir.Node] = set()  # range-checked DENY ops painted as INFER
        self.if_nodes = set(owner._owners.values())
        self.order: list[ir.Node] = []
        self.const_fed: set[ir.Node] = set()

    def decide(self, node: ir.Node, precision: Precision, step: str, reason: str) -> None:
        cls = self.classes.get(node, OpClass.NONE)
        self.decisions[node] = Decision(precision, step, reason, cls)

    # -- step 0 --------------------------------------------------------------------------

    def prepare(self) -> None:
        """Fix what cannot change; collect DENY seeds; find the paintable nodes."""
        for node in iter_nodes(self.model.graph):
            if is_constant_node(node) or (
                node.op_type in SHAPE_ONLY_OPS and is_onnx_domain(node.domain)
            ):
                continue
            self._prepare_node(node)
        self.order = list(self.slots)
        self._keep_upstream_fp32()
        self._find_const_fed()

    def _prepare_node(self, node: ir.Node) -> None:
        owner, policy = self.owner, self.policy
        rule = rule_for(node)
        domain_opset = opset_of(self.model, node.domain)
        info = slot_info(node, domain_opset, policy.target_type, rule.keep_fp32_inputs)
        standard = is_onnx_domain(node.domain)
        cls = policy.op_class(node.op_type) if standard else OpClass.NONE
        self.classes[node] = cls
        if not info.convertible:
            if info.fixed_inputs or info.fixed_outputs:
                self.decide(node, Precision.FP32, "prepare", info.reason)
            return
        self.slots[node] = info
        excluded = owner._excluded(node)
        if excluded:
            self.decide(node, Precision.FP32, "prepare", excluded)
        elif node.op_type == "If" and standard:
            # Precision-neutral: its outputs follow its branches' outputs and consumers.
            self.classes[node] = OpClass.CLEAR
        elif node_info(node).control_flow:
            self.decide(
                node,
                Precision.FP32,
                "prepare",
                "Loop/Scan keep a float32 interface (carried state keeps its dtype); "
                "the body is painted on its own",
            )
        elif any(o.dtype is None for o in node.outputs if o is not None and o.name):
            self.decide(node, Precision.FP32, "prepare", "an output has an unknown type")
        elif policy.force_all:
            self.decide(node, Precision.LOW, "force-all", "force_all converts every node")
        elif (blocked := owner._range_block(node, info)) is not None:
            self.decide(node, Precision.FP32, "range", blocked)
        elif rule.fp32_if is not None and (why := self._rule_reason(node, rule, domain_opset)):
            self.seeds.append((node, f"rule: {why}"))
        elif (
            cls is OpClass.DENY
            and node.op_type in policy.range_checked
            and owner._calibrated(node, info)
        ):
            self.classes[node] = OpClass.INFER
            self.range_ok.add(node)
        elif cls is OpClass.DENY:
            self.seeds.append((node, "DENY list"))

    def _keep_upstream_fp32(self) -> None:
        """Rule seeds whose rule says ``fp32_upstream`` (a float rounded into a count):
        the float path feeding only them stays FP32 too, with the seed's reason."""
        seeds = {node for node, _ in self.seeds}
        for seed, why in list(self.seeds):
            if not rule_for(seed).fp32_upstream:
                continue
            because = why.removeprefix("rule: ").removeprefix("decides a count: ")
            for node in self._feeding_only(seed):
                if node not in self.decisions and node not in seeds:
                    self.decide(
                        node,
                        Precision.FP32,
                        "deny",
                        f"rule: decides a count: feeds only {seed.op_type} {seed.name!r}, "
                        f"{because}",
                    )

    def _feeding_only(self, seed: ir.Node) -> list[ir.Node]:
        """The paintable nodes upstream of ``seed`` whose float outputs nothing but this
        path reads: back to the first value that something else (another node, a graph
        output) also reads, or a node that cannot be followed (control flow, no float
        slots, a graph input or constant)."""
        path = {seed}
        found: list[ir.Node] = []
        frontier = [seed]
        while frontier:
            node = frontier.pop()
            for _value, producer in self.feeders(node):
                if producer is None or producer in path or not self._followable(producer):
                    continue
                if self._read_only_by(producer, path):
                    path.add(producer)
                    found.append(producer)
                    frontier.append(producer)
        return found

    def _followable(self, node: ir.Node) -> bool:
        return node in self.slots and node not in self.if_nodes and not node_info(node).control_flow

    @staticmethod
    def _read_only_by(node: ir.Node, path: set[ir.Node]) -> bool:
        for value in node.outputs:
            if value.is_graph_output():
                return False
            for use in value.uses():
                if use.node not in path and use.node.op_type not in SHAPE_ONLY_OPS:
                    return False
        return True

    def _rule_reason(self, node: ir.Node, rule: OpRule, opset: int) -> str | None:
        assert rule.fp32_if is not None
        ctx = RuleContext(self.policy.target, opset, self.owner.shapes)
        try:
            return rule.fp32_if(node, ctx)
        except Exception as exc:
            raise InternalError(
                f"the rule for {node.op_type} failed on node {node.name!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _find_const_fed(self) -> None:
        """Nodes computing from constants only (embedding lookups, weight transposes...)."""
        for node in self.order:
            if self.classes[node] not in (OpClass.INFER, OpClass.CLEAR):
                continue
            if all(
                const_tensor(value) is not None or producer in self.const_fed
                for value, producer in self.feeders(node)
            ):
                self.const_fed.add(node)

    # -- graph walking -------------------------------------------------------------------

    def hands_fp32(self, node: ir.Node) -> bool:
        return rule_for(node).output_fp32 or node.op_type in self.policy.output_fp32_ops

    def feeders(self, node: ir.Node) -> Iterator[tuple[ir.Value, ir.Node | None]]:
        """The float values a node computes from, with their producers.

        For an If node: the branch outputs behind its convertible outputs.
        """
        if node in self.if_nodes:
            for branch, owner in self.owner._owners.items():
                if owner is not node:
                    continue
                for k in self.slots[node].outputs:
                    if k < len(branch.outputs):
                        out = branch.outputs[k]
                        yield out, out.producer()
            return
        for i in sorted(self.slots[node].inputs):
            value = node.inputs[i]
            assert value is not None
            yield value, value.producer()

    def users(self, node: ir.Node) -> Iterator[tuple[ir.Node, bool]]:
        """Who reads the node's float outputs, and whether that slot can go low.

        A branch output of an If counts as read by the If node.
        """
        slots = self.slots
        for j in slots[node].outputs:
            value = node.outputs[j]
            for use in value.uses():
                user = use.node
                if user.op_type in SHAPE_ONLY_OPS:
                    continue
                yield user, user in slots and use.idx in slots[user].inputs
            found = self.owner._branch_owner(value)
            if found is not None:
                owner, k = found
                yield owner, owner in slots and k in slots[owner].outputs

    def consumers(self, node: ir.Node) -> Iterator[ir.Node]:
        for user, ok in self.users(node):
            if ok:
                yield user

    def is_low(self, node: ir.Node | None) -> bool:
        d = self.decisions.get(node) if node is not None else None
        return d is not None and d.precision is Precision.LOW

    def _followers(self, node: ir.Node) -> Iterator[ir.Node]:
        """Undecided INFER/CLEAR consumers of ``node``."""
        for user in self.consumers(node):
            if user not in self.decisions and self.classes[user] in (
                OpClass.INFER,
                OpClass.CLEAR,
            ):
                yield user

    def _note(self, node: ir.Node) -> str:
        return " (DENY op with calibrated safe range)" if node in self.range_ok else ""

    # -- steps 1 to 5 --------------------------------------------------------------------

    def allow(self) -> None:
        """Step 1: ALLOW ops go low."""
        for node in self.slots:
            if node not in self.decisions and self.classes[node] is OpClass.ALLOW:
                self.decide(node, Precision.LOW, "allow", "ALLOW list")

    def deny(self) -> None:
        """Step 2: DENY seeds stay FP32 and spread downstream through INFER/CLEAR."""
        queue: deque[tuple[ir.Node, str]] = deque()
        for node, why in self.seeds:
            if node not in self.decisions:
                self.decide(node, Precision.FP32, "deny", why)
                queue.append((node, f"downstream of {node.op_type} {node.name!r} ({why})"))
        while queue:
            node, why = queue.popleft()
            for user in self._followers(node):
                self.decide(user, Precision.FP32, "deny", why)
                queue.append((user, why))

    def forward(self) -> bool:
        """Step 3: INFER/CLEAR nodes fed by low precision go low, transitively."""
        changed = False
        queue = deque(n for n, d in self.decisions.items() if d.precision is Precision.LOW)
        while queue:
            node = queue.popleft()
            if self.hands_fp32(node):
                continue  # computes in low precision but hands float32 on
            for user in self._followers(node):
                self.decide(
                    user,
                    Precision.LOW,
                    "infer",
                    f"fed by low-precision {node.op_type} {node.name!r}{self._note(user)}",
                )
                queue.append(user)
                changed = True
        return changed

    def backward(self) -> bool:
        """Step 4: constant-fed INFER/CLEAR nodes whose consumers are all low go low."""
        changed = False
        for node in reversed(self.order):
            if node in self.decisions or self.classes[node] not in (OpClass.INFER, OpClass.CLEAR):
                continue
            reader = self._low_reader_of_const_fed(node)
            if reader is not None:
                self.decide(
                    node,
                    Precision.LOW,
                    "weights",
                    f"computes from constants for low-precision {reader.op_type} "
                    f"{reader.name!r}{self._note(node)}",
                )
                changed = True
        return changed

    def _low_reader_of_const_fed(self, node: ir.Node) -> ir.Node | None:
        """The first reader when ``node`` computes from constants/low values and every
        reader takes low precision; else None."""
        inputs_ok = all(
            const_tensor(value) is not None or self.is_low(producer) or producer in self.const_fed
            for value, producer in self.feeders(node)
        )
        if not inputs_ok:
            return None
        info = self.slots[node]
        if any(self.owner._keeps_output_fp32(node.outputs[j]) for j in info.outputs):
            return None
        readers = list(self.users(node))
        if not readers or not all(ok and self.is_low(user) for user, ok in readers):
            return None
        return readers[0][0]

    def rest(self) -> None:
        """Step 5: everything else stays FP32."""
        for node in self.slots:
            if node in self.decisions:
                continue
            cls = self.classes[node]
            reason = {
                OpClass.INFER: "INFER list, not fed by low precision",
                OpClass.CLEAR: "CLEAR list, neighbours in float32",
                OpClass.NONE: (
                    f"{node.op_type} is in no list"
                    if is_onnx_domain(node.domain)
                    else f"custom-domain op {node.domain}::{node.op_type}"
                ),
                OpClass.ALLOW: "ALLOW list",
                OpClass.DENY: "DENY list",
            }[cls]
            if node in self.range_ok:
                reason = "DENY op with calibrated safe range, not fed by low precision"
            self.decide(node, Precision.FP32, "rest", reason)
