"""Mutations of a seed model: byte-level on the serialized file, structured on the protobuf.

A mutation is a named function of a ``random.Random`` and a :class:`~.seeds.SeedModel`
(structured: it edits ``model.proto`` / ``model.side_files`` in place) or of the files
(byte-level: it edits the ``name -> bytes`` dict that is written to disk). Every mutation
is deterministic given the generator, so ``(mutation name, seed)`` names a case.

Mutations that need a particular seed say so (``seeds=``); one that finds nothing to
mutate raises :class:`NotApplicable` (a sequence of mutations skips that step).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from .seeds import DATA_FILE, MODEL_FILE, NAMES, SeedModel

__all__ = ["MUTATIONS", "Mutation", "NotApplicable", "apply_bytes", "by_name"]


class NotApplicable(Exception):
    """The model has nothing this mutation can change."""


ModelMutator = Callable[[random.Random, SeedModel], None]
BytesMutator = Callable[[random.Random, dict[str, bytes]], None]


@dataclasses.dataclass(frozen=True)
class Mutation:
    """A named mutation; exactly one of ``model`` (structured) or ``data`` (bytes) is set."""

    name: str
    group: str
    model: ModelMutator | None = None
    data: BytesMutator | None = None
    seeds: tuple[str, ...] = NAMES

    @property
    def structured(self) -> bool:
        return self.model is not None


# --------------------------------------------------------------------------- helpers


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph (If/Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for g in attr.graphs:
                yield from _graphs(g)


def _all_nodes(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for g in _graphs(proto.graph) for n in g.node]
    nodes += [n for f in proto.functions for n in f.node]
    return nodes


def _pick(rng: random.Random, items: list, what: str):
    if not items:
        raise NotApplicable(what)
    return items[rng.randrange(len(items))]


def _float_initializers(proto: onnx.ModelProto) -> list[TensorProto]:
    return [
        t
        for g in _graphs(proto.graph)
        for t in g.initializer
        if t.data_type == TensorProto.FLOAT and t.data_location != TensorProto.EXTERNAL
    ]


def _value_infos(proto: onnx.ModelProto, *, infer: bool) -> list[onnx.ValueInfoProto]:
    """Graph inputs, outputs and value_info of the main graph (value_info inferred first)."""
    if infer and not proto.graph.value_info:
        try:
            inferred = onnx.shape_inference.infer_shapes(proto)
        except Exception:  # a model already broken by an earlier mutation
            inferred = proto
        proto.graph.value_info.extend(inferred.graph.value_info)
    g = proto.graph
    return [*g.input, *g.output, *g.value_info]


def _fresh(prefix: str, rng: random.Random) -> str:
    return f"{prefix}_{rng.randrange(10**6)}"


# --------------------------------------------------------------------------- byte level


def _target(rng: random.Random, files: dict[str, bytes]) -> str:
    """The model file, or (a third of the time, when there is one) its data file."""
    if DATA_FILE in files and rng.random() < 0.3:
        return DATA_FILE
    return MODEL_FILE


def bitflip(rng: random.Random, files: dict[str, bytes]) -> None:
    name = _target(rng, files)
    data = bytearray(files[name])
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    files[name] = bytes(data)


def truncate(rng: random.Random, files: dict[str, bytes]) -> None:
    name = _target(rng, files)
    data = files[name]
    files[name] = data[: rng.randrange(len(data))]


def insert_bytes(rng: random.Random, files: dict[str, bytes]) -> None:
    name = _target(rng, files)
    data = files[name]
    i = rng.randrange(len(data) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 7, 64])))
    files[name] = data[:i] + junk + data[i:]


def delete_bytes(rng: random.Random, files: dict[str, bytes]) -> None:
    name = _target(rng, files)
    data = files[name]
    i = rng.randrange(len(data))
    files[name] = data[:i] + data[i + rng.choice([1, 2, 8, 100]) :]


def duplicate_chunk(rng: random.Random, files: dict[str, bytes]) -> None:
    name = _target(rng, files)
    data = files[name]
    i = rng.randrange(len(data))
    chunk = data[i : i + rng.choice([4, 16, 128, 1024])]
    j = rng.randrange(len(data) + 1)
    files[name] = data[:j] + chunk + data[j:]


# --------------------------------------------------------------------------- graph structure


def drop_node(rng: random.Random, m: SeedModel) -> None:
    graph = _pick(rng, [g for g in _graphs(m.proto.graph) if g.node], "no nodes")
    del graph.node[rng.randrange(len(graph.node))]


def swap_nodes(rng: random.Random, m: SeedModel) -> None:
    graph = _pick(rng, [g for g in _graphs(m.proto.graph) if len(g.node) > 1], "one node")
    i, j = rng.sample(range(len(graph.node)), 2)
    a, b = onnx.NodeProto(), onnx.NodeProto()
    a.CopyFrom(graph.node[i])
    b.CopyFrom(graph.node[j])
    graph.node[i].CopyFrom(b)
    graph.node[j].CopyFrom(a)


def rename_input(rng: random.Random, m: SeedModel) -> None:
    """A node input renamed to a tensor nobody produces (a dangling reference)."""
    node = _pick(rng, [n for n in _all_nodes(m.proto) if n.input], "no node inputs")
    node.input[rng.randrange(len(node.input))] = _fresh("dangling", rng)


def empty_input(rng: random.Random, m: SeedModel) -> None:
    """A node input renamed to the empty string: "absent", legal only where optional.
    Never a Loop's trip count: without it the seed's loop runs forever (in ORT too)."""
    slots = [
        (n, i)
        for n in _all_nodes(m.proto)
        for i in range(len(n.input))
        if not (n.op_type == "Loop" and i == 0)
    ]
    node, i = _pick(rng, slots, "no node inputs")
    node.input[i] = ""


def rename_graph_input(rng: random.Random, m: SeedModel) -> None:
    """A graph input renamed: its consumers now read a tensor that does not exist."""
    vi = _pick(rng, list(m.proto.graph.input), "no inputs")
    vi.name = _fresh("renamed", rng)


def duplicate_node_output(rng: random.Random, m: SeedModel) -> None:
    """Two nodes write the same tensor (breaks single assignment)."""
    nodes = [n for n in m.proto.graph.node if n.output]
    if len(nodes) < 2:
        raise NotApplicable("one node")
    a, b = rng.sample(nodes, 2)
    b.output[0] = a.output[0]


def make_cycle(rng: random.Random, m: SeedModel) -> None:
    """An early node reads the output of a later one."""
    nodes = [n for n in m.proto.graph.node if n.input and n.output]
    if len(nodes) < 2:
        raise NotApplicable("one node")
    i, j = sorted(rng.sample(range(len(nodes)), 2))
    nodes[i].input[rng.randrange(len(nodes[i].input))] = nodes[j].output[0]


def zero_nodes(rng: random.Random, m: SeedModel) -> None:
    del m.proto.graph.node[:]
    if rng.random() < 0.5:
        del m.proto.graph.initializer[:]


def no_outputs(rng: random.Random, m: SeedModel) -> None:
    del m.proto.graph.output[:]


def duplicate_output(rng: random.Random, m: SeedModel) -> None:
    out = m.proto.graph.output[0]
    m.proto.graph.output.add().CopyFrom(out)


def output_is_input(rng: random.Random, m: SeedModel) -> None:
    """A graph output that is a graph input (passed through), alone or beside the others."""
    inp = m.proto.graph.input[0]
    if rng.random() < 0.5:
        del m.proto.graph.output[:]
    m.proto.graph.output.add().CopyFrom(inp)


def unknown_op(rng: random.Random, m: SeedModel) -> None:
    node = _pick(rng, _all_nodes(m.proto), "no nodes")
    node.op_type = rng.choice(["FrobnicateV2", "", "conv", "MatMul2"])


def unknown_domain(rng: random.Random, m: SeedModel) -> None:
    node = _pick(rng, _all_nodes(m.proto), "no nodes")
    node.domain = rng.choice(["com.unknown", "ai.onnx.ml", "com.microsoft", "\u00e9"])
    if rng.random() < 0.5:
        m.proto.opset_import.append(helper.make_opsetid(node.domain, 1))


# --------------------------------------------------------------------------- types and shapes

_ODD_TYPES = [0, TensorProto.INT64, TensorProto.STRING, TensorProto.FLOAT16,
              TensorProto.DOUBLE, TensorProto.BOOL, TensorProto.UINT8, TensorProto.BFLOAT16,
              TensorProto.COMPLEX64, 99]  # fmt: skip


def wrong_elem_type(rng: random.Random, m: SeedModel) -> None:
    vi = _pick(rng, _value_infos(m.proto, infer=True), "no value infos")
    vi.type.tensor_type.elem_type = rng.choice(_ODD_TYPES)


def wrong_dims(rng: random.Random, m: SeedModel) -> None:
    vi = _pick(rng, _value_infos(m.proto, infer=True), "no value infos")
    shape = vi.type.tensor_type.shape
    choice = rng.randrange(5)
    if choice == 0 and shape.dim:  # a wrong value in one dim
        dim = shape.dim[rng.randrange(len(shape.dim))]
        dim.Clear()
        dim.dim_value = rng.choice([0, 1, 3, 7, 100, 4096])
    elif choice == 1 and shape.dim:  # a negative dim (illegal)
        shape.dim[rng.randrange(len(shape.dim))].dim_value = -rng.choice([1, 5])
    elif choice == 2:  # one more dim
        shape.dim.add().dim_value = rng.choice([1, 2])
    elif choice == 3 and shape.dim:  # one dim fewer
        del shape.dim[-1]
    else:  # a scalar, or no shape at all
        vi.type.tensor_type.ClearField("shape")
        if rng.random() < 0.5:
            vi.type.tensor_type.shape.SetInParent()


def zero_before_reshape(rng: random.Random, m: SeedModel) -> None:
    """A Flatten written as PyTorch exports ``x.view(x.size(0), -1)`` (Shape, Gather,
    Concat, Reshape), ``x`` declared with batch dim 0: the checker passes, ONNX Runtime
    refuses to load the model (its Reshape inference reads the declared 0 beside -1)."""
    graph = m.proto.graph
    flat = _pick(rng, [n for n in graph.node if n.op_type == "Flatten"], "no Flatten")
    x, y, tag = flat.input[0], flat.output[0], _fresh("view", rng)
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.array([0], np.int64), f"{tag}_zero"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{tag}_rest"),
        ]
    )
    at = list(graph.node).index(flat)
    view = [
        helper.make_node("Shape", [x], [f"{tag}_shape"]),
        helper.make_node("Gather", [f"{tag}_shape", f"{tag}_zero"], [f"{tag}_n"], axis=0),
        helper.make_node("Concat", [f"{tag}_n", f"{tag}_rest"], [f"{tag}_to"], axis=0),
        helper.make_node("Reshape", [x, f"{tag}_to"], [y]),
    ]
    nodes = [*graph.node[:at], *view, *graph.node[at + 1 :]]
    del graph.node[:]
    graph.node.extend(nodes)
    declared = _pick(rng, [v for v in _value_infos(m.proto, infer=True) if v.name == x], "x")
    declared.type.tensor_type.shape.dim[0].Clear()
    declared.type.tensor_type.shape.dim[0].dim_value = 0


def string_input(rng: random.Random, m: SeedModel) -> None:
    """A string graph input: the model's own input retyped, or an extra unused one."""
    if rng.random() < 0.5:
        m.proto.graph.input[0].type.tensor_type.elem_type = TensorProto.STRING
    else:
        m.proto.graph.input.append(
            helper.make_tensor_value_info(_fresh("text", rng), TensorProto.STRING, [1])
        )


