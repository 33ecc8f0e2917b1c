"""Checks and repairs of the input model, run first in the ``prepare`` stage.

ONNX Runtime runs some models the checker refuses, and mixprec's passes assume things a
malformed file does not give them. The passes here either repair what ORT accepts (with a
note) or refuse the model with one :class:`MixprecError` naming the node or tensor:

* :class:`CheckOptionsPass`: options that need the model (``keep_io_types`` names) or
  contradict each other (calibration data with ``calibrate=False``).
* :class:`RepairNamesPass`: node, value and graph names that are not UTF-8 (protobuf
  hands them over as bytes; ORT runs such models) get an escaped UTF-8 name.
* :class:`CheckInputPass`: structural faults: no graph outputs, a tensor read but never
  defined, an attribute of the wrong type or of type UNDEFINED, ``Cast(to=999)``, an
  UNDEFINED element type, ``raw_data`` that does not match its dims, If/Loop bodies
  with the wrong number of outputs, an unsupported opset or IR version.
* :class:`SetIrVersionPass`: ``ir_version`` 0 (unset; ORT runs it) becomes the version
  the opset implies, and IR 3 becomes 4: IR 3 requires every initializer to be a graph
  input, and folding and converting add initializers. The graph inputs stay as they are.
* :class:`InlineFunctionsPass`: refuses recursive model-local functions, converts a
  function whose ai.onnx opset differs from the model's to the model's opset
  (``onnx.version_converter``), then inlines them all.
* :class:`SortNodesPass`: sorts graphs whose nodes are not in topological order.

Each pass returns a :class:`SanitizeResult` whose ``notes`` say what it repaired.
:class:`CheckInputPass` lives in :mod:`mixprec.passes.input_checks`, and the checks that run
before ``onnx_ir`` parses a file (:func:`~mixprec.io.proto_checks.check_proto`) in
:mod:`mixprec.io.proto_checks`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import onnx
import onnx.defs
import onnx.helper
import onnx.version_converter
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.core.errors import MixprecError
from mixprec.core.graphs import all_graphs, subgraphs_of
from mixprec.core.ops import is_onnx_domain, onnx_opset

__all__ = [
    "CheckOptionsPass",
    "InlineFunctionsPass",
    "RepairNamesPass",
    "SanitizeResult",
    "SetIrVersionPass",
    "SortNodesPass",
]

logger = logging.getLogger(__name__)

MIN_OPSET = 7


@dataclasses.dataclass
class SanitizeResult(ir.passes.PassResult):
    """A check or repair of the input; ``notes`` say what was repaired, for the report."""

    notes: list[str] = dataclasses.field(default_factory=list)


def node_label(node: ir.Node) -> str:
    name = node.name if isinstance(node.name, str) else repr(node.name)
    return f"node {name!r} ({node.op_type})" if name else f"an unnamed {node.op_type} node"


def subgraph_bodies(model: ir.Model) -> Iterator[tuple[ir.Graph | ir.Function, str]]:
    """Every graph (main, subgraphs) and function body, with what to call it in messages."""
    for graph in all_graphs(model.graph):
        yield graph, "the graph" if graph is model.graph else f"subgraph {graph.name!r}"
    for function in model.functions.values():
        yield function, f"function {function.domain}::{function.name}"
        for node in function:
            for sub in subgraphs_of(node):
                for graph in all_graphs(sub):
                    yield graph, f"subgraph {graph.name!r} of function {function.name}"


def declared_opsets(body: ir.Graph | ir.Function, model: ir.Model) -> dict[str, int]:
    opsets = dict(model.opset_imports)
    if isinstance(body, ir.Function):
        opsets.update(body.opset_imports)
    return opsets


# --- options that need the model ------------------------------------------------------------


class CheckOptionsPass(ir.passes.InPlacePass):
    """Refuse options that name what the model lacks or contradict each other.

    Args:
        keep_io_types: the config's ``keep_io_types``: a set of names must name graph
            inputs or outputs.
        calibrate: the config's ``calibrate``.
        has_calibration_data: calibration data was given.
    """

    def __init__(
        self,
        keep_io_types: bool | frozenset[str],
        *,
        calibrate: bool,
        has_calibration_data: bool,
    ) -> None:
        super().__init__()
        self.keep_io_types = keep_io_types
        self.calibrate = calibrate
        self.has_calibration_data = has_calibration_data

    def call(self, model: ir.Model) -> SanitizeResult:
        if self.has_calibration_data and not self.calibrate:
            raise MixprecError("calibration_data was given with calibrate=False: drop one of them")
        if not isinstance(self.keep_io_types, bool):
            graph = model.graph
            names = [v.name for v in [*graph.inputs, *graph.outputs] if v.name]
            unknown = sorted(set(self.keep_io_types) - set(names))
            if unknown:
                valid = ", ".join(repr(n) for n in dict.fromkeys(names))
                raise MixprecError(
                    f"keep_io_types names {', '.join(repr(n) for n in unknown)}, which "
                    f"is not a graph input or output; valid names: {valid}"
                )
        return SanitizeResult(model, modified=False)


# --- names ---------------------------------------------------------------------------------


def _utf8(name: bytes) -> str:
    return name.decode("utf-8", errors="backslashreplace")


def _values_of(body: ir.Graph | ir.Function) -> Iterator[ir.Value]:
    yield from body.inputs
    if isinstance(body, ir.Graph):
        yield from body.initializers.values()
    for node in body:
        yield from node.outputs


class RepairNamesPass(ir.passes.InPlacePass):
    """Give every node, value and graph name that is not valid UTF-8 an escaped name.

    Protobuf hands such names over as ``bytes`` (ORT runs the model; nothing can write
    it back). ``b"conv\\xff"`` becomes ``"conv\\\\xff"`` (a suffix keeps it unique).
    A main-graph input or output is the model's interface, which a conversion never
    changes: such a name is refused instead (:class:`MixprecError`).
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        result = SanitizeResult(model, modified=False)
        taken = {
            v.name
            for body, _ in subgraph_bodies(model)
            for v in _values_of(body)
            if isinstance(v.name, str)
        }
        for value in [*model.graph.inputs, *model.graph.outputs]:
            if isinstance(value.name, bytes):
                raise MixprecError(
                    f"graph {'input' if value.is_graph_input() else 'output'} name "
                    f"{_utf8(value.name)!r} is not UTF-8: mixprec keeps a model's input and "
                    "output names, and cannot write this one; rename it first"
                )
        nodes = values = 0
        for body, _ in subgraph_bodies(model):
            if isinstance(body, ir.Graph) and isinstance(body.name, bytes):
                body.name = _utf8(body.name)
            for node in body:
                if isinstance(node.name, bytes):
                    node.name = _utf8(node.name)
                    nodes += 1
            for value in _values_of(body):
                if not isinstance(value.name, bytes):
                    continue
                new = base = _utf8(value.name)
                k = 1
                while new in taken:
                    new, k = f"{base}_{k}", k + 1
                taken.add(new)
                value.name = new
                values += 1
        if nodes or values:
            result.modified = True
            note = f"renamed {nodes} node(s) and {values} value(s) whose names are not UTF-8"
            result.notes.append(note)
            logger.info(note)
        return result


