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
:func:`check_proto` holds the checks that must run before ``onnx_ir`` parses a proto.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator

import onnx
import onnx.defs
import onnx.helper
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec._errors import MixprecError
from mixprec._graphs import all_graphs, subgraphs_of

__all__ = [
    "CheckInputPass",
    "CheckOptionsPass",
    "InlineFunctionsPass",
    "RepairNamesPass",
    "SanitizeResult",
    "SetIrVersionPass",
    "SortNodesPass",
    "check_proto",
]

logger = logging.getLogger(__name__)

_DEFAULT_DOMAINS = ("", "ai.onnx")
#: Attributes whose int value is an element type: it must name one.
_DTYPE_ATTRS = frozenset({"to", "dtype"})
#: Element types stored two per byte.
_PACKED_4BIT = frozenset({"INT4", "UINT4", "FLOAT4E2M1"})
_MIN_OPSET = 7


@dataclasses.dataclass
class SanitizeResult(ir.passes.PassResult):
    """A check or repair of the input; ``notes`` say what was repaired, for the report."""

    notes: list[str] = dataclasses.field(default_factory=list)


def _node_label(node: ir.Node) -> str:
    name = node.name if isinstance(node.name, str) else repr(node.name)
    return f"node {name!r} ({node.op_type})" if name else f"an unnamed {node.op_type} node"


def _bodies(model: ir.Model) -> Iterator[tuple[ir.Graph | ir.Function, str]]:
    """Every graph (main, subgraphs) and function body, with what to call it in messages."""
    for graph in all_graphs(model.graph):
        yield graph, "the graph" if graph is model.graph else f"subgraph {graph.name!r}"
    for function in model.functions.values():
        yield function, f"function {function.domain}::{function.name}"
        for node in function:
            for sub in subgraphs_of(node):
                for graph in all_graphs(sub):
                    yield graph, f"subgraph {graph.name!r} of function {function.name}"


def _opsets(body: ir.Graph | ir.Function, model: ir.Model) -> dict[str, int]:
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