def optional_type_input(rng: random.Random, m: SeedModel) -> None:
    """A graph input whose type is not a tensor (sequence, or no type at all)."""
    vi = m.proto.graph.input[0]
    if rng.random() < 0.5:
        vi.type.Clear()
    else:
        elem = onnx.TypeProto()
        elem.CopyFrom(vi.type)
        vi.type.Clear()
        vi.type.sequence_type.elem_type.CopyFrom(elem)


def cast_to_odd(rng: random.Random, m: SeedModel) -> None:
    """A Cast to an odd element type (999, 0, STRING, BFLOAT16...) after the first input."""
    graph = m.proto.graph
    x = graph.input[0].name
    y = _fresh("cast", rng)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == x:
                node.input[i] = y
    to = rng.choice([999, 0, -1, TensorProto.STRING, TensorProto.BFLOAT16, TensorProto.DOUBLE])
    graph.node.insert(0, helper.make_node("Cast", [x], [y], name="fuzz_cast", to=to))


# --------------------------------------------------------------------------- attributes


def _attributes(proto: onnx.ModelProto) -> list[AttributeProto]:
    return [
        a
        for n in _all_nodes(proto)
        for a in n.attribute
        if a.type != AttributeProto.GRAPH  # keep bodies: other mutations reach them
    ]