def _implied_ir_version(opset: int) -> int:
    """The lowest IR version released with ai.onnx ``opset`` (``onnx.helper.VERSION_TABLE``)."""
    versions = [ir_v for _, ir_v, ai_onnx, *_ in onnx.helper.VERSION_TABLE if ai_onnx >= opset]
    return min(versions) if versions else onnx.IR_VERSION


class SetIrVersionPass(ir.passes.InPlacePass):
    """``ir_version`` 0 (unset) becomes the version the opset implies; below 4 becomes 4.

    IR 3 requires every initializer to be a graph input, and folding BatchNormalization
    or converting a shared weight adds initializers. Raising the version changes only the
    header: the graph inputs (IR-3 models list their weights there) stay as they are.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        result = SanitizeResult(model, modified=False)
        old = model.ir_version
        new = old
        if old == 0:
            opset = onnx_opset(model.opset_imports, MIN_OPSET)
            new = max(4, _implied_ir_version(opset))
            note = f"ir_version 0 (unset) taken as {new}, the version opset {opset} implies"
        elif old < 4:
            new = 4
            note = (
                f"ir_version {old} raised to 4: IR {old} requires every initializer to be a "
                "graph input (the graph inputs are unchanged)"
            )
        if new != old:
            model.ir_version = new
            result.modified = True
            result.notes.append(note)
            logger.info(note)
        return result


# --- functions -------------------------------------------------------------------------------


def _calls(body: ir.Graph | ir.Function, functions: dict) -> Iterator[ir.OperatorIdentifier]:
    for node in ir.traversal.RecursiveGraphIterator(body):
        key = (node.domain, node.op_type, node.overload)
        if key in functions:
            yield key


def _find_cycle(model: ir.Model) -> list[str] | None:
    """A call cycle among model-local functions, as names, or None."""
    functions = model.functions
    callees = {key: set(_calls(f, functions)) for key, f in functions.items()}
    state: dict[ir.OperatorIdentifier, int] = {}  # 1: on the stack, 2: done

    def visit(key: ir.OperatorIdentifier, path: list[ir.OperatorIdentifier]) -> list | None:
        state[key] = 1
        for callee in sorted(callees[key]):
            if state.get(callee) == 1:
                return [*path, key, callee][path.index(callee) if callee in path else 0 :]
            if callee not in state:
                found = visit(callee, [*path, key])
                if found:
                    return found
        state[key] = 2
        return None

    for key in sorted(functions):
        if key not in state:
            cycle = visit(key, [])
            if cycle:
                return [f"{d}::{op}" for d, op, _ in cycle]
    return None


def _convert_function(function: ir.Function, opset: int) -> ir.Function:
    """``function`` with its ai.onnx nodes converted to ``opset`` (onnx.version_converter)."""
    proto = ir.serde.serialize_function(function)
    graph = onnx.helper.make_graph(
        list(proto.node),
        "function_body",
        [onnx.ValueInfoProto(name=n) for n in proto.input],
        [onnx.ValueInfoProto(name=n) for n in proto.output],
    )
    own = {o.domain: o.version for o in proto.opset_import}
    body = onnx.helper.make_model(
        graph,
        opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in own.items()],
        ir_version=onnx.IR_VERSION,
    )
    converted = onnx.version_converter.convert_version(body, opset)
    del proto.node[:]
    proto.node.extend(converted.graph.node)
    for entry in proto.opset_import:
        if is_onnx_domain(entry.domain):
            entry.version = opset
    return ir.serde.deserialize_function(proto)


class InlineFunctionsPass(ir.passes.InPlacePass):
    """Inline every model-local function, after refusing recursion and aligning opsets.

    A function importing another ai.onnx version than the model is converted to the
    model's version first (``onnx.version_converter``, with a note); ``onnx_ir``'s
    ``InlinePass`` then requires equal versions.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        result = SanitizeResult(model, modified=False)
        if not model.functions:
            return result
        cycle = _find_cycle(model)
        if cycle:
            raise MixprecError(
                f"model-local functions call themselves recursively ({' -> '.join(cycle)}): "
                "ONNX functions cannot recurse"
            )
        opset = onnx_opset(model.opset_imports)
        for key, function in list(model.functions.items()):
            own = onnx_opset(function.opset_imports)
            if opset is None or own is None or own == opset:
                continue
            try:
                converted = _convert_function(function, opset)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                raise MixprecError(
                    f"function {function.domain}::{function.name} imports ai.onnx {own}, "
                    f"the model {opset}, and onnx cannot convert it: {first}"
                ) from None
            model.functions[key] = converted
            note = (
                f"function {function.domain}::{function.name} converted from ai.onnx "
                f"opset {own} to the model's {opset} before inlining"
            )
            result.notes.append(note)
            logger.info(note)
        count = len(model.functions)
        common.InlinePass()(model)
        model.functions.clear()
        result.modified = count > 0
        return result


