"""ONNX Runtime side of mixprec: inputs, runs, range analysis and validation.

This module does everything that needs real numbers:

* :func:`make_inputs` / :func:`load_inputs_npz` build the feeds a model is run with.
* :func:`run_model` runs a model on ONNX Runtime's CPU execution provider.
* :func:`collect_absmax` is the range analysis: it runs the FP32 model once and
  records ``max(|x|)`` of every floating-point tensor of the main graph.
* :func:`compare_outputs`, :func:`emulate_low_precision` and :func:`validate_models`
  check a converted model against its FP32 original.

ONNX Runtime's CPU provider has float16 kernels for most ops but almost no bfloat16
kernels (Cast is supported, MatMul/Add/Mul/Relu are not), so a bfloat16 model usually
cannot run there. :func:`emulate_low_precision` rewrites a mixed-precision model into
an FP32 model in which every low-precision tensor is rounded through its low dtype with a
``Cast(to=LOW) -> Cast(to=FLOAT)`` pair; ORT's float->bfloat16 Cast rounds to nearest
even, bit-exact with ``ml_dtypes.bfloat16``. Arithmetic inside each op then happens in
FP32, so the emulation measures the effect of storing tensors in the low dtype (the main
source of error), not of low-precision accumulation inside kernels.

Models larger than 2 GB cannot be serialized as one protobuf message. Functions that
take a :class:`onnx.ModelProto` handle that by writing the model's initializers to a
temporary external-data file; :func:`run_model` also accepts a path, which is the
cheaper way to run such a model.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import os
import re
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper, shape_inference

from mixprec._errors import MixprecError
from mixprec._protos import (
    _IN_MEMORY,
    _copy_fields,
    _light_copy,
    _numel,
    weightless_proto,
)
from mixprec._protos import iter_proto_graphs as _iter_graphs

__all__ = [
    "DEFAULT_RTOL",
    "OutputComparison",
    "ValidationReport",
    "collect_absmax",
    "compare_outputs",
    "emulate_low_precision",
    "load_inputs_npz",
    "make_inputs",
    "run_model",
    "validate_models",
]

logger = logging.getLogger(__name__)

#: Default relative L2 tolerance of a converted model's outputs, by low dtype.
# Relative L2 tolerances per low dtype. bf16 keeps 8 mantissa bits against fp16's 11: its
# unit roundoff is 8x larger, so its tolerance is fp16's scaled by 8.
DEFAULT_RTOL = {"float16": 1e-2, "bfloat16": 8e-2}

# Relative tolerance used when the converted model has no low-precision tensor at all.
_NO_LOW_RTOL = 1e-4

_FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)
_LOW_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
_INT_TYPES = frozenset(
    {
        TensorProto.INT8,
        TensorProto.UINT8,
        TensorProto.INT16,
        TensorProto.UINT16,
        TensorProto.INT32,
        TensorProto.UINT32,
        TensorProto.INT64,
        TensorProto.UINT64,
    }
)
# Packed sub-byte types: numpy holds them one element per byte, so raw bytes differ.
_PACKED_TYPES = frozenset(
    getattr(TensorProto, n)
    for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(TensorProto, n)
)
_LOW_NAMES: dict[int, str] = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}
_BF16 = np.dtype(ml_dtypes.bfloat16)
_STANDARD_DOMAINS = ("", "ai.onnx")
# Integer attributes that name an output element type.
_DTYPE_ATTRS = ("to", "dtype", "output_dtype")

# Largest serialized protobuf message; larger models go through external data.
_PROTO_LIMIT = 2_000_000_000
# Initializers with more elements than this are left out of shape inference (as inputs).

# Bisection depth when a range-analysis chunk fails in ONNX Runtime.
_MAX_BISECT_DEPTH = 12


class _OrtLoadError(MixprecError):
    """ONNX Runtime could not create a session for a model."""


class _OrtRunError(MixprecError):
    """ONNX Runtime created a session but could not run it."""


# --------------------------------------------------------------------------- helpers


def _copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


# ORT prefixes messages with a C++ source location and function signature; drop them.
_ORT_SOURCE_NOISE = re.compile(r"\s*/onnxruntime_src/\S+:\d+\s+[^\s(]+\([^()]*\)\s*")


def _first_line(error: BaseException) -> str:
    for line in str(error).splitlines():
        if line.strip():
            text = _ORT_SOURCE_NOISE.sub(" ", line).strip()
            return text if len(text) <= 400 else text[:397] + "..."
    return type(error).__name__


def _initializer_names(graph: onnx.GraphProto) -> set[str]:
    names = {t.name for t in graph.initializer}
    names.update(s.values.name for s in graph.sparse_initializer)
    return names


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs a caller must feed (those that are not also initializers)."""
    inits = _initializer_names(model.graph)
    return [vi for vi in model.graph.input if vi.name not in inits]


def _tensor_elem_type(vi: onnx.ValueInfoProto) -> int:
    if not vi.type.HasField("tensor_type"):
        kind = vi.type.WhichOneof("value") or "unknown"
        raise MixprecError(f"input {vi.name!r} is a {kind}, not a tensor; mixprec needs tensors")
    return int(vi.type.tensor_type.elem_type)


def _dtype_name(elem_type: int) -> str:
    try:
        return helper.tensor_dtype_to_string(elem_type).removeprefix("TensorProto.").lower()
    except (KeyError, ValueError):
        return f"type {elem_type}"