def attr_wrong_type(rng: random.Random, m: SeedModel) -> None:
    """An attribute of the wrong type: int where float expected, float where int, str..."""
    attr = _pick(rng, _attributes(m.proto), "no attributes")
    name = attr.name
    new = rng.choice(
        [
            helper.make_attribute(name, 1),
            helper.make_attribute(name, 0.5),
            helper.make_attribute(name, "text"),
            helper.make_attribute(name, [1, 2]),
            helper.make_attribute(name, [0.5]),
        ]
    )
    attr.CopyFrom(new)


def attr_type_zero(rng: random.Random, m: SeedModel) -> None:
    attr = _pick(rng, _attributes(m.proto), "no attributes")
    attr.type = AttributeProto.UNDEFINED


def attr_bad_value(rng: random.Random, m: SeedModel) -> None:
    """A well-typed attribute with a value out of its range (axis 9, epsilon -1, pads -3)."""
    attr = _pick(rng, _attributes(m.proto), "no attributes")
    if attr.type == AttributeProto.INT:
        attr.i = rng.choice([9, -9, 2**40, -(2**62)])
    elif attr.type == AttributeProto.FLOAT:
        attr.f = rng.choice([-1.0, math.nan, math.inf, 1e30])
    elif attr.type == AttributeProto.INTS:
        attr.ints[:] = rng.choice([[], [-3] * len(attr.ints), [9] * (len(attr.ints) + 1)])
    elif attr.type == AttributeProto.TENSOR:
        attr.t.dims[:] = [999]
    else:
        attr.ClearField("name")