# --- order -----------------------------------------------------------------------------------


def _is_sorted(graph: ir.Graph) -> bool:
    seen: set[ir.Node] = set()
    for node in graph:
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is not None and producer.graph is graph and producer not in seen:
                return False
        seen.add(node)
    return True


class SortNodesPass(ir.passes.InPlacePass):
    """Sort graphs whose nodes are not in topological order (ORT runs them; the checker
    does not accept them). A cycle is an error naming a node on it."""

    def call(self, model: ir.Model) -> SanitizeResult:
        result = SanitizeResult(model, modified=False)
        unsorted = [g for g in all_graphs(model.graph) if not _is_sorted(g)]
        if not unsorted:
            return result
        try:
            model.graph.sort()
        except ValueError:
            raise MixprecError(_cycle_message(model.graph)) from None
        result.modified = True
        names = ", ".join("the main graph" if g is model.graph else repr(g.name) for g in unsorted)
        note = f"nodes sorted into topological order ({names} were not)"
        result.notes.append(note)
        logger.info(note)
        return result


def _cycle_message(graph: ir.Graph) -> str:
    for g in all_graphs(graph):
        nodes = set(g)
        for node in g:
            stack = [p for p in _producers(node, nodes)]
            seen: set[ir.Node] = set()
            while stack:
                current = stack.pop()
                if current is node:
                    return f"the graph has a cycle through {node_label(node)}"
                if current not in seen:
                    seen.add(current)
                    stack.extend(_producers(current, nodes))
    return "the graph has a cycle"


def _producers(node: ir.Node, nodes: set[ir.Node]) -> list[ir.Node]:
    out = []
    for value in node.inputs:
        producer = value.producer() if value is not None else None
        if producer is not None and producer in nodes:
            out.append(producer)
    return out


# --- before parsing ------------------------------------------------------------------------