def _np_dtype(elem_type: int) -> np.dtype[Any]:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def _is_float_dtype(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype == _BF16


def _infer(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """Runs ONNX shape inference on a light copy of ``model``; ``None`` when it fails."""
    try:
        return shape_inference.infer_shapes(
            _light_copy(model), check_type=False, strict_mode=False, data_prop=True
        )
    except Exception as e:
        logger.warning("shape inference failed, using declared types only: %s", _first_line(e))
        return None


def _value_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """Types of the values one graph declares: inputs, value_info, outputs, initializers."""
    types: dict[str, onnx.TypeProto] = {}
    for t in graph.initializer:
        tp = onnx.TypeProto()
        tp.tensor_type.elem_type = t.data_type
        types[t.name] = tp
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.HasField("type") and vi.type.WhichOneof("value") is not None:
            types[vi.name] = vi.type
    return types


def _tensor_type_of(types: Mapping[str, onnx.TypeProto], name: str) -> int | None:
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type"):
        return None
    elem = int(tp.tensor_type.elem_type)
    return elem or None


# Standard ops whose output 0 has the element type of input 0 (Where: of input 1; Split: all
# outputs). Used only to fill in types that shape inference left unknown.
_SAME_TYPE_OPS = frozenset(
    {
        "Abs", "Add", "AveragePool", "BatchNormalization", "Ceil", "Clip", "Concat", "Conv",
        "ConvTranspose", "Cos", "CumSum", "Div", "Dropout", "Elu", "Erf", "Exp", "Expand",
        "Flatten", "Floor", "Gather", "GatherElements", "GatherND", "Gelu", "Gemm",
        "GlobalAveragePool", "GlobalMaxPool", "HardSigmoid", "HardSwish", "Identity",
        "InstanceNormalization", "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax",
        "MatMul", "Max", "MaxPool", "Mean", "Min", "Mish", "Mul", "Neg", "Pad", "Pow",
        "PRelu", "Reciprocal", "ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "Relu", "Reshape", "Resize", "Round", "Selu", "Sigmoid",
        "Sign", "Sin", "Slice", "Softmax", "Softplus", "Split", "Sqrt", "Squeeze", "Sub",
        "Sum", "Tanh", "Tile", "Transpose", "Unsqueeze", "Where",
    }
)  # fmt: skip


def _elem_types(graph: onnx.GraphProto, types: Mapping[str, onnx.TypeProto]) -> dict[str, int]:
    """Element types of ``graph``'s tensors: from ``types``, else derived node by node.

    Cast and Constant outputs take the type they name; outputs of the simple ops in
    ``_SAME_TYPE_OPS`` take their data input's type. Other unknown values stay unknown.
    """
    elems: dict[str, int] = {}
    for name in types:
        elem = _tensor_type_of(types, name)
        if elem is not None:
            elems[name] = elem
    for node in graph.node:
        if node.domain not in _STANDARD_DOMAINS:
            continue
        guess: int | None = None
        if node.op_type == "Cast":
            guess = next((int(a.i) for a in node.attribute if a.name == "to"), None)
        elif node.op_type == "Constant":
            guess = next((int(a.t.data_type) for a in node.attribute if a.name == "value"), None)
        elif node.op_type in _SAME_TYPE_OPS and node.input:
            source = node.input[1] if node.op_type == "Where" and len(node.input) > 1 else None
            guess = elems.get(source or node.input[0])
        if guess is None:
            continue
        outputs = node.output if node.op_type == "Split" else node.output[:1]
        for name in outputs:
            if name and name not in elems:
                elems[name] = guess
    return elems


# --------------------------------------------------------------------------- inputs


def _declared_dims(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _fmt_dims(dims: Sequence[int | str | None]) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in dims) + "]"


def _resolve_shape(
    vi: onnx.ValueInfoProto,
    override: Sequence[int] | None,
    default_dim: int | None,
    notes: list[str],
) -> tuple[int, ...]:
    name = vi.name
    declared = _declared_dims(vi)
    if override is not None:
        dims = tuple(int(d) for d in override)
        if any(d < 0 for d in dims):
            raise MixprecError(f"--shape for input {name!r} has a negative dim: {list(dims)}")
        if declared is not None:
            if len(declared) != len(dims):
                raise MixprecError(
                    f"--shape for input {name!r} has rank {len(dims)} but the model declares "
                    f"rank {len(declared)} {_fmt_dims(declared)}"
                )
            for i, (want, got) in enumerate(zip(declared, dims, strict=True)):
                if isinstance(want, int) and want != got:
                    raise MixprecError(
                        f"--shape for input {name!r} gives dim {i} = {got} but the model "
                        f"declares {want} {_fmt_dims(declared)}"
                    )
        return dims
    if declared is None:
        raise MixprecError(
            f"input {name!r} has unknown rank; give its shape with --shape {name}=D0,D1,..."
        )
    out: list[int] = []
    for i, d in enumerate(declared):
        if isinstance(d, int):
            out.append(d)
            continue
        if default_dim is None:
            what = f"symbolic dim {d!r}" if d is not None else f"unknown dim {i}"
            raise MixprecError(
                f"input {name!r} has {what}; give its shape with --shape {name}=D0,D1,..."
            )
        label = f" ({d!r})" if d is not None else ""
        notes.append(f"input {name!r}: dim {i}{label} unknown, used {default_dim}")
        out.append(default_dim)
    return tuple(out)


def _audio_like(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Rows of a seeded mixture of three sines at 16 kHz plus small noise, in [-1, 1]."""
    rows, length = shape
    t = np.arange(length, dtype=np.float64) / 16000.0
    signal = np.zeros(shape, dtype=np.float64)
    for _ in range(3):
        freq = rng.uniform(80.0, 4000.0, size=(rows, 1))
        amp = rng.uniform(0.1, 1.0, size=(rows, 1))
        phase = rng.uniform(0.0, 2.0 * np.pi, size=(rows, 1))
        signal += amp * np.sin(2.0 * np.pi * freq * t[None, :] + phase)
    peak = np.maximum(np.abs(signal).max(axis=1, keepdims=True, initial=0.0), 1e-12)
    signal = 0.8 * signal / peak + 0.01 * rng.standard_normal(shape)
    return np.clip(signal, -1.0, 1.0)


_INDEX_PASSTHROUGH = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity"})


def _index_bounds(model: onnx.ModelProto) -> dict[str, int]:
    """Graph inputs used as Gather indices into a constant table: name -> table size.

    Follows the indices back through shape-only ops (Cast, Unsqueeze, Reshape...) to a
    graph input, so generated token ids (or token-type ids) stay within the embedding.
    """
    graph = model.graph
    dims: dict[str, list[int]] = {t.name: list(t.dims) for t in graph.initializer}
    producer: dict[str, onnx.NodeProto] = {}
    for node in graph.node:
        for out in node.output:
            producer[out] = node
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    dims[node.output[0]] = list(attr.t.dims)
    inputs = {vi.name for vi in graph.input}
    bounds: dict[str, int] = {}
    for node in graph.node:
        if node.op_type not in ("Gather", "GatherElements") or len(node.input) < 2:
            continue
        table = dims.get(node.input[0])
        if not table:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        size = table[axis % len(table)]
        name = node.input[1]
        for _ in range(4):
            if name in inputs or name not in producer:
                break
            prev = producer[name]
            if prev.op_type not in _INDEX_PASSTHROUGH or not prev.input:
                break
            name = prev.input[0]
        if name in inputs and size > 0:
            bounds[name] = min(bounds.get(name, size), size)
    return bounds


def _generate(
    name: str,
    elem_type: int,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    notes: list[str],
    index_bound: int | None = None,
) -> np.ndarray:
    lname = name.lower()
    if elem_type in _FLOAT_TYPES:
        if len(shape) == 2 and shape[-1] >= 256:
            notes.append(f"input {name!r}: audio-like, used a seeded sine mixture in [-1, 1]")
            data: np.ndarray = _audio_like(shape, rng)
        else:
            data = rng.random(shape)
        return data.astype(_np_dtype(elem_type))
    if elem_type in _INT_TYPES:
        dtype = _np_dtype(elem_type)
        size = _numel(shape)
        if (
            size == 1
            and len(shape) <= 1
            and ("sr" in lname or "rate" in lname)
            and np.iinfo(dtype).max >= 16000
        ):
            notes.append(f"input {name!r}: looks like a sample rate, used 16000")
            return np.full(shape, 16000, dtype=dtype)
        if "mask" in lname:
            notes.append(f"input {name!r}: looks like a mask, used all ones")
            return np.ones(shape, dtype=dtype)
        if index_bound is not None:
            high = min(100, index_bound)
            notes.append(
                f"input {name!r}: indexes a table of {index_bound} rows, used ints in [0, {high})"
            )
            return rng.integers(0, high, size=shape).astype(dtype)
        return rng.integers(0, 100, size=shape).astype(dtype)
    if elem_type == TensorProto.BOOL:
        return np.asarray(rng.random(shape) < 0.5)
    if elem_type == TensorProto.STRING:
        raise MixprecError(
            f"input {name!r} is a string tensor; mixprec cannot generate or convert string inputs"
        )
    raise MixprecError(
        f"input {name!r} has dtype {_dtype_name(elem_type)}; mixprec cannot generate it, "
        "pass an inputs file instead"
    )


def make_inputs(
    model: onnx.ModelProto,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    default_dim: int | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Generates one realistic, seeded input array per graph input.

    Inputs that are also initializers are skipped (they have defaults). Value ranges:

    * float types: uniform in ``[0, 1)`` (image-like). A float input of rank 2 whose last
      dim is >= 256 is treated as audio: a seeded mixture of sines plus small noise, in
      ``[-1, 1]``. float16/bfloat16 inputs are generated as float and cast.
    * integer types: a scalar (or one-element) input whose name contains ``"sr"`` or
      ``"rate"`` gets 16000 (a sample rate); a name containing ``"mask"`` gets all ones
      (an attention mask); otherwise uniform integers in ``[0, 100)``.
    * bool: random.

    Args:
        model: The model whose inputs to generate.
        shapes: Full shapes by input name; they override the declared shapes.
        seed: Seed of the ``numpy.random.default_rng`` generator.
        default_dim: Used for symbolic or unknown dims that ``shapes`` does not cover.

    Returns:
        ``(feeds, notes)``: the arrays by input name, and one human-readable note per
        guess made (unknown dims, value-range heuristics).

    Raises:
        MixprecError: A symbolic dim with no ``default_dim``, a ``shapes`` entry that
            disagrees with the model, or an input mixprec cannot generate (strings).
    """
    if default_dim is not None and default_dim < 1:
        raise MixprecError(f"default dim must be a positive integer, got {default_dim}")
    inputs = _graph_inputs(model)
    given = dict(shapes or {})
    names = [vi.name for vi in inputs]
    for name in given:
        if name not in names:
            raise MixprecError(
                f"--shape names {name!r}, which is not a graph input "
                f"(inputs: {', '.join(names) or 'none'})"
            )
    rng = np.random.default_rng(seed)
    bounds = _index_bounds(model)
    feeds: dict[str, np.ndarray] = {}
    notes: list[str] = []
    for vi in inputs:
        elem_type = _tensor_elem_type(vi)
        if elem_type == TensorProto.STRING:
            raise MixprecError(
                f"input {vi.name!r} is a string tensor; "
                "mixprec cannot generate or convert string inputs"
            )
        shape = _resolve_shape(vi, given.get(vi.name), default_dim, notes)
        feeds[vi.name] = _generate(vi.name, elem_type, shape, rng, notes, bounds.get(vi.name))
    return feeds, notes


def _cast_feed(name: str, array: np.ndarray, elem_type: int, source: str) -> np.ndarray:
    """Casts ``array`` to the declared type when only the width/precision differs."""
    want = _np_dtype(elem_type)
    have = array.dtype
    if have == want:
        return array
    if want == _BF16 and have.kind == "V" and have.itemsize == 2:
        return array.view(_BF16)
    if _is_float_dtype(want) and _is_float_dtype(have):
        return array.astype(want)
    if want.kind in "iu" and have.kind in "iu":
        return array.astype(want)
    raise MixprecError(
        f"input {name!r} expects {_dtype_name(elem_type)} but {source} has {have.name}"
    )


def load_inputs_npz(path: str | os.PathLike[str], model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Loads model inputs from an ``.npz`` archive (one array per input name).

    Arrays are cast to the declared dtype when only the precision differs (float64 for a
    float32 input, int32 for an int64 input). Arrays that match no graph input are
    ignored with a warning.

    Args:
        path: The ``.npz`` file, as written by ``numpy.savez``.
        model: The model the arrays are for.

    Returns:
        The arrays by input name, for every required graph input.

    Raises:
        MixprecError: The file is missing or unreadable, lacks an input, or holds an array
            of the wrong kind or rank.
    """
    p = Path(path)
    try:
        loaded = np.load(p, allow_pickle=False)
    except FileNotFoundError:
        raise MixprecError(f"inputs file {str(p)!r} does not exist") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise MixprecError(f"cannot read inputs file {str(p)!r}: {_first_line(e)}") from e
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise MixprecError(f"inputs file {str(p)!r} is not an .npz archive (use numpy.savez)")
    with loaded:
        arrays = {key: loaded[key] for key in loaded.files}
    feeds: dict[str, np.ndarray] = {}
    inputs = _graph_inputs(model)
    for vi in inputs:
        if vi.name not in arrays:
            raise MixprecError(
                f"inputs file {p.name!r} has no array for input {vi.name!r} "
                f"(it has: {', '.join(sorted(arrays)) or 'nothing'})"
            )
        array = np.asarray(arrays[vi.name])
        elem_type = _tensor_elem_type(vi)
        declared = _declared_dims(vi)
        if declared is not None and len(declared) != array.ndim:
            raise MixprecError(
                f"input {vi.name!r} in {p.name!r} has rank {array.ndim} but the model "
                f"declares rank {len(declared)} {_fmt_dims(declared)}"
            )
        feeds[vi.name] = _cast_feed(vi.name, array, elem_type, f"{p.name!r}")
    extra = sorted(set(arrays) - {vi.name for vi in inputs})
    if extra:
        logger.warning("inputs file %s: ignoring arrays %s (not graph inputs)", p.name, extra)
    return feeds


def _feeds_for(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The subset of ``feeds`` that ``model`` takes, cast to its declared dtypes."""
    out: dict[str, np.ndarray] = {}
    for vi in _graph_inputs(model):
        if vi.name not in feeds:
            raise MixprecError(f"no input data for model input {vi.name!r}")
        array = np.asarray(feeds[vi.name])
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            array = _cast_feed(vi.name, array, vi.type.tensor_type.elem_type, "the feed")
        out[vi.name] = array
    return out


# --------------------------------------------------------------------------- running


def _external_skeleton(model: onnx.ModelProto, directory: Path) -> onnx.ModelProto:
    """Writes the main graph's initializers to ``directory/model.onnx.data``.

    Returns a copy of ``model`` whose initializers refer to that file. ``model`` itself
    is left untouched, and only one tensor's bytes are duplicated at a time.
    """
    data_name = "model.onnx.data"
    skeleton = onnx.ModelProto()
    _copy_fields(model, skeleton, frozenset({"graph"}))
    _copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    data_fields = frozenset(
        {
            "raw_data",
            "float_data",
            "int32_data",
            "string_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "external_data",
            "data_location",
        }
    )
    offset = 0
    with open(directory / data_name, "wb") as f:
        for t in model.graph.initializer:
            keep_inline = (
                t.data_location == TensorProto.EXTERNAL
                or t.data_type in (TensorProto.STRING, *_PACKED_TYPES)
                or _numel(t.dims) < 1024
            )
            if keep_inline:
                skeleton.graph.initializer.add().CopyFrom(t)
                continue
            raw = t.raw_data if t.raw_data else numpy_helper.to_array(t).tobytes()
            nt = skeleton.graph.initializer.add()
            _copy_fields(t, nt, data_fields)
            for key, value in (("location", data_name), ("offset", offset), ("length", len(raw))):
                entry = nt.external_data.add()
                entry.key = key
                entry.value = str(value)
            nt.data_location = TensorProto.EXTERNAL
            f.write(raw)
            offset += len(raw)
    if skeleton.ByteSize() > _PROTO_LIMIT:
        raise MixprecError(
            "the model is over 2 GB even without its initializers (large Constant nodes?); "
            "save it with external data and pass its path"
        )
    return skeleton


def _is_in_memory(t: TensorProto) -> bool:
    return any(e.key == "location" and e.value == _IN_MEMORY for e in t.external_data)


def _check_external(model: onnx.ModelProto) -> None:
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL and not _is_in_memory(t):
            raise MixprecError(
                f"initializer {t.name!r} has external data that is not loaded; load the model "
                "with onnx.load(path) or pass its path"
            )


_IR_VERSION_ERROR = re.compile(
    r"Unsupported model IR version: (\d+), max supported IR version: (\d+)"
)


def _make_session(
    source: str | bytes,
    threads: int,
    *,
    owned: bool = False,
    optimize: bool = True,
    in_order: bool = False,
    external: Mapping[str, np.ndarray] | None = None,
) -> ort.InferenceSession:
    """Creates a CPU session.

    When ORT rejects only the model's IR version (models written by a newer onnx than
    this ORT knows), the session is retried with the IR version ORT names; that rewrites
    in-memory bytes, or a file when ``owned`` (mixprec's own temporary files), never a
    user's file.
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # Emulated models run unoptimized: ORT's fusions (e.g. LayerNormFusion) would
    # swallow the Cast round trips that carry the emulation.
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if in_order:
        # Run nodes in the given order: range probes placed after each producer then
        # free every activation right away (the default order keeps them all alive).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if external:
        names = list(external)
        so.add_external_initializers(
            names, [ort.OrtValue.ortvalue_from_numpy(external[n]) for n in names]
        )
    so.log_severity_level = 4  # errors come back as exceptions; ORT's own log stays quiet
    providers = ["CPUExecutionProvider"]
    try:
        return ort.InferenceSession(source, sess_options=so, providers=providers)
    except Exception as e:
        match = _IR_VERSION_ERROR.search(str(e))
        if match is None or not (isinstance(source, bytes) or owned):
            raise _OrtLoadError(f"onnxruntime cannot load the model: {_first_line(e)}") from e
    supported = int(match.group(2))
    logger.info(
        "model IR version %s > %d, which onnxruntime supports: lowered it for the run",
        match.group(1),
        supported,
    )
    if isinstance(source, bytes):
        proto = onnx.ModelProto.FromString(source)
        proto.ir_version = supported
        source = proto.SerializeToString()
    else:
        proto = onnx.load_model(source, load_external_data=False)
        proto.ir_version = supported
        onnx.save_model(proto, source)
    try:
        return ort.InferenceSession(source, sess_options=so, providers=providers)
    except Exception as e:
        raise _OrtLoadError(f"onnxruntime cannot load the model: {_first_line(e)}") from e


@contextlib.contextmanager
def _session_for(
    model: onnx.ModelProto, threads: int, optimize: bool = True
) -> Iterator[ort.InferenceSession]:
    """A session for an in-memory model; models over 2 GB go through a temporary dir."""
    if model.ByteSize() <= _PROTO_LIMIT:
        _check_external(model)
        yield _make_session(model.SerializeToString(), threads, optimize=optimize)
        return
    with tempfile.TemporaryDirectory(prefix="mixprec-") as tmp:
        skeleton = _external_skeleton(model, Path(tmp))
        path = Path(tmp) / "model.onnx"
        onnx.save_model(skeleton, path)
        yield _make_session(str(path), threads, owned=True, optimize=optimize)


def _bf16_from_ortvalue(value: ort.OrtValue) -> np.ndarray:
    """Copies a CPU bfloat16 OrtValue into a numpy array (``.numpy()`` cannot)."""
    nbytes = value.tensor_size_in_bytes()
    buffer = (ctypes.c_uint8 * nbytes).from_address(value.data_ptr())
    raw = np.frombuffer(bytes(buffer), dtype=np.uint16)
    return raw.view(_BF16).reshape(value.shape())


def _run_session(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None,
) -> dict[str, np.ndarray]:
    names = list(output_names) if output_names else [o.name for o in session.get_outputs()]
    out_types = {o.name: o.type for o in session.get_outputs()}
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    # ORT's numpy bridge has no bfloat16: route through OrtValues when one is involved.
    use_values = any(a.dtype == _BF16 for a in arrays.values()) or any(
        out_types.get(n) == "tensor(bfloat16)" for n in names
    )
    try:
        if not use_values:
            results = session.run(names, arrays)
            return dict(zip(names, results, strict=True))
        values = {
            k: (
                ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(a).view(np.uint16), TensorProto.BFLOAT16
                )
                if a.dtype == _BF16
                else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
            )
            for k, a in arrays.items()
        }
        outs = session.run_with_ort_values(names, values)
        return {
            n: _bf16_from_ortvalue(v) if v.element_type() == TensorProto.BFLOAT16 else v.numpy()
            for n, v in zip(names, outs, strict=True)
        }
    except Exception as e:
        raise _OrtRunError(f"onnxruntime failed to run the model: {_first_line(e)}") from e


def run_model(
    model: onnx.ModelProto | bytes | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    output_names: Sequence[str] | None = None,
    threads: int = 2,
    optimize: bool = True,
) -> dict[str, np.ndarray]:
    """Runs a model once on ONNX Runtime's CPU execution provider.

    bfloat16 inputs (``ml_dtypes.bfloat16`` arrays) and outputs are supported even though
    ORT's numpy bridge is not. A model over 2 GB is best passed as a path to a file saved
    with external data; an in-memory :class:`onnx.ModelProto` that large is first written
    to a temporary directory.

    Args:
        model: A model proto, serialized model bytes, or a path to an ``.onnx`` file.
        feeds: Input arrays by name.
        output_names: Outputs to fetch; all graph outputs when ``None``.
        threads: ORT intra-op thread count.
        optimize: ORT basic graph optimizations (off for emulated models).

    Returns:
        The output arrays by name.

    Raises:
        MixprecError: ORT cannot load the model, or fails to run it.
    """
    if isinstance(model, onnx.ModelProto):
        with _session_for(model, threads, optimize) as session:
            return _run_session(session, feeds, output_names)
    source = bytes(model) if isinstance(model, bytes | bytearray) else os.fspath(model)
    session = _make_session(source, threads, optimize=optimize)
    return _run_session(session, feeds, output_names)


# --------------------------------------------------------------------------- ranges


def _absmax(array: Any) -> float | None:
    """``max(|x|)`` over finite values; ``inf`` when the tensor has an inf; None if not float."""
    a = np.asarray(array)
    if not _is_float_dtype(a.dtype):
        return None
    if a.size == 0:
        return 0.0
    if a.dtype not in (np.float32, np.float64):
        a = a.astype(np.float32)
    hi = float(a.max())
    lo = float(a.min())
    if not (math.isnan(hi) or math.isnan(lo)):
        return max(abs(hi), abs(lo))
    if np.isinf(a).any():
        return math.inf
    finite = a[np.isfinite(a)]
    return float(np.abs(finite).max()) if finite.size else 0.0


def _tensor_absmax(t: onnx.TensorProto) -> float | None:
    if t.data_type not in _FLOAT_TYPES:
        return None
    try:
        return _absmax(numpy_helper.to_array(t))
    except Exception as e:
        logger.debug("range analysis: cannot read tensor %r: %s", t.name, _first_line(e))
        return None


def _constant_absmax(node: onnx.NodeProto) -> float | None:
    for attr in node.attribute:
        if attr.name == "value":
            return _tensor_absmax(attr.t)
        if attr.name == "value_float":
            return abs(float(attr.f))
        if attr.name == "value_floats":
            return _absmax(np.asarray(attr.floats, dtype=np.float32))
        if attr.name == "sparse_value":
            return _tensor_absmax(attr.sparse_tensor.values)
    return None


def _static_absmax(graph: onnx.GraphProto, result: dict[str, float]) -> None:
    """Absmax of initializers and Constant nodes of ``graph`` and all its subgraphs."""
    for sub in _iter_graphs(graph):
        for t in sub.initializer:
            value = _tensor_absmax(t)
            if value is not None:
                result[t.name] = value
        for sparse in sub.sparse_initializer:
            value = _tensor_absmax(sparse.values)
            if value is not None:
                result[sparse.values.name] = value
        for node in sub.node:
            if node.op_type == "Constant" and node.domain in _STANDARD_DOMAINS and node.output:
                value = _constant_absmax(node)
                if value is not None:
                    result[node.output[0]] = value


class _VariantRunner:
    """Runs copies of one model that differ only in their graph outputs."""

    def __init__(
        self,
        model: onnx.ModelProto,
        feeds: Mapping[str, np.ndarray],
        threads: int,
        external: Mapping[str, np.ndarray] | None = None,
    ):
        self._external = external
        # ``model`` is not modified: outputs are swapped on a private copy, or, over the
        # protobuf limit, on a skeleton whose initializers live in a temporary file.
        self._original_outputs = [_copy_vi(vi) for vi in model.graph.output]
        self._feeds = feeds
        self._threads = threads
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        if model.ByteSize() > _PROTO_LIMIT:
            self._dir = tempfile.TemporaryDirectory(prefix="mixprec-")
            try:
                self._model = _external_skeleton(model, Path(self._dir.name))
            except BaseException:
                self.close()
                raise
        else:
            _check_external(model)
            # No copy: ``run`` swaps the outputs and restores them before returning.
            self._model = model

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def run(self, outputs: Sequence[onnx.ValueInfoProto]) -> dict[str, np.ndarray]:
        graph = self._model.graph
        del graph.output[:]
        graph.output.extend(outputs)
        try:
            if self._dir is None:
                source: str | bytes = self._model.SerializeToString()
            else:
                path = Path(self._dir.name) / "variant.onnx"
                onnx.save_model(self._model, path)
                source = str(path)
        finally:
            del graph.output[:]
            graph.output.extend(self._original_outputs)
        session = _make_session(
            source, self._threads, owned=self._dir is not None, external=self._external
        )
        return _run_session(session, self._feeds, [vi.name for vi in outputs])


def _copy_vi(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    return out


def _record(
    outs: dict[str, np.ndarray],
    result: dict[str, float],
    shapes: dict[str, list[int]] | None = None,
) -> None:
    """Reduces each array to its absmax (and shape) and drops it right away."""
    for name in list(outs):
        array = outs.pop(name)
        if shapes is not None and hasattr(array, "shape"):
            shapes[name] = [int(d) for d in array.shape]
        value = _absmax(array)
        if value is not None:
            result[name] = value


def _run_chunk(
    runner: _VariantRunner,
    items: list[tuple[str, int]],
    result: dict[str, float],
    depth: int = 0,
    shapes: dict[str, list[int]] | None = None,
) -> None:
    outputs = [helper.make_tensor_value_info(n, et, None) for n, et in items]
    try:
        outs = runner.run(outputs)
    except MixprecError as e:
        if len(items) == 1 or depth >= _MAX_BISECT_DEPTH:
            shown = ", ".join(repr(n) for n, _ in items[:3]) + (", ..." if len(items) > 3 else "")
            logger.warning("range analysis skipped %d tensor(s) (%s): %s", len(items), shown, e)
            return
        mid = len(items) // 2
        _run_chunk(runner, items[:mid], result, depth + 1, shapes)
        _run_chunk(runner, items[mid:], result, depth + 1, shapes)
        return
    _record(outs, result, shapes)


def _absmax_in_graph(
    model: onnx.ModelProto,
    candidates: list[tuple[str, int]],
    feeds: Mapping[str, np.ndarray],
    threads: int,
    shapes_out: dict[str, list[int]] | None,
    external: Mapping[str, np.ndarray] | None = None,
) -> dict[str, float] | None:
    """One run of the model with ``ReduceMax(Abs(t))`` and ``Shape(t)`` outputs per tensor.

    ONNX Runtime computes the reductions itself, so no full-size intermediate leaves the
    session and its memory planner can reuse activation buffers: peak memory stays near a
    plain inference run. Returns None when the augmented model fails (the caller then
    falls back to fetching tensors in chunks).
    """
    # Built through onnx_ir, which shares the weight bytes with ``model`` (no copy) and
    # places each probe right after the tensor's producer, so the tensor can be freed
    # as soon as it is measured (ONNX Runtime keeps the given node order).
    work = ir.from_proto(model)
    by_name = {v.name: v for n in work.graph for v in n.outputs if v.name}
    names: list[tuple[str, str, str]] = []
    for k, (name, elem) in enumerate(candidates):
        value = by_name.get(name)
        producer = value.producer() if value is not None else None
        if value is None or producer is None:
            continue
        absolute = ir.Value(name=f"__mp_abs_{k}")
        peak = ir.Value(name=f"__mp_max_{k}", type=ir.TensorType(ir.DataType(elem)))
        peak.shape = ir.Shape([])
        shape = ir.Value(name=f"__mp_shape_{k}", type=ir.TensorType(ir.DataType.INT64))
        probes = [
            ir.Node("", "Abs", [value], outputs=[absolute], name=absolute.name),
            ir.Node(
                "",
                "ReduceMax",
                [absolute],
                attributes=[ir.AttrInt64("keepdims", 0)],
                outputs=[peak],
                name=peak.name,
            ),
            ir.Node("", "Shape", [value], outputs=[shape], name=shape.name),
        ]
        work.graph.insert_after(producer, probes)
        work.graph.outputs.extend([peak, shape])
        names.append((name, peak.name or "", shape.name or ""))
    augmented, detached = weightless_proto(work)  # ORT parses no weight bytes
    del work, by_name
    detached.update(external or {})
    source = augmented.SerializeToString()
    del augmented
    try:
        session = _make_session(source, threads, in_order=True, external=detached)
        del source
        wanted = [o for _, peak, shape in names for o in (peak, shape)]
        outs = _run_session(session, _feeds_for(model, feeds), wanted)
    except MixprecError as e:
        logger.debug("range analysis in-graph reduction failed (%s); fetching tensors", e)
        return None
    result: dict[str, float] = {}
    for tensor_name, peak_name, shape_name in names:
        measured = float(np.asarray(outs[peak_name], dtype=np.float64))
        if math.isnan(measured):
            continue  # ReduceMax propagates NaN: the caller measures it by fetching
        result[tensor_name] = measured
        if shapes_out is not None:
            dims = np.asarray(outs[shape_name]).reshape(-1)
            shapes_out[tensor_name] = [int(d) for d in dims]
    return result


def collect_absmax(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    chunk_size: int = 2000,
    threads: int = 2,
    shapes_out: dict[str, list[int]] | None = None,
    external: Mapping[str, np.ndarray] | None = None,
) -> dict[str, float]:
    """Range analysis: ``max(|x|)`` of every floating-point tensor of the FP32 model.

    Every float-typed node output of the main graph (types from ONNX shape inference) is
    exposed as an extra graph output, ``chunk_size`` at a time, and each fetched array
    is reduced to one float right away. Graph inputs are measured from ``feeds``;
    initializers and Constant nodes, including those inside If/Loop/Scan bodies, from
    their data. Other values inside subgraphs cannot be fetched and are not recorded,
    nor are values whose type shape inference cannot tell.

    The absmax is taken over finite values; a tensor holding an inf gets ``math.inf``.
    If a chunk of extra outputs fails in ONNX Runtime it is bisected, and tensors that
    still fail are skipped with a warning: range collection never fails a conversion
    unless the model itself cannot run.

    Args:
        model: The FP32 model (not modified).
        feeds: Input arrays by name.
        chunk_size: Most extra outputs fetched per ORT session, to bound memory.
        threads: ORT intra-op thread count.
        shapes_out: when given, filled with the observed shape of every fetched tensor.
        external: arrays of initializers that ``model`` holds as in-memory placeholders
            (see :func:`weightless_proto`).

    Returns:
        Absmax by tensor name.

    Raises:
        MixprecError: The model itself cannot be loaded or run.
    """
    if chunk_size < 1:
        raise MixprecError(f"chunk size must be a positive integer, got {chunk_size}")
    m = model  # only read here; _VariantRunner makes the copy it edits
    result: dict[str, float] = {}
    for vi in _graph_inputs(m):
        if vi.name in feeds:
            value = _absmax(feeds[vi.name])
            if value is not None:
                result[vi.name] = value
    _static_absmax(m.graph, result)
    for name, array in (external or {}).items():
        measured = _absmax(array)
        if measured is not None:
            result[name] = measured

    types = _value_types(m.graph)
    produced = [o for n in m.graph.node for o in n.output if o]
    inferred = None if all(o in types for o in produced) else _infer(m)
    if inferred is not None:
        types.update(_value_types(inferred.graph))
    elems = _elem_types(m.graph, types)

    output_names = {vi.name for vi in m.graph.output}
    candidates: list[tuple[str, int]] = []
    unknown: list[str] = []
    seen: set[str] = set()
    for node in m.graph.node:
        if node.op_type == "Constant" and node.domain in _STANDARD_DOMAINS:
            continue
        for name in node.output:
            if not name or name in seen or name in output_names or name in result:
                continue
            seen.add(name)
            elem = elems.get(name)
            if elem is None:
                unknown.append(name)
            elif elem in _FLOAT_TYPES:
                candidates.append((name, elem))
    if unknown:
        logger.debug("range analysis: %d value(s) of unknown type skipped", len(unknown))

    if candidates and m.ByteSize() <= _PROTO_LIMIT:
        graph_outputs = [
            (vi.name, vi.type.tensor_type.elem_type)
            for vi in m.graph.output
            if vi.type.tensor_type.elem_type in _FLOAT_TYPES and vi.name not in result
        ]
        probes = candidates + graph_outputs
        reduced = _absmax_in_graph(m, probes, feeds, threads, shapes_out, external)
        if reduced is not None:
            result.update(reduced)
            # Tensors holding NaN: absmax over their finite values, fetched below.
            candidates = [c for c in probes if c[0] not in result]
            if not candidates:
                return result

    chunks = [candidates[i : i + chunk_size] for i in range(0, len(candidates), chunk_size)]
    runner = _VariantRunner(m, feeds, threads, external)
    try:
        first = chunks.pop(0) if chunks else []
        originals = list(runner._original_outputs)
        extra = [helper.make_tensor_value_info(n, et, None) for n, et in first]
        try:
            outs = runner.run([*originals, *extra])
        except MixprecError as e:
            if not first:
                raise
            logger.debug("range analysis: first chunk failed (%s); checking the plain model", e)
            outs = runner.run(originals)  # raises when the model itself cannot run
            chunks.insert(0, first)
        _record(outs, result, shapes_out)
        for chunk in chunks:
            _run_chunk(runner, chunk, result, shapes=shapes_out)
    finally:
        runner.close()
    return result


# --------------------------------------------------------------------------- comparison


def _json_float(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return str(value)


@dataclass(frozen=True)
class OutputComparison:
    """How one output of a converted model compares with the FP32 reference.

    Attributes:
        name: Output name.
        max_abs_error: ``max |out - ref|`` over positions where both are finite.
        rel_l2_error: ``||out - ref||_2 / max(||ref||_2, tiny)`` over the same positions.
        ref_abs_max: ``max |ref|`` over finite reference values.
        top1_agreement: Fraction of rows whose argmax over the last axis agrees, for
            outputs that look like class scores (float, rank 2 or 3, last dim in
            ``[2, 100000]``); ``None`` otherwise. Reported only; it does not affect
            ``passed``.
        passed: ``rel_l2_error <= rtol or max_abs_error <= atol``, no non-finite value
            where the reference is finite, and matching shapes.
        note: Why a comparison failed or was limited, or empty.
    """

    name: str
    max_abs_error: float
    rel_l2_error: float
    ref_abs_max: float
    top1_agreement: float | None
    passed: bool
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict; non-finite floats become the strings ``"inf"``/``"nan"``."""
        out: dict[str, object] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = _json_float(value) if isinstance(value, float) else value
        return out


def _compare_one(
    name: str, ref: np.ndarray, out: np.ndarray, rtol: float, atol: float
) -> OutputComparison:
    if ref.dtype == object or out.dtype == object:
        return OutputComparison(name, 0.0, 0.0, 0.0, None, True, "not a tensor; not compared")
    ref_float = _is_float_dtype(ref.dtype)
    numeric = ref_float or ref.dtype.kind in "iub"
    a = ref.astype(np.float64) if numeric else ref
    finite_ref = a[np.isfinite(a)] if ref_float else a
    ref_abs_max = float(np.abs(finite_ref).max()) if numeric and finite_ref.size else 0.0
    if ref.shape != out.shape:
        note = f"shape {list(out.shape)} differs from the reference shape {list(ref.shape)}"
        return OutputComparison(name, math.inf, math.inf, ref_abs_max, None, False, note)
    if not ref_float or not _is_float_dtype(out.dtype):
        equal = bool(np.array_equal(ref, out))
        diff = (
            0.0
            if equal or not numeric or out.dtype.kind not in "iubf"
            else float(np.abs(a - out.astype(np.float64)).max(initial=0.0))
        )
        note = "" if equal else "non-float output differs from the reference"
        return OutputComparison(name, diff, 0.0 if equal else 1.0, ref_abs_max, None, equal, note)

    b = out.astype(np.float64)
    fin_a = np.isfinite(a)
    fin_b = np.isfinite(b)
    notes: list[str] = []
    bad = int(np.count_nonzero(fin_a & ~fin_b))
    if bad:
        notes.append(f"{bad} non-finite value(s) where the reference is finite")
    ref_nonfinite = int(a.size - np.count_nonzero(fin_a))
    if ref_nonfinite:
        notes.append(f"{ref_nonfinite} non-finite reference value(s) not compared")
    mask = fin_a & fin_b
    diff = b[mask] - a[mask]
    max_abs = float(np.abs(diff).max()) if diff.size else 0.0
    ref_norm = float(np.linalg.norm(a[mask])) if diff.size else 0.0
    rel = float(np.linalg.norm(diff)) / max(ref_norm, float(np.finfo(np.float64).tiny))
    top1: float | None = None
    if 2 <= a.ndim <= 3 and 2 <= a.shape[-1] <= 100_000 and a.size:
        top1 = float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
    passed = (rel <= rtol or max_abs <= atol) and not bad
    return OutputComparison(name, max_abs, rel, ref_abs_max, top1, passed, "; ".join(notes))


def compare_outputs(
    ref: Mapping[str, np.ndarray],
    out: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float = 1e-3,
) -> list[OutputComparison]:
    """Compares converted-model outputs with reference outputs, in float64.

    An output passes when its relative L2 error is at most ``rtol`` or its max absolute
    error is at most ``atol`` (the latter for references near zero), and it has no
    non-finite value where the reference is finite. Non-float outputs must be equal.

    Args:
        ref: Reference (FP32) outputs by name; every one of them is compared.
        out: Converted-model outputs by name.
        rtol: Relative L2 tolerance.
        atol: Absolute tolerance.

    Returns:
        One comparison per reference output, in ``ref`` order.
    """
    results: list[OutputComparison] = []
    for name, ref_value in ref.items():
        if name not in out:
            note = "missing from the converted model's outputs"
            results.append(OutputComparison(name, math.inf, math.inf, 0.0, None, False, note))
            continue
        results.append(_compare_one(name, np.asarray(ref_value), np.asarray(out[name]), rtol, atol))
    return results


# --------------------------------------------------------------------------- emulation


def _upcast_tensor(t: onnx.TensorProto) -> None:
    """Turns a float16/bfloat16 tensor into the float32 tensor of exactly the same values."""
    try:
        values = numpy_helper.to_array(t).astype(np.float32)
    except Exception as e:
        raise MixprecError(f"cannot read low-precision tensor {t.name!r}: {_first_line(e)}") from e
    new = numpy_helper.from_array(values, name=t.name)
    new.doc_string = t.doc_string
    t.CopyFrom(new)


def _retype(tp: onnx.TypeProto) -> None:
    """Replaces float16/bfloat16 element types anywhere in ``tp`` with float32."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        if tp.tensor_type.elem_type in _LOW_TYPES:
            tp.tensor_type.elem_type = TensorProto.FLOAT
    elif kind == "sparse_tensor_type":
        if tp.sparse_tensor_type.elem_type in _LOW_TYPES:
            tp.sparse_tensor_type.elem_type = TensorProto.FLOAT
    elif kind == "sequence_type":
        _retype(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        _retype(tp.optional_type.elem_type)
    elif kind == "map_type":
        _retype(tp.map_type.value_type)


def _all_names(model: onnx.ModelProto) -> set[str]:
    names: set[str] = set()
    for graph in _iter_graphs(model.graph):
        names.update(vi.name for vi in [*graph.input, *graph.output, *graph.value_info])
        names.update(_initializer_names(graph))
        for node in graph.node:
            names.update(node.input)
            names.update(node.output)
            names.add(node.name)
    return names


class _Namer:
    def __init__(self, used: set[str]):
        self._used = used

    def __call__(self, base: str) -> str:
        name, i = base, 0
        while name in self._used:
            i += 1
            name = f"{base}_{i}"
        self._used.add(name)
        return name


def _low_outputs(node: onnx.NodeProto, elems: Mapping[str, int]) -> list[tuple[int, int]]:
    """(index, low elem type) of each float16/bfloat16 output of ``node``."""
    found: list[tuple[int, int]] = []
    for i, name in enumerate(node.output):
        elem = elems.get(name) if name else None
        if elem is not None and elem in _LOW_TYPES:
            found.append((i, elem))
    return found


def _round_trip(src: str, dst: str, low: int, namer: _Namer) -> list[onnx.NodeProto]:
    """``dst = Cast(Cast(src, to=low), to=FLOAT)``: ``src`` rounded through ``low``."""
    mid = namer(f"{dst}__mixprec_{_LOW_NAMES[low]}")
    return [
        helper.make_node("Cast", [src], [mid], name=namer(f"{mid}__cast"), to=low),
        helper.make_node(
            "Cast", [mid], [dst], name=namer(f"{dst}__mixprec_fp32__cast"), to=TensorProto.FLOAT
        ),
    ]


def _upcast_attributes(node: onnx.NodeProto) -> None:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _LOW_TYPES:
            _upcast_tensor(attr.t)
        elif attr.type == onnx.AttributeProto.TENSORS:
            for t in attr.tensors:
                if t.data_type in _LOW_TYPES:
                    _upcast_tensor(t)
        elif attr.type == onnx.AttributeProto.SPARSE_TENSOR:
            if attr.sparse_tensor.values.data_type in _LOW_TYPES:
                _upcast_tensor(attr.sparse_tensor.values)
        elif attr.type == onnx.AttributeProto.SPARSE_TENSORS:
            for st in attr.sparse_tensors:
                if st.values.data_type in _LOW_TYPES:
                    _upcast_tensor(st.values)
        elif attr.type == onnx.AttributeProto.TYPE_PROTO:
            _retype(attr.tp)
        elif attr.type == onnx.AttributeProto.TYPE_PROTOS:
            for tp in attr.type_protos:
                _retype(tp)
        elif (
            attr.type == onnx.AttributeProto.INT
            and attr.name in _DTYPE_ATTRS
            and node.domain in _STANDARD_DOMAINS
            and attr.i in _LOW_TYPES
        ):
            attr.i = TensorProto.FLOAT


def _emulate_graph(
    graph: onnx.GraphProto,
    type_maps: Iterator[dict[str, onnx.TypeProto]],
    namer: _Namer,
) -> None:
    """Rewrites ``graph`` and its subgraphs in place (see :func:`emulate_low_precision`)."""
    elems = _elem_types(graph, next(type_maps))
    for t in graph.initializer:
        if t.data_type in _LOW_TYPES:
            _upcast_tensor(t)
    for sparse in graph.sparse_initializer:
        if sparse.values.data_type in _LOW_TYPES:
            _upcast_tensor(sparse.values)
    for vi in [*graph.input, *graph.output, *graph.value_info]:
        _retype(vi.type)

    new_nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        low = _low_outputs(node, elems)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                _emulate_graph(attr.g, type_maps, namer)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    _emulate_graph(sub, type_maps, namer)
        _upcast_attributes(node)
        extra: list[onnx.NodeProto] = []
        for index, low_type in low:
            name = node.output[index]
            raw = namer(f"{name}__mixprec_raw")
            node.output[index] = raw
            extra.extend(_round_trip(raw, name, low_type, namer))
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        new_nodes.append(copy)
        new_nodes.extend(extra)
        changed = changed or bool(extra)
    if changed:
        del graph.node[:]
        graph.node.extend(new_nodes)


def _rename_uses(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> None:
    """Renames uses of values (node inputs, subgraph outputs) in ``graph`` and subgraphs."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in mapping:
                node.input[i] = mapping[name]
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                for vi in sub.output:
                    if vi.name in mapping:
                        vi.name = mapping[vi.name]
                _rename_uses(sub, mapping)


def emulate_low_precision(converted: onnx.ModelProto) -> onnx.ModelProto:
    """An FP32 model that reproduces the rounding of a float16/bfloat16 model.

    Every float16/bfloat16 tensor of ``converted`` becomes a float32 tensor rounded
    through its low dtype:

    * low initializers and Constant tensors become float32 tensors of the same values;
    * each node output typed low is renamed, computed in float32, and followed by
      ``Cast(to=LOW) -> Cast(to=FLOAT)`` that produces the original name, so consumers
      and graph outputs see the rounded value (low graph outputs become float32);
    * ``Cast(to=LOW)`` becomes ``Cast(to=FLOAT)`` plus that round trip;
    * low graph inputs become float32 inputs followed by the round trip, so they must
      then be fed as float32;
    * If/Loop/Scan bodies are handled the same way, recursively; their low inputs and
      outputs become float32 (rounding happens at the producers).

    Value types come from ONNX shape inference; a node output whose type it cannot tell
    (some custom-domain ops) is computed in float32 without rounding. Model-local
    functions are inlined first. ORT's Cast to bfloat16 rounds to nearest even,
    bit-exact with ``ml_dtypes.bfloat16``.

    Args:
        converted: A mixed-precision model (not modified).

    Returns:
        The FP32 emulation model.

    Raises:
        MixprecError: A low-precision tensor's data cannot be read (external data not
            loaded).
    """
    m = _copy_model(converted)
    if len(m.functions):
        m = onnx.inliner.inline_local_functions(m)
    namer = _Namer(_all_names(m))

    own_maps = [_value_types(g) for g in _iter_graphs(m.graph)]
    inferred = _infer(m)
    type_maps = own_maps
    if inferred is not None:
        inferred_maps = [_value_types(g) for g in _iter_graphs(inferred.graph)]
        if len(inferred_maps) == len(own_maps):
            type_maps = [{**own, **inf} for own, inf in zip(own_maps, inferred_maps, strict=True)]
        else:
            logger.warning("shape inference changed the graph structure; using declared types")

    low_inputs = [
        (vi.name, int(vi.type.tensor_type.elem_type))
        for vi in _graph_inputs(m)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type in _LOW_TYPES
    ]
    _emulate_graph(m.graph, iter(type_maps), namer)

    if low_inputs:
        mapping = {name: namer(f"{name}__mixprec_rounded") for name, _ in low_inputs}
        _rename_uses(m.graph, mapping)
        front: list[onnx.NodeProto] = []
        for name, low in low_inputs:
            front.extend(_round_trip(name, mapping[name], low, namer))
        nodes = [*front, *(_clone_node(n) for n in m.graph.node)]
        del m.graph.node[:]
        m.graph.node.extend(nodes)
    return m


def _clone_node(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


# --------------------------------------------------------------------------- validation


def _detect_low_dtype(model: onnx.ModelProto) -> str:
    """``"bfloat16"`` if the model has any bfloat16 tensor, else ``"float16"`` if it has
    any float16 tensor, else ``"none"``."""
    found: set[int] = set()

    def visit_type(tp: onnx.TypeProto) -> None:
        kind = tp.WhichOneof("value")
        if kind == "tensor_type":
            found.add(int(tp.tensor_type.elem_type))
        elif kind == "sequence_type":
            visit_type(tp.sequence_type.elem_type)
        elif kind == "optional_type":
            visit_type(tp.optional_type.elem_type)

    for graph in _iter_graphs(model.graph):
        found.update(int(t.data_type) for t in graph.initializer)
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            visit_type(vi.type)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    found.add(int(attr.t.data_type))
                elif attr.type == onnx.AttributeProto.INT and attr.name in _DTYPE_ATTRS:
                    found.add(int(attr.i))
    if TensorProto.BFLOAT16 in found:
        return "bfloat16"
    if TensorProto.FLOAT16 in found:
        return "float16"
    return "none"


@dataclass(frozen=True)
class ValidationReport:
    """Result of :func:`validate_models`.

    Attributes:
        kind: ``"onnxruntime"`` (the converted model ran as is) or ``"emulated"`` (its
            FP32 emulation from :func:`emulate_low_precision` ran).
        low_dtype: ``"float16"``, ``"bfloat16"`` or ``"none"``.
        rtol: Relative L2 tolerance used.
        atol: Absolute tolerance used.
        outputs: One comparison per reference output.
        fallback_reason: Why ``auto`` mode fell back to emulation, or empty.
    """

    kind: str
    low_dtype: str
    rtol: float
    atol: float
    outputs: tuple[OutputComparison, ...]
    fallback_reason: str = ""

    @property
    def passed(self) -> bool:
        """Whether every output passed."""
        return all(o.passed for o in self.outputs)

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the report."""
        return {
            "kind": self.kind,
            "low_dtype": self.low_dtype,
            "rtol": self.rtol,
            "atol": self.atol,
            "passed": self.passed,
            "fallback_reason": self.fallback_reason,
            "outputs": [o.to_dict() for o in self.outputs],
        }

    def format_table(self) -> str:
        """A readable, aligned text table of the comparisons and the verdict."""
        header = ("output", "max abs err", "rel L2", "top-1", "ok")
        rows = [header]
        for o in self.outputs:
            top1 = "-" if o.top1_agreement is None else f"{100.0 * o.top1_agreement:.1f}%"
            ok = "yes" if o.passed else "NO"
            rows.append((o.name, f"{o.max_abs_error:.3g}", f"{o.rel_l2_error:.3g}", top1, ok))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for o in self.outputs:
            if o.note:
                lines.append(f"note: {o.name}: {o.note}")
        how = "ONNX Runtime" if self.kind == "onnxruntime" else "FP32 emulation"
        verdict = "PASSED" if self.passed else "FAILED"
        lines.append(
            f"{verdict}: {self.low_dtype} model checked with {how}, "
            f"rtol {self.rtol:g}, atol {self.atol:g}"
        )
        if self.fallback_reason:
            lines.append(f"fallback: {self.fallback_reason}")
        return "\n".join(lines)


def validate_models(
    original: onnx.ModelProto,
    converted: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    *,
    rtol: float | None = None,
    atol: float = 1e-3,
    mode: str = "auto",
    threads: int = 2,
) -> ValidationReport:
    """Runs both models on the same inputs and compares their outputs.

    Modes: ``"ort"`` runs the converted model on ONNX Runtime as is; ``"emulated"``
    runs :func:`emulate_low_precision` of it; ``"auto"`` tries ``"ort"`` and falls back
    to ``"emulated"`` when ORT cannot load or run the converted model (typically a
    bfloat16 model: ORT's CPU provider has no bfloat16 MatMul/Add kernels). Feeds are
    cast to each model's declared input dtypes.

    Args:
        original: The FP32 reference model.
        converted: The mixed-precision model.
        feeds: Input arrays by name (for the original model).
        rtol: Relative L2 tolerance; default :data:`DEFAULT_RTOL` for the detected low
            dtype (1e-4 when the converted model has none).
        atol: Absolute tolerance, for outputs near zero.
        mode: ``"auto"``, ``"ort"`` or ``"emulated"``.
        threads: ORT intra-op thread count.

    Returns:
        The report; ``report.passed`` tells whether every output is within tolerance.

    Raises:
        MixprecError: An unknown mode, the original model cannot run, or (mode ``"ort"``
            or after emulation) the converted model cannot run.
    """
    if mode not in ("auto", "ort", "emulated"):
        raise MixprecError(f"unknown validation mode {mode!r}; use auto, ort or emulated")
    low_dtype = _detect_low_dtype(converted)
    tol = rtol if rtol is not None else DEFAULT_RTOL.get(low_dtype, _NO_LOW_RTOL)
    reference = run_model(original, _feeds_for(original, feeds), threads=threads)

    result: dict[str, np.ndarray] | None = None
    kind = "onnxruntime"
    fallback = ""
    if mode in ("auto", "ort"):
        try:
            result = run_model(converted, _feeds_for(converted, feeds), threads=threads)
        except (_OrtLoadError, _OrtRunError) as e:
            if mode == "ort":
                raise
            fallback = f"{e}; emulated the {low_dtype} model in float32 instead"
            logger.info("validation falls back to emulation: %s", e)
    if result is None:
        kind = "emulated"
        emulated = emulate_low_precision(converted)
        result = run_model(emulated, _feeds_for(emulated, feeds), threads=threads, optimize=False)
    comparisons = compare_outputs(reference, result, rtol=tol, atol=atol)
    return ValidationReport(kind, low_dtype, tol, atol, tuple(comparisons), fallback)