def attr_unknown(rng: random.Random, m: SeedModel) -> None:
    """An attribute the schema does not know, or a required one removed."""
    node = _pick(rng, _all_nodes(m.proto), "no nodes")
    if node.attribute and rng.random() < 0.5:
        del node.attribute[rng.randrange(len(node.attribute))]
    else:
        node.attribute.append(helper.make_attribute("frobnicate", 3))


# --------------------------------------------------------------------------- opsets and ir


def odd_opset(rng: random.Random, m: SeedModel) -> None:
    for opset in m.proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = rng.choice([0, 1, 6, 7, 10, 99, -1])
            return


def duplicate_opset(rng: random.Random, m: SeedModel) -> None:
    """The default domain imported twice, at two versions (or under both spellings)."""
    domain = rng.choice(["", "ai.onnx"])
    m.proto.opset_import.append(helper.make_opsetid(domain, rng.choice([11, 13, 17, 21])))


def odd_ir_version(rng: random.Random, m: SeedModel) -> None:
    m.proto.ir_version = rng.choice([0, 1, 3, 99, -1])


# --------------------------------------------------------------------------- tensors


def nonfinite_weights(rng: random.Random, m: SeedModel) -> None:
    """NaN, +-Inf or huge (1e30) values in a float initializer: some elements, or all."""
    tensor = _pick(rng, _float_initializers(m.proto), "no float initializers")
    values = numpy_helper.to_array(tensor).copy()
    bad = rng.choice([np.nan, np.inf, -np.inf, 1e30, -1e30, 7e4, 1e-45])
    flat = values.reshape(-1)
    if rng.random() < 0.3 or flat.size == 0:
        flat[:] = bad
    else:
        for _ in range(rng.choice([1, 3])):
            flat[rng.randrange(flat.size)] = bad
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))


