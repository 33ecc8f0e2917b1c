"""Seed models for the fuzz suite, built in code (nothing downloaded, nothing committed).

Each seed is a small but realistic FP32 graph, available at opsets 11, 13 and 17 and
valid under ``onnx.checker.check_model(full_check=True)``:

* ``cnn``: Conv + BatchNormalization + Relu + global pool + MatMul + Softmax;
* ``attention``: LayerNorm (decomposed below opset 17) + Q/K/V MatMuls + Softmax;
* ``gather``: an int64 index input through Gather (embedding lookup) and a MatMul;
* ``if``: an If whose branches compute on an outer-scope tensor;
* ``loop``: a Loop accumulating a MatMul three times;
* ``function``: a model-local function (``local.Block``) called twice;
* ``external``: the CNN with its weights in an external data file beside the model.

:func:`build` returns a :class:`SeedModel`: the ``ModelProto`` plus, for ``external``,
the data file's bytes, so that a mutator can work on either and :func:`SeedModel.write`
lays the files out in a folder.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["NAMES", "OPSETS", "SeedModel", "build", "ir_version_for"]

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
OPSETS = (11, 13, 17)
NAMES = ("cnn", "attention", "gather", "if", "loop", "function", "external")
MODEL_FILE = "model.onnx"
DATA_FILE = "weights.bin"


def ir_version_for(opset: int) -> int:
    """The IR version an exporter would write for ``opset`` (functions need 8)."""
    return {11: 6, 13: 7}.get(opset, 8)


@dataclasses.dataclass
class SeedModel:
    """A model to mutate: its proto and any side files (name -> bytes) beside it."""

    name: str
    opset: int
    proto: onnx.ModelProto
    side_files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    #: (old, new) replacements of the serialized model, for what protobuf cannot hold
    #: (names that are not UTF-8).
    byte_patches: list[tuple[bytes, bytes]] = dataclasses.field(default_factory=list)

    def files(self) -> dict[str, bytes]:
        """The files of this model, by name: ``model.onnx`` and its side files."""
        return {MODEL_FILE: self.proto.SerializeToString(), **self.side_files}

    def copy(self) -> SeedModel:
        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)
        return SeedModel(
            self.name, self.opset, proto, dict(self.side_files), list(self.byte_patches)
        )


def write_files(files: dict[str, bytes], folder: Path) -> Path:
    """Write ``files`` into ``folder``; returns the model's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder / MODEL_FILE


