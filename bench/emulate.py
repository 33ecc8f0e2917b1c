"""Run a float16/bfloat16 model on ONNX Runtime's CPU provider by emulation.

ORT's CPU provider has almost no bfloat16 kernels, so a bf16 model is measured through
an FP32 stand-in: every low-precision value becomes float32, and each node output that
was low precision is rounded through its dtype with Cast(to=LOW) -> Cast(to=FLOAT).
Arithmetic inside an op then happens in FP32; what is emulated is the storage of every
tensor in the low dtype. mixprec ships the same transformation as
mixprec._runtime.emulate_low_precision; bench.py uses that when it is importable and
falls back to :func:`emulate` below otherwise (and records which one ran).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import onnx
from metrics import LOW_TYPES, subgraphs
from onnx import TensorProto, helper, numpy_helper


def _upcast_tensor(tensor: onnx.TensorProto) -> None:
    if tensor.data_type not in LOW_TYPES:
        return
    values = numpy_helper.to_array(tensor).astype(np.float32)
    upcast = numpy_helper.from_array(values, tensor.name)
    tensor.CopyFrom(upcast)


def _retype(tp: onnx.TypeProto) -> None:
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type in LOW_TYPES:
        tp.tensor_type.elem_type = TensorProto.FLOAT
    elif tp.HasField("sequence_type"):
        _retype(tp.sequence_type.elem_type)
    elif tp.HasField("optional_type"):
        _retype(tp.optional_type.elem_type)


def _types(graph: onnx.GraphProto, outer: dict[str, int]) -> dict[str, int]:
    types = dict(outer)
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    return types


def _rewrite(graph: onnx.GraphProto, outer: dict[str, int], fresh: Callable[[str], str]) -> None:
    types = _types(graph, outer)
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for sub in subgraphs(node):
            _rewrite(sub, types, fresh)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                _upcast_tensor(attr.t)
            elif attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT:
                low = attr.i if attr.i in LOW_TYPES else None
                if low is not None:
                    attr.i = TensorProto.FLOAT
        rounding: list[onnx.NodeProto] = []
        for index, name in enumerate(node.output):
            low = types.get(name)
            if not name or low not in LOW_TYPES:
                continue
            raw = fresh(name + "__fp32")
            rounded = fresh(name + "__low")
            node.output[index] = raw
            rounding.append(helper.make_node("Cast", [raw], [rounded], to=low))
            rounding.append(helper.make_node("Cast", [rounded], [name], to=TensorProto.FLOAT))
        new_nodes.append(node)
        new_nodes.extend(rounding)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for init in graph.initializer:
        _upcast_tensor(init)
    for vi in list(graph.input) + list(graph.output):
        _retype(vi.type)
    del graph.value_info[:]


def emulate(model: onnx.ModelProto) -> onnx.ModelProto:
    """FP32 model that rounds every float16/bfloat16 value of ``model`` through its dtype."""
    try:
        typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # fall back to the types the model declares
        typed = copy.deepcopy(model)
    used: set[str] = set()

    def collect(graph: onnx.GraphProto) -> None:
        used.update(o for n in graph.node for o in n.output)
        used.update(i.name for i in graph.input)
        used.update(i.name for i in graph.initializer)
        for n in graph.node:
            for sub in subgraphs(n):
                collect(sub)

    collect(typed.graph)

    def fresh(base: str) -> str:
        name, k = base, 0
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        return name

    _rewrite(typed.graph, {}, fresh)
    return typed


def emulator() -> tuple[Callable[[onnx.ModelProto], onnx.ModelProto], str]:
    """The emulation function to use and its name for the report."""
    try:
        from mixprec._runtime import emulate_low_precision
    except Exception:  # any import problem means: use the local one
        return emulate, "bench/emulate.py"
    return emulate_low_precision, "mixprec._runtime.emulate_low_precision"