def delete_initializer(rng: random.Random, m: SeedModel) -> None:
    graph = _pick(rng, [g for g in _graphs(m.proto.graph) if g.initializer], "no initializers")
    del graph.initializer[rng.randrange(len(graph.initializer))]


def duplicate_initializer(rng: random.Random, m: SeedModel) -> None:
    """Two initializers with one name (different values), or an initializer named as an input."""
    graph = m.proto.graph
    tensor = _pick(rng, list(graph.initializer), "no initializers")
    copy = graph.initializer.add()
    copy.CopyFrom(tensor)
    if rng.random() < 0.5:
        copy.name = graph.input[0].name


def short_raw_data(rng: random.Random, m: SeedModel) -> None:
    """raw_data shorter (or longer) than its dims imply, or dims that disagree with the data."""
    tensor = _pick(rng, _float_initializers(m.proto), "no float initializers")
    raw = numpy_helper.to_array(tensor).tobytes()
    tensor.ClearField("float_data")
    choice = rng.randrange(4)
    if choice == 0:
        tensor.raw_data = raw[: rng.randrange(len(raw))]
    elif choice == 1:
        tensor.raw_data = raw[:-1]  # not a whole number of floats
    elif choice == 2:
        tensor.raw_data = raw + raw[:8]
    else:
        tensor.raw_data = raw
        tensor.dims.append(rng.choice([2, 1000]))


def wrong_tensor_type(rng: random.Random, m: SeedModel) -> None:
    """An initializer whose data_type disagrees with its consumers (double, int, undefined)."""
    tensor = _pick(rng, _float_initializers(m.proto), "no float initializers")
    values = numpy_helper.to_array(tensor)
    kind = rng.choice(["float64", "int32", "undefined", "float16"])
    if kind == "undefined":
        tensor.data_type = 0
    else:
        tensor.CopyFrom(numpy_helper.from_array(values.astype(kind), tensor.name))


def initializer_no_data(rng: random.Random, m: SeedModel) -> None:
    """An initializer with dims but no data at all."""
    tensor = _pick(rng, _float_initializers(m.proto), "no float initializers")
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")


# --------------------------------------------------------------------------- names


def non_utf8_name(rng: random.Random, m: SeedModel) -> None:
    """A node or tensor name that is not valid UTF-8 (patched into the serialized bytes)."""
    marker = f"NONUTF8{rng.randrange(10**6):06d}"
    bad = bytes([0xFF, 0xFE, 0xC3, 0x28]) + b"\x80" * (len(marker) - 4)
    if rng.random() < 0.5:
        node = _pick(rng, _all_nodes(m.proto), "no nodes")
        node.name = marker
    else:  # a tensor: rename it everywhere, so only the encoding is wrong
        old = _pick(rng, [n.output[0] for n in m.proto.graph.node if n.output], "no outputs")
        for node in _all_nodes(m.proto):
            node.input[:] = [marker if x == old else x for x in node.input]
            node.output[:] = [marker if x == old else x for x in node.output]
        for vi in m.proto.graph.output:
            if vi.name == old:
                vi.name = marker
    m.byte_patches.append((marker.encode(), bad))


def odd_names(rng: random.Random, m: SeedModel) -> None:
    """Legal but odd names: empty, very long, with newlines, slashes or NUL-free unicode."""
    node = _pick(rng, _all_nodes(m.proto), "no nodes")
    node.name = rng.choice(["", "a" * 5000, "line1\nline2", "../../etc", "\u202e\u00e9\U0001f600"])


# --------------------------------------------------------------------------- control flow


def empty_if_branch(rng: random.Random, m: SeedModel) -> None:
    """An If branch with no nodes (its output dangling), no outputs, or the wrong count."""
    node = _pick(rng, [n for n in _all_nodes(m.proto) if n.op_type == "If"], "no If")
    attr = _pick(rng, list(node.attribute), "no branches")
    choice = rng.randrange(3)
    if choice == 0:
        del attr.g.node[:]
    elif choice == 1:
        del attr.g.output[:]
    else:
        attr.g.output.add().CopyFrom(attr.g.output[0])