class _Graph:
    """A small helper to build graphs: named weights, nodes with generated names."""

    def __init__(self, rng: np.random.Generator, prefix: str = "") -> None:
        self.rng = rng
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.k = 0

    def _name(self, base: str) -> str:
        self.k += 1
        return f"{self.prefix}{base}_{self.k}"

    def weight(self, *shape: int, scale: float = 0.3, base: str = "w") -> str:
        values = (self.rng.standard_normal(shape) * scale).astype(np.float32)
        return self.const(values, base)

    def const(self, values: np.ndarray, base: str = "c") -> str:
        name = self._name(base)
        self.inits.append(numpy_helper.from_array(values, name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str:
        outs = [self._name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(
            helper.make_node(op_type, inputs, outs, name=self._name(op_type), **attrs)
        )
        return outs[0]


def _model(
    g: _Graph,
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    opset: int,
    *,
    functions: list[onnx.FunctionProto] | None = None,
    extra_opsets: list[onnx.OperatorSetIdProto] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(g.nodes, "seed", inputs, outputs, g.inits)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), *(extra_opsets or [])],
        ir_version=8 if functions else ir_version_for(opset),
        producer_name="mixprec-fuzz",
    )
    if functions:
        model.functions.extend(functions)
    return model


def _rename_out(g: _Graph, tensor: str, name: str) -> None:
    for node in g.nodes:
        for i, out in enumerate(node.output):
            if out == tensor:
                node.output[i] = name


def _cnn(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    g = _Graph(rng)
    c_in, c, k = 3, 8, 10
    h = g.op("Conv", ["x", g.weight(c, c_in, 3, 3), g.weight(c, scale=0.1)], pads=[1, 1, 1, 1])
    scale = g.const((1 + 0.1 * rng.standard_normal(c)).astype(np.float32), "bn_scale")
    bias = g.const((0.1 * rng.standard_normal(c)).astype(np.float32), "bn_bias")
    mean = g.const((0.1 * rng.standard_normal(c)).astype(np.float32), "bn_mean")
    var = g.const((1 + 0.1 * rng.random(c)).astype(np.float32), "bn_var")
    h = g.op("BatchNormalization", [h, scale, bias, mean, var], epsilon=1e-5)
    h = g.op("Relu", [h])
    h = g.op("GlobalAveragePool", [h])
    h = g.op("Flatten", [h], axis=1)
    h = g.op("MatMul", [h, g.weight(c, k)])
    h = g.op("Add", [h, g.weight(k, scale=0.1)])
    h = g.op("Softmax", [h], axis=1)
    _rename_out(g, h, "probs")
    return _model(
        g,
        [helper.make_tensor_value_info("x", F32, ["N", c_in, 8, 8])],
        [helper.make_tensor_value_info("probs", F32, ["N", k])],
        opset,
    )


def _layer_norm(g: _Graph, x: str, d: int, opset: int) -> str:
    gamma = g.const(np.ones(d, np.float32), "ln_gamma")
    beta = g.const(np.zeros(d, np.float32), "ln_beta")
    if opset >= 17:
        return g.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)
    mean = g.op("ReduceMean", [x], axes=[-1], keepdims=1)
    centred = g.op("Sub", [x, mean])
    var = g.op("ReduceMean", [g.op("Mul", [centred, centred])], axes=[-1], keepdims=1)
    std = g.op("Sqrt", [g.op("Add", [var, g.const(np.array(1e-5, np.float32), "eps")])])
    return g.op("Add", [g.op("Mul", [g.op("Div", [centred, std]), gamma]), beta])


def _attention(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    g = _Graph(rng)
    s, d = 6, 16
    h = _layer_norm(g, "x", d, opset)
    q = g.op("MatMul", [h, g.weight(d, d, scale=0.2)])
    k = g.op("MatMul", [h, g.weight(d, d, scale=0.2)])
    v = g.op("MatMul", [h, g.weight(d, d, scale=0.2)])
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 2, 1])])
    scores = g.op("Mul", [scores, g.const(np.array(d**-0.5, np.float32), "scale")])
    attn = g.op("Softmax", [scores], axis=-1)
    y = g.op("Add", [g.op("MatMul", [attn, v]), "x"])
    _rename_out(g, y, "y")
    return _model(
        g,
        [helper.make_tensor_value_info("x", F32, [1, s, d])],
        [helper.make_tensor_value_info("y", F32, [1, s, d])],
        opset,
    )