class RepairNamesPass(ir.passes.InPlacePass):
    """Give every node, value and graph name that is not valid UTF-8 an escaped name.

    Protobuf hands such names over as ``bytes`` (ORT runs the model; nothing can write
    it back). ``b"conv\\xff"`` becomes ``"conv\\\\xff"`` (a suffix keeps it unique); a
    renamed graph input or output is named in the notes, since callers feed it by name.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        result = SanitizeResult(model, modified=False)
        taken = {
            v.name
            for body, _ in _bodies(model)
            for v in _values_of(body)
            if isinstance(v.name, str)
        }
        renamed_io: list[str] = []
        nodes = values = 0
        for body, _ in _bodies(model):
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
                if value.is_graph_input() or value.is_graph_output():
                    renamed_io.append(repr(new))
                value.name = new
                values += 1
        if nodes or values:
            result.modified = True
            note = f"renamed {nodes} node(s) and {values} value(s) whose names are not UTF-8"
            if renamed_io:
                note += f" (graph inputs/outputs now called {', '.join(renamed_io)})"
            result.notes.append(note)
            logger.info(note)
        return result


def _values_of(body: ir.Graph | ir.Function) -> Iterator[ir.Value]:
    yield from body.inputs
    if isinstance(body, ir.Graph):
        yield from body.initializers.values()
    for node in body:
        yield from node.outputs


# --- structural checks ------------------------------------------------------------------------


def _defined(value: ir.Value) -> bool:
    return (
        value.producer() is not None
        or value.is_graph_input()
        or value.is_initializer()
        or value.const_value is not None
    )


def _typed_count(dtype: ir.DataType, numel: int) -> int:
    """How many items of a typed data field (``float_data`` ...) ``numel`` elements take."""
    if dtype.name in _PACKED_4BIT:
        return (numel + 1) // 2
    if dtype in (ir.DataType.COMPLEX64, ir.DataType.COMPLEX128):
        return 2 * numel
    return numel


def tensor_fault(tensor: ir.TensorProtocol) -> str | None:
    """Why ``tensor`` cannot be read (no element type, data that does not fit its dims)."""
    try:
        dtype = ir.DataType(tensor.dtype)
    except ValueError:
        return f"has the unknown element type {int(tensor.dtype)}"
    if dtype == ir.DataType.UNDEFINED:
        return "has no element type (UNDEFINED)"
    dims = [d if isinstance(d, int) else -1 for d in tensor.shape.dims]
    if any(d < 0 for d in dims):
        return f"has invalid dims {list(tensor.shape.dims)}"
    numel = math.prod(dims)
    proto = getattr(tensor, "raw", None)
    if not isinstance(proto, onnx.TensorProto):
        return None  # in memory (numpy): consistent by construction
    if proto.data_location == onnx.TensorProto.EXTERNAL:
        return None  # checked where the file is read
    if proto.HasField("raw_data"):
        need = (numel * dtype.bitwidth + 7) // 8
        have = len(proto.raw_data)
        if have != need:
            return (
                f"holds {have} bytes of raw_data, but its dims {dims} of "
                f"{dtype.name.lower()} need {need}"
            )
        return None
    if dtype == ir.DataType.STRING:
        have = len(proto.string_data)
        need = numel
    else:
        field = onnx.helper.tensor_dtype_to_field(int(dtype))
        have = len(getattr(proto, field))
        need = _typed_count(dtype, numel)
    if have != need:
        return f"holds {have} values, but its dims {dims} need {need}"
    return None


def _attr_tensors(attr: ir.Attr) -> list[ir.TensorProtocol]:
    if attr.type == ir.AttributeType.TENSOR:
        return [attr.as_tensor()]
    if attr.type == ir.AttributeType.TENSORS:
        return list(attr.as_tensors())
    return []


class CheckInputPass(ir.passes.InPlacePass):
    """Refuse a malformed model with one error naming the node or tensor. Changes nothing.

    Odd but legal input (an output that is a graph input, zero nodes, NaN weights,
    unknown domains that the model imports) passes.
    """

    def call(self, model: ir.Model) -> SanitizeResult:
        self._check_versions(model)
        graph = model.graph
        if not graph.outputs:
            raise MixprecError("the model has no graph outputs: there is nothing to compute")
        for value in graph.inputs:
            if isinstance(value.type, ir.TensorType) and value.dtype == ir.DataType.UNDEFINED:
                raise MixprecError(f"graph input {value.name!r} has no element type (UNDEFINED)")
        for value in graph.outputs:
            if isinstance(value.type, ir.TensorType) and value.dtype == ir.DataType.UNDEFINED:
                raise MixprecError(f"graph output {value.name!r} has no element type (UNDEFINED)")
        for body, where in _bodies(model):
            opsets = _opsets(body, model)
            if isinstance(body, ir.Graph):
                for value in body.initializers.values():
                    if value.const_value is not None:
                        fault = tensor_fault(value.const_value)
                        if fault:
                            raise MixprecError(f"initializer {value.name!r} {fault}")
            for node in body:
                self._check_node(node, opsets, model)
            for value in body.outputs:
                if not _defined(value):
                    raise MixprecError(
                        f"output {value.name!r} of {where} is not computed by any node "
                        "and is no input or initializer"
                    )
        return SanitizeResult(model, modified=False)

    def _check_versions(self, model: ir.Model) -> None:
        if model.ir_version > onnx.IR_VERSION:
            raise MixprecError(
                f"ir_version {model.ir_version} is newer than this onnx package knows "
                f"({onnx.IR_VERSION}); upgrade onnx"
            )
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        latest = onnx.defs.onnx_opset_version()
        if opset is None:
            raise MixprecError("the model imports no ai.onnx opset")
        if not _MIN_OPSET <= opset <= latest:
            raise MixprecError(
                f"ai.onnx opset {opset} is not supported (mixprec supports "
                f"{_MIN_OPSET}..{latest}, the versions this onnx package knows)"
            )

    def _check_node(self, node: ir.Node, opsets: dict[str, int], model: ir.Model) -> None:
        label = _node_label(node)
        for i, value in enumerate(node.inputs):
            if value is not None and not _defined(value):
                raise MixprecError(
                    f"{label} reads {value.name!r} (input {i}), which no node, graph input "
                    "or initializer defines"
                )
        domain = "" if node.domain == "ai.onnx" else node.domain
        is_function = (node.domain, node.op_type, node.overload) in model.functions
        if domain not in opsets and node.domain not in opsets and not is_function:
            raise MixprecError(
                f"{label} is in domain {node.domain!r}, which the model does not import "
                "(no opset_import entry)"
            )
        schema = None
        if not is_function and domain in ("", "ai.onnx.ml", "ai.onnx.preview.training"):
            version = opsets.get(domain, opsets.get("ai.onnx", 0))
            try:
                schema = onnx.defs.get_schema(node.op_type, version, domain)
            except onnx.defs.SchemaError:
                if domain == "":
                    raise MixprecError(
                        f"{label}: ai.onnx has no operator {node.op_type!r} at opset {version}"
                    ) from None
        for name, attr in node.attributes.items():
            self._check_attr(label, node, name, attr, schema)
        self._check_bodies(label, node)

    def _check_attr(
        self,
        label: str,
        node: ir.Node,
        name: str,
        attr: ir.Attr,
        schema: onnx.defs.OpSchema | None,
    ) -> None:
        if attr.is_ref():
            return  # a function's attribute parameter: typed where the function is called
        if attr.type == ir.AttributeType.UNDEFINED:
            raise MixprecError(f"{label}: attribute {name!r} has no type (UNDEFINED)")
        if schema is not None:
            if name not in schema.attributes:
                raise MixprecError(
                    f"{label}: {node.op_type}-{schema.since_version} has no attribute {name!r}"
                )
            want = ir.AttributeType(int(schema.attributes[name].type))  # type: ignore[call-overload]
            if attr.type != want:
                raise MixprecError(
                    f"{label}: attribute {name!r} must be {want.name}, not {attr.type.name}"
                )
            if name in _DTYPE_ATTRS and attr.type == ir.AttributeType.INT:
                code = attr.as_int()
                valid = code in {int(t) for t in ir.DataType} and code != 0
                if not valid:
                    raise MixprecError(
                        f"{label}: attribute {name!r} = {code} is not an ONNX element type"
                    )
        for tensor in _attr_tensors(attr):
            fault = tensor_fault(tensor)
            if fault:
                raise MixprecError(f"{label}: tensor of attribute {name!r} {fault}")

    def _check_bodies(self, label: str, node: ir.Node) -> None:
        if node.domain not in _DEFAULT_DOMAINS:
            return
        if node.op_type == "If":
            for branch in ("then_branch", "else_branch"):
                attr = node.attributes.get(branch)
                if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                    got = len(attr.as_graph().outputs)
                    if got != len(node.outputs):
                        raise MixprecError(
                            f"{label}: {branch} has {got} output(s), the node has "
                            f"{len(node.outputs)}"
                        )
        elif node.op_type == "Loop":
            attr = node.attributes.get("body")
            if attr is not None and not attr.is_ref() and attr.type == ir.AttributeType.GRAPH:
                body = attr.as_graph()
                if len(body.inputs) != len(node.inputs) or len(body.outputs) != 1 + len(
                    node.outputs
                ):
                    raise MixprecError(
                        f"{label}: body has {len(body.inputs)} input(s) and "
                        f"{len(body.outputs)} output(s); the node's {len(node.inputs)} "
                        f"input(s) and {len(node.outputs)} output(s) need "
                        f"{len(node.inputs)} and {1 + len(node.outputs)}"
                    )


# --- IR version ------------------------------------------------------------------------------


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
            opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", _MIN_OPSET))
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
    import onnx.version_converter

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
        if entry.domain in _DEFAULT_DOMAINS:
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
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx"))
        for key, function in list(model.functions.items()):
            own = function.opset_imports.get("", function.opset_imports.get("ai.onnx"))
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
                    return f"the graph has a cycle through {_node_label(node)}"
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


def check_proto(proto: onnx.ModelProto, where: str = "model") -> None:
    """Faults that stop ``onnx_ir`` from parsing ``proto`` or crash code before the stages.

    Call it at the boundary, before ``ir.from_proto``: a value defined twice in one graph
    (two nodes writing the same name, an input that a node also writes), and initializers
    or tensor attributes without an element type or with data that does not fit their
    dims.

    Raises:
        MixprecError: naming the graph, node or tensor.
    """
    from mixprec._protos import iter_proto_graphs

    if not proto.HasField("graph"):
        raise MixprecError(f"{where}: no graph")
    graphs = list(iter_proto_graphs(proto.graph))
    graphs += [g for f in proto.functions for n in f.node for g in _node_graphs(n)]
    for graph in graphs:
        defined: dict[str, str] = {}
        for vi in graph.input:
            defined.setdefault(vi.name, f"graph input {vi.name!r}")
        for node in graph.node:
            for out in node.output:
                if not out:
                    continue
                if out in defined:
                    raise MixprecError(
                        f"{where}: {_proto_label(node)} writes {out!r}, which "
                        f"{defined[out]} already defines (every value needs one producer)"
                    )
                defined[out] = _proto_label(node)
        for tensor in graph.initializer:
            _check_proto_tensor(tensor, f"{where}: initializer {tensor.name!r}")
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    _check_proto_tensor(attr.t, f"{where}: {_proto_label(node)}: {attr.name!r}")


def _node_graphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    from mixprec._protos import iter_proto_graphs

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield from iter_proto_graphs(attr.g)
        for g in attr.graphs:
            yield from iter_proto_graphs(g)


def _proto_label(node: onnx.NodeProto) -> str:
    if node.name:
        return f"node {node.name!r} ({node.op_type})"
    return f"an unnamed {node.op_type} node"


def _check_proto_tensor(tensor: onnx.TensorProto, what: str) -> None:
    if tensor.data_type == 0 or tensor.data_type not in {int(t) for t in ir.DataType}:
        raise MixprecError(f"{what} has no valid element type ({tensor.data_type})")
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return
    fault = tensor_fault(ir.serde.TensorProtoTensor(tensor))
    if fault:
        raise MixprecError(f"{what} {fault}")