def branch_type_mismatch(rng: random.Random, m: SeedModel) -> None:
    """The two If branches return different element types."""
    node = _pick(rng, [n for n in _all_nodes(m.proto) if n.op_type == "If"], "no If")
    graph = node.attribute[0].g
    last = graph.node[-1].output[0]
    cast = helper.make_node("Cast", [last], [last + "_d"], to=TensorProto.DOUBLE)
    graph.node.append(cast)
    graph.output[0].name = last + "_d"
    graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE


def loop_body_broken(rng: random.Random, m: SeedModel) -> None:
    """A Loop body with a missing carried output, an extra input, or no condition output."""
    node = _pick(rng, [n for n in _all_nodes(m.proto) if n.op_type == "Loop"], "no Loop")
    body = node.attribute[0].g
    choice = rng.randrange(3)
    if choice == 0:
        del body.output[-1]
    elif choice == 1:
        body.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    else:  # the condition output typed float instead of bool
        body.output[0].type.tensor_type.elem_type = TensorProto.FLOAT


def recursive_function(rng: random.Random, m: SeedModel) -> None:
    """A local function that calls itself, or two that call each other."""
    fn = m.proto.functions[0]
    call = helper.make_node(fn.name, ["out"], ["out2"], domain=fn.domain)
    if rng.random() < 0.5:
        fn.node.append(call)
        fn.output[0] = "out2"
    else:
        other = m.proto.functions.add()
        other.CopyFrom(fn)
        other.name = fn.name + "B"
        fn.node.append(helper.make_node(other.name, ["out"], ["out2"], domain=fn.domain))
        fn.output[0] = "out2"
        other.node.append(call)
        other.output[0] = "out2"


def function_other_opset(rng: random.Random, m: SeedModel) -> None:
    """A local function importing another opset than the model (or none, or 99)."""
    fn = m.proto.functions[0]
    del fn.opset_import[:]
    version = rng.choice([None, 1, 11, 13, 17, 18, 21, 99])
    if version is not None:
        fn.opset_import.append(helper.make_opsetid("", version))


def function_missing(rng: random.Random, m: SeedModel) -> None:
    """Calls to a local function whose definition is gone (or renamed, or duplicated)."""
    choice = rng.randrange(3)
    if choice == 0:
        del m.proto.functions[:]
    elif choice == 1:
        m.proto.functions[0].name = "Other"
    else:
        m.proto.functions.add().CopyFrom(m.proto.functions[0])


# --------------------------------------------------------------------------- external data


def _external_entries(m: SeedModel) -> list[TensorProto]:
    return [t for t in m.proto.graph.initializer if t.data_location == TensorProto.EXTERNAL]


def _set_entry(tensor: TensorProto, key: str, value: str) -> None:
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            return
    entry = tensor.external_data.add()
    entry.key, entry.value = key, value


def external_outside(rng: random.Random, m: SeedModel) -> None:
    """External data whose location leaves the model's folder (or is absolute, or missing)."""
    tensor = _pick(rng, _external_entries(m), "no external tensors")
    location = rng.choice(
        ["../weights.bin", "/etc/hostname", "sub/../../weights.bin", "missing.bin", "", "."]
    )
    _set_entry(tensor, "location", location)