def _gather(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    g = _Graph(rng)
    vocab, d = 20, 8
    emb = g.op("Gather", [g.weight(vocab, d, base="embedding"), "ids"], axis=0)
    h = g.op("Relu", [g.op("MatMul", [emb, g.weight(d, d)])])
    pooled = g.op("ReduceSum", [h], axes=[1], keepdims=0) if opset < 13 else None
    if pooled is None:
        pooled = g.op("ReduceSum", [h, g.const(np.array([1], np.int64), "axes")], keepdims=0)
    _rename_out(g, pooled, "pooled")
    return _model(
        g,
        [helper.make_tensor_value_info("ids", I64, [1, 5])],
        [helper.make_tensor_value_info("pooled", F32, [1, d])],
        opset,
    )


def _if(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    g = _Graph(rng)
    d = 8
    w = g.weight(d, d)
    h = g.op("MatMul", ["x", w])
    total = g.op("ReduceSum", [h], keepdims=0)
    cond = g.op("Greater", [total, g.const(np.array(0.0, np.float32), "zero")])

    def branch(name: str, op_type: str) -> onnx.GraphProto:
        b = _Graph(rng, prefix=f"{name}_")
        out = b.op(op_type, [b.op("MatMul", [h, b.weight(d, d)])])
        _rename_out(b, out, f"{name}_out")
        return helper.make_graph(
            b.nodes, name, [], [helper.make_tensor_value_info(f"{name}_out", F32, None)], b.inits
        )

    y = g.op("If", [cond], then_branch=branch("then", "Relu"), else_branch=branch("else", "Tanh"))
    _rename_out(g, y, "y")
    return _model(
        g,
        [helper.make_tensor_value_info("x", F32, [2, d])],
        [helper.make_tensor_value_info("y", F32, [2, d])],
        opset,
    )


def _loop(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    g = _Graph(rng)
    d = 8
    b = _Graph(rng, prefix="body_")
    h = b.op("Tanh", [b.op("MatMul", ["acc_in", b.weight(d, d)])])
    b.op("Identity", ["cond_in"])
    _rename_out(b, b.nodes[-1].output[0], "cond_out")
    _rename_out(b, h, "acc_out")
    body = helper.make_graph(
        b.nodes,
        "body",
        [
            helper.make_tensor_value_info("iter", I64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", F32, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", F32, None),
        ],
        b.inits,
    )
    trip = g.const(np.array(3, np.int64), "trip")
    cond = g.const(np.array(True), "cond")
    y = g.op("Loop", [trip, cond, "x"], body=body)
    y = g.op("MatMul", [y, g.weight(d, 4)])
    _rename_out(g, y, "y")
    return _model(
        g,
        [helper.make_tensor_value_info("x", F32, [2, d])],
        [helper.make_tensor_value_info("y", F32, [2, 4])],
        opset,
    )


def _function(rng: np.random.Generator, opset: int) -> onnx.ModelProto:
    d = 8
    fn = helper.make_function(
        "local",
        "Block",
        ["a", "w"],
        ["out"],
        [
            helper.make_node("MatMul", ["a", "w"], ["m"]),
            helper.make_node("Relu", ["m"], ["r"]),
            helper.make_node("Add", ["r", "a"], ["out"]),
        ],
        opset_imports=[helper.make_opsetid("", opset)],
    )
    g = _Graph(rng)
    h = g.op("Block", ["x", g.weight(d, d)], domain="local")
    h = g.op("Block", [h, g.weight(d, d)], domain="local")
    y = g.op("Softmax", [h], axis=1)
    _rename_out(g, y, "y")
    return _model(
        g,
        [helper.make_tensor_value_info("x", F32, [2, d])],
        [helper.make_tensor_value_info("y", F32, [2, d])],
        opset,
        functions=[fn],
        extra_opsets=[helper.make_opsetid("local", 1)],
    )


def _external(rng: np.random.Generator, opset: int) -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """The CNN with every initializer of 64+ bytes in ``weights.bin`` (aligned, offset order)."""
    model = _cnn(rng, opset)
    blob = bytearray()
    for tensor in model.graph.initializer:
        raw = numpy_helper.to_array(tensor).tobytes()
        if len(raw) < 64:
            continue
        offset = len(blob)
        blob += raw
        blob += b"\0" * (-len(blob) % 16)
        tensor.ClearField("float_data")
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", DATA_FILE), ("offset", offset), ("length", len(raw))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    return model, {DATA_FILE: bytes(blob)}


_BUILDERS = {
    "cnn": _cnn,
    "attention": _attention,
    "gather": _gather,
    "if": _if,
    "loop": _loop,
    "function": _function,
}


def build(name: str, opset: int, seed: int = 0) -> SeedModel:
    """The seed model ``name`` at ``opset``, with weights drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    if name == "external":
        proto, side = _external(rng, opset)
        return SeedModel(name, opset, proto, side)
    return SeedModel(name, opset, _BUILDERS[name](rng, opset))