def external_past_end(rng: random.Random, m: SeedModel) -> None:
    """External data past the end of its file: offset or length too large, or a short file."""
    tensor = _pick(rng, _external_entries(m), "no external tensors")
    size = len(m.side_files[DATA_FILE])
    choice = rng.randrange(4)
    if choice == 0:
        _set_entry(tensor, "offset", str(size + rng.choice([0, 16, 4096])))
    elif choice == 1:
        _set_entry(tensor, "length", str(size * 4 + 4))
    elif choice == 2:
        m.side_files[DATA_FILE] = m.side_files[DATA_FILE][: size // 2]
    else:
        _set_entry(tensor, rng.choice(["offset", "length"]), rng.choice(["-8", "abc", "1e3"]))


# --------------------------------------------------------------------------- the registry


def _none(rng: random.Random, m: SeedModel) -> None:
    """No mutation: the seed itself must convert to a valid model."""


def _m(name: str, group: str, fn: ModelMutator, seeds: tuple[str, ...] = NAMES) -> Mutation:
    return Mutation(name, group, model=fn, seeds=seeds)


def _b(name: str, fn: BytesMutator) -> Mutation:
    return Mutation(name, "bytes", data=fn)


MUTATIONS: tuple[Mutation, ...] = (
    _m("none", "baseline", _none),
    _b("bitflip", bitflip),
    _b("truncate", truncate),
    _b("insert_bytes", insert_bytes),
    _b("delete_bytes", delete_bytes),
    _b("duplicate_chunk", duplicate_chunk),
    _m("drop_node", "graph", drop_node),
    _m("swap_nodes", "graph", swap_nodes),
    _m("rename_input", "graph", rename_input),
    _m("empty_input", "graph", empty_input),
    _m("rename_graph_input", "graph", rename_graph_input),
    _m("duplicate_node_output", "graph", duplicate_node_output),
    _m("make_cycle", "graph", make_cycle),
    _m("zero_nodes", "graph", zero_nodes),
    _m("no_outputs", "graph", no_outputs),
    _m("duplicate_output", "graph", duplicate_output),
    _m("output_is_input", "graph", output_is_input),
    _m("unknown_op", "graph", unknown_op),
    _m("unknown_domain", "graph", unknown_domain),
    _m("wrong_elem_type", "types", wrong_elem_type),
    _m("wrong_dims", "types", wrong_dims),
    _m("zero_before_reshape", "types", zero_before_reshape, ("cnn",)),
    _m("string_input", "types", string_input),
    _m("non_tensor_input", "types", optional_type_input),
    _m("cast_to_odd", "types", cast_to_odd),
    _m("attr_wrong_type", "attributes", attr_wrong_type),
    _m("attr_type_zero", "attributes", attr_type_zero),
    _m("attr_bad_value", "attributes", attr_bad_value),
    _m("attr_unknown", "attributes", attr_unknown),
    _m("odd_opset", "opsets", odd_opset),
    _m("duplicate_opset", "opsets", duplicate_opset),
    _m("odd_ir_version", "opsets", odd_ir_version),
    _m("nonfinite_weights", "tensors", nonfinite_weights),
    _m("delete_initializer", "tensors", delete_initializer),
    _m("duplicate_initializer", "tensors", duplicate_initializer),
    _m("short_raw_data", "tensors", short_raw_data),
    _m("wrong_tensor_type", "tensors", wrong_tensor_type),
    _m("initializer_no_data", "tensors", initializer_no_data),
    _m("non_utf8_name", "names", non_utf8_name),
    _m("odd_names", "names", odd_names),
    _m("empty_if_branch", "control_flow", empty_if_branch, ("if",)),
    _m("branch_type_mismatch", "control_flow", branch_type_mismatch, ("if",)),
    _m("loop_body_broken", "control_flow", loop_body_broken, ("loop",)),
    _m("recursive_function", "functions", recursive_function, ("function",)),
    _m("function_other_opset", "functions", function_other_opset, ("function",)),
    _m("function_missing", "functions", function_missing, ("function",)),
    _m("external_outside", "external_data", external_outside, ("external",)),
    _m("external_past_end", "external_data", external_past_end, ("external",)),
)

_BY_NAME = {m.name: m for m in MUTATIONS}


def by_name(name: str) -> Mutation:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown mutation {name!r}; known: {', '.join(_BY_NAME)}") from None


def apply_bytes(model: SeedModel) -> dict[str, bytes]:
    """The files of ``model``, with its byte patches (non-UTF-8 names) applied."""
    files = model.files()
    data = files[MODEL_FILE]
    for old, new in model.byte_patches:
        data = data.replace(old, new)
    files[MODEL_FILE] = data
    return files
