"""Model inputs: concrete input shapes, generated feeds, ``.npz`` files, calibration streams.

* :func:`resolve_input_shapes` is the one rule for symbolic input dims, used by
  ``convert``, ``validate`` and :func:`make_inputs`: a user shape wins; else declared dims;
  a symbolic first dim (batch) becomes 1 and any other symbolic dim
  :data:`DEFAULT_SYMBOLIC_DIM`, each with a note saying so.
* :func:`make_inputs` generates one seeded feed dict from the signature.
* :func:`load_inputs_npz` reads one feed dict from an ``.npz`` file;
  :func:`iter_calibration_npz` streams many (a leading sample axis, or a folder).
* :func:`calibration_feeds` normalizes the forms ``calibration_data`` can take.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import FLOAT_TYPES
from mixprec.io.bounds import LENGTH_STEPS, length_bounds, next_step

__all__ = [
    "DEFAULT_SYMBOLIC_DIM",
    "calibration_feeds",
    "feeds_for",
    "guessed_dims",
    "iter_calibration_npz",
    "load_inputs_npz",
    "make_inputs",
    "resolve_input_shapes",
]

logger = logging.getLogger(__name__)

#: Symbolic dims without a user shape: a batch-like dim gets 1, others this value (or
#: the first of :data:`~mixprec.io.bounds.LENGTH_STEPS` above what the ops need).
DEFAULT_SYMBOLIC_DIM = LENGTH_STEPS[0]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_INDEX_PASSTHROUGH = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity"})

ModelArg = onnx.ModelProto | ir.Model
Feeds = Mapping[str, np.ndarray]


def as_ir(model: ModelArg) -> ir.Model:
    """``model`` as an ``onnx_ir.Model`` (a proto is wrapped; weight bytes are shared)."""
    return model if isinstance(model, ir.Model) else ir.from_proto(model)


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error message, at most 400 characters."""
    for line in str(error).splitlines():
        if line.strip():
            text = line.strip()
            return text if len(text) <= 400 else text[:397] + "..."
    return type(error).__name__


def graph_inputs(model: ir.Model) -> list[ir.Value]:
    """Graph inputs a caller must feed (those that are not also initializers)."""
    inits = model.graph.initializers
    return [v for v in model.graph.inputs if v.name not in inits]


def _dtype_of(value: ir.Value) -> ir.DataType:
    if not isinstance(value.type, ir.TensorType):
        kind = type(value.type).__name__ if value.type is not None else "value of unknown type"
        raise MixprecError(f"input {value.name!r} is a {kind}, not a tensor; mixprec needs tensors")
    return value.type.dtype


def _is_float_dtype(dtype: np.dtype[Any]) -> bool:
    return dtype.kind == "f" or dtype == _BF16


def _declared_dims(value: ir.Value) -> list[int | str | None] | None:
    if value.shape is None:
        return None
    dims: list[int | str | None] = []
    for d in value.shape.dims:
        if isinstance(d, int) and d > 0:
            dims.append(d)
        elif isinstance(d, ir.SymbolicDim) and d.value:
            dims.append(d.value)
        else:
            dims.append(None)
    return dims


def _fmt_dims(dims: Sequence[int | str | None]) -> str:
    return "[" + ",".join("?" if d is None else str(d) for d in dims) + "]"


def _check_override(name: str, declared: list[int | str | None] | None, dims: list[int]) -> None:
    if any(d < 0 for d in dims):
        raise MixprecError(f"--shape for input {name!r} has a negative dim: {dims}")
    if declared is None:
        return
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


def resolve_input_shapes(
    model: ModelArg, shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[dict[str, list[int]], list[str]]:
    """Concrete shapes of the graph inputs: the one rule for symbolic dims.

    A shape in ``shapes`` wins (checked against the declared rank and fixed dims).
    Otherwise the declared dims are used; a symbolic or unknown first dim becomes 1 and
    any other one :data:`DEFAULT_SYMBOLIC_DIM`, with one note per dim. Inputs of unknown
    rank and non-tensor inputs get no entry (a note names the former).

    Args:
        model: The model (proto or ``onnx_ir``).
        shapes: Full shapes by input name (``--shape``).

    Returns:
        ``(shapes, notes)``: concrete dims by input name, and notes on each default used.

    Raises:
        MixprecError: ``shapes`` names a value that is not a graph input, or disagrees
            with the declared rank or a fixed dim.

    Example:
        >>> resolve_input_shapes(model)                          # doctest: +SKIP
        ({'x': [1, 3, 64, 64]}, ["input 'x' dim 2 (H) is symbolic: used 64 ..."])
    """
    m = as_ir(model)
    inputs = graph_inputs(m)
    given = {k: [int(d) for d in v] for k, v in (shapes or {}).items()}
    names = [v.name or "" for v in inputs]
    for name in given:
        if name not in names:
            raise MixprecError(
                f"--shape names {name!r}, which is not a graph input "
                f"(inputs: {', '.join(names) or 'none'})"
            )
    out: dict[str, list[int]] = {}
    notes: list[str] = []
    symbols: dict[str, int] = {}  # a named dim takes one value in every input
    bounds = length_bounds(m)
    for value in inputs:
        name = value.name or ""
        declared = _declared_dims(value)
        if name in given:
            _check_override(name, declared, given[name])
            out[name] = given[name]
            symbols.update(_symbols(declared, given[name]))
            continue
        if not isinstance(value.type, ir.TensorType):
            continue
        if declared is None:
            notes.append(f"input {name!r} has unknown rank: give --shape {name}=D0,D1,...")
            continue
        out[name] = _guess(name, declared, symbols, notes, bounds)
    return out, notes


def _symbols(declared: list[int | str | None] | None, dims: list[int]) -> dict[str, int]:
    return {d: v for d, v in zip(declared or [], dims, strict=False) if isinstance(d, str) and d}


def _guess(
    name: str,
    declared: list[int | str | None],
    symbols: dict[str, int],
    notes: list[str],
    bounds: Mapping[tuple[str, int], tuple[int, str]],
) -> list[int]:
    """Concrete dims for one input: a symbol already decided keeps its value; otherwise a
    batch-like dim is 1 (dim 0, or the one symbolic dim between fixed ones, as the batch
    of a recurrent state ``[2, B, 128]``) and any other :data:`DEFAULT_SYMBOLIC_DIM`."""
    concrete: list[int] = []
    symbolic = [k for k, d in enumerate(declared) if not isinstance(d, int)]
    inner = len(symbolic) == 1 and 0 < symbolic[0] < len(declared) - 1
    for k, d in enumerate(declared):
        if isinstance(d, int):
            concrete.append(d)
            continue
        if d and d in symbols:
            used, why = symbols[d], f"as {d!r} elsewhere"
        else:
            batch = k == 0 or inner
            used, why = (1 if batch else DEFAULT_SYMBOLIC_DIM), "give --shape to choose"
            least, reason = bounds.get((name, k), (0, ""))
            if not batch and least > used:
                used = next_step(least)
                why = f"at least {least}: {reason}; give --shape to choose"
            if d:
                symbols[d] = used
        notes.append(f"input {name!r} dim {k} ({d or '?'}) is symbolic: used {used} ({why})")
        concrete.append(used)
    return concrete


def guessed_dims(
    model: ModelArg, shapes: Mapping[str, Sequence[int]] | None = None
) -> dict[tuple[str, int], str]:
    """``{(input, axis): label}`` of the dims :func:`resolve_input_shapes` guesses: the
    symbolic dims of the inputs not given in ``shapes``."""
    found = {}
    for value in graph_inputs(as_ir(model)):
        name = value.name or ""
        declared = _declared_dims(value)
        if name in (shapes or {}) or declared is None:
            continue
        for k, d in enumerate(declared):
            if not isinstance(d, int):
                found[(name, k)] = d or "?"
    return found


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


def _const_dims(value: ir.Value) -> list[int] | None:
    """Dims of a constant (initializer or Constant node output), else None."""
    if value.const_value is not None:
        return [int(d) for d in value.const_value.shape.dims if isinstance(d, int)]
    node = value.producer()
    if node is not None and node.op_type == "Constant" and "value" in node.attributes:
        tensor = node.attributes["value"].as_tensor()
        return [int(d) for d in tensor.shape.dims if isinstance(d, int)]
    return None


def _index_bounds(model: ir.Model) -> dict[str, int]:
    """Graph inputs used as Gather indices into a constant table: name -> table size.

    Follows the indices back through shape-only ops (Cast, Unsqueeze, Reshape...) to a
    graph input, so generated token ids (or token-type ids) stay within the embedding.
    """
    inputs = set(model.graph.inputs)
    bounds: dict[str, int] = {}
    for node in model.graph:
        if node.op_type not in ("Gather", "GatherElements") or len(node.inputs) < 2:
            continue
        data, index = node.inputs[0], node.inputs[1]
        table = _const_dims(data) if data is not None else None
        if not table or index is None:
            continue
        axis_attr = node.attributes.get("axis")
        axis = axis_attr.as_int() if axis_attr is not None else 0
        size = table[axis % len(table)]
        for _ in range(4):
            prev = index.producer()
            if index in inputs or prev is None:
                break
            if prev.op_type not in _INDEX_PASSTHROUGH or not prev.inputs or not prev.inputs[0]:
                break
            index = prev.inputs[0]
        if index in inputs and size > 0 and index.name:
            bounds[index.name] = min(bounds.get(index.name, size), size)
    return bounds


def _generate(
    name: str,
    dtype: ir.DataType,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    notes: list[str],
    index_bound: int | None = None,
) -> np.ndarray:
    lname = name.lower()
    if dtype in FLOAT_TYPES:
        if len(shape) == 2 and shape[-1] >= 256:
            notes.append(f"input {name!r}: audio-like, used a seeded sine mixture in [-1, 1]")
            data: np.ndarray = _audio_like(shape, rng)
        else:
            data = rng.random(shape)
        return data.astype(dtype.numpy())
    if dtype.is_integer():
        np_dtype = dtype.numpy()
        size = int(np.prod(shape, dtype=np.int64))
        sample_rate = size == 1 and len(shape) <= 1 and ("sr" in lname or "rate" in lname)
        if sample_rate and np.iinfo(np_dtype).max >= 16000:
            notes.append(f"input {name!r}: looks like a sample rate, used 16000")
            return np.full(shape, 16000, dtype=np_dtype)
        if "mask" in lname:
            notes.append(f"input {name!r}: looks like a mask, used all ones")
            return np.ones(shape, dtype=np_dtype)
        if index_bound is not None:
            high = min(100, index_bound)
            notes.append(
                f"input {name!r}: indexes a table of {index_bound} rows, used ints in [0, {high})"
            )
            return rng.integers(0, high, size=shape).astype(np_dtype)
        return rng.integers(0, 100, size=shape).astype(np_dtype)
    if dtype == ir.DataType.BOOL:
        return np.asarray(rng.random(shape) < 0.5)
    raise MixprecError(
        f"input {name!r} has dtype {dtype.name.lower()}; mixprec cannot generate it, "
        "pass an inputs file instead"
    )


def make_inputs(
    model: ModelArg,
    *,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Generates one realistic, seeded input array per graph input.

    Shapes follow :func:`resolve_input_shapes`. Inputs that are also initializers are
    skipped (they have defaults). Value ranges:

    * float types: uniform in ``[0, 1)`` (image-like). A float input of rank 2 whose last
      dim is >= 256 is treated as audio: a seeded mixture of sines plus small noise, in
      ``[-1, 1]``. float16/bfloat16 inputs are generated as float and cast.
    * integer types: a scalar (or one-element) input whose name contains ``"sr"`` or
      ``"rate"`` gets 16000 (a sample rate); a name containing ``"mask"`` gets all ones
      (an attention mask); Gather indices stay within their table; otherwise uniform
      integers in ``[0, 100)``.
    * bool: random.

    Args:
        model: The model whose inputs to generate.
        shapes: Full shapes by input name; they override the declared shapes.
        seed: Seed of the ``numpy.random.default_rng`` generator.

    Returns:
        ``(feeds, notes)``: the arrays by input name, and one human-readable note per
        guess made (symbolic dims, value-range heuristics).

    Raises:
        MixprecError: An input of unknown rank without a shape, a ``shapes`` entry that
            disagrees with the model, or an input mixprec cannot generate (strings).

    Example:
        >>> feeds, notes = make_inputs(model, shapes={"x": [2, 3, 32, 32]})  # doctest: +SKIP
    """
    m = as_ir(model)
    concrete, notes = resolve_input_shapes(m, shapes)
    rng = np.random.default_rng(seed)
    bounds = _index_bounds(m)
    feeds: dict[str, np.ndarray] = {}
    for value in graph_inputs(m):
        name = value.name or ""
        dtype = _dtype_of(value)
        if dtype == ir.DataType.STRING:
            raise MixprecError(
                f"input {name!r} is a string tensor; "
                "mixprec cannot generate or convert string inputs"
            )
        if name not in concrete:
            raise MixprecError(
                f"input {name!r} has unknown rank; give its shape with --shape {name}=D0,D1,..."
            )
        shape = tuple(concrete[name])
        feeds[name] = _generate(name, dtype, shape, rng, notes, bounds.get(name))
    return feeds, notes


def _cast_feed(name: str, array: np.ndarray, dtype: ir.DataType, source: str) -> np.ndarray:
    """Casts ``array`` to the declared type when only the width/precision differs."""
    want = np.dtype(dtype.numpy())
    have = array.dtype
    if have == want:
        return array
    if want == _BF16 and have.kind == "V" and have.itemsize == 2:
        return array.view(_BF16)
    if _is_float_dtype(want) and _is_float_dtype(have):
        return array.astype(want)
    if want.kind in "iu" and have.kind in "iu":
        return array.astype(want)
    raise MixprecError(f"input {name!r} expects {dtype.name.lower()} but {source} has {have.name}")


def _read_npz(path: Path, what: str = "inputs file") -> dict[str, np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise MixprecError(f"{what} {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise MixprecError(f"{what} {str(path)!r} is a directory, not an .npz file") from None
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise MixprecError(f"cannot read {what} {str(path)!r}: {first_line(e)}") from e
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise MixprecError(f"{what} {str(path)!r} is not an .npz archive (use numpy.savez)")
    with loaded:
        return {key: loaded[key] for key in loaded.files}


def _check_arrays(
    arrays: Mapping[str, np.ndarray], model: ir.Model, label: str, *, leading: int = 0
) -> dict[str, np.ndarray]:
    """The arrays for ``model``'s inputs, cast to their dtypes; ``leading`` extra axes."""
    feeds: dict[str, np.ndarray] = {}
    inputs = graph_inputs(model)
    for value in inputs:
        name = value.name or ""
        if name not in arrays:
            raise MixprecError(
                f"{label} has no array for input {name!r} "
                f"(it has: {', '.join(sorted(arrays)) or 'nothing'})"
            )
        array = np.asarray(arrays[name])
        declared = _declared_dims(value)
        if declared is not None and len(declared) + leading != array.ndim:
            extra = " plus a leading sample axis" if leading else ""
            raise MixprecError(
                f"input {name!r} in {label} has rank {array.ndim} but the model "
                f"declares rank {len(declared)} {_fmt_dims(declared)}{extra}"
            )
        feeds[name] = _cast_feed(name, array, _dtype_of(value), label)
    extra_names = sorted(set(arrays) - {v.name for v in inputs})
    if extra_names:
        logger.warning("%s: ignoring arrays %s (not graph inputs)", label, extra_names)
    return feeds


def load_inputs_npz(path: str | os.PathLike[str], model: ModelArg) -> dict[str, np.ndarray]:
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
    return _check_arrays(_read_npz(p), as_ir(model), f"inputs file {p.name!r}")


def iter_calibration_npz(
    path: str | os.PathLike[str], model: ModelArg
) -> Iterator[dict[str, np.ndarray]]:
    """Streams samples from ``path``, checked against ``model``'s inputs: the one reader
    behind every command's ``--inputs`` and ``--calibration-data``.

    ``path`` is one of:

    * a folder of ``.npz`` files, one sample each (read in name order, one file at a
      time; shapes may differ between files);
    * an ``.npz`` whose arrays have a leading sample axis (N samples, the same N for every
      input);
    * an ``.npz`` of one sample (every array has its input's declared rank).

    Raises:
        MixprecError: A missing path, an empty folder, missing inputs, wrong ranks, or
            inconsistent sample counts (raised before the first sample is yielded).
    """
    p = Path(path)
    m = as_ir(model)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".npz" and f.is_file())
        if not files:
            raise MixprecError(f"samples folder {str(p)!r} holds no .npz file")
        return (_check_arrays(_read_npz(f), m, f"samples file {f.name!r}") for f in files)
    label = f"samples file {p.name!r}"
    arrays = _read_npz(p, "samples file")
    if _one_sample(arrays, m):
        return iter([_check_arrays(arrays, m, label)])
    stacked = _check_arrays(arrays, m, label, leading=1)
    counts = {name: a.shape[0] for name, a in stacked.items()}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise MixprecError(f"{label} has inconsistent sample counts ({shown})")
    n = next(iter(counts.values()), 0)
    if n == 0:
        raise MixprecError(f"{label} holds no sample")
    return ({name: a[i] for name, a in stacked.items()} for i in range(n))


def _one_sample(arrays: Mapping[str, np.ndarray], model: ir.Model) -> bool:
    """Whether an ``.npz``'s arrays are one sample: each input with a declared rank has
    exactly that rank (else they are read as a stack with a leading sample axis)."""
    ranks = [
        (len(declared), np.ndim(arrays[v.name or ""]))
        for v in graph_inputs(model)
        if (declared := _declared_dims(v)) is not None and (v.name or "") in arrays
    ]
    return bool(ranks) and all(want == got for want, got in ranks)


def calibration_feeds(
    data: Feeds | Iterable[Feeds] | None,
) -> Iterator[dict[str, np.ndarray]] | None:
    """Normalizes ``calibration_data``: one feed dict, a list, or any iterable of them.

    Args:
        data: One mapping of input name to array, or an iterable (list, generator) of such
            mappings; ``None`` passes through.

    Returns:
        An iterator of feed dicts, consumed lazily (a generator is never materialized).

    Raises:
        MixprecError: ``data`` is neither a mapping nor an iterable of mappings (a
            non-mapping item is reported when it is reached).
    """
    if data is None:
        return None
    if isinstance(data, Mapping):
        return iter([_sample(0, data)])
    if isinstance(data, str | bytes | np.ndarray) or not isinstance(data, Iterable):
        raise MixprecError(
            "calibration_data must be a dict of input arrays or an iterable of such dicts, "
            f"not {type(data).__name__}"
        )
    return _each_mapping(data)


def _sample(k: int, item: object) -> dict[str, np.ndarray]:
    """Calibration sample ``k`` as arrays; refuses what cannot measure a range."""
    if not isinstance(item, Mapping):
        raise MixprecError(
            f"calibration sample {k} is a {type(item).__name__}, not a dict of input name to array"
        )
    if not item:
        raise MixprecError(f"calibration sample {k} is an empty dict")
    out: dict[str, np.ndarray] = {}
    for name, value in item.items():
        if not isinstance(name, str):
            raise MixprecError(f"calibration sample {k}: keys must be input names, got {name!r}")
        try:
            array = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise MixprecError(f"calibration sample {k}: input {name!r}: {exc}") from None
        if array.dtype == object:
            raise MixprecError(
                f"calibration sample {k}: input {name!r} is not a numeric array "
                f"({type(value).__name__})"
            )
        if array.size == 0:
            raise MixprecError(f"calibration sample {k}: input {name!r} is empty {array.shape}")
        if np.issubdtype(array.dtype, np.floating) and np.isnan(array).all():
            raise MixprecError(f"calibration sample {k}: input {name!r} is all NaN")
        out[name] = array
    return out


def _each_mapping(data: Iterable[Feeds]) -> Iterator[dict[str, np.ndarray]]:
    # No sample at all is refused by calibrate() ("holds no sample").
    for k, item in enumerate(data):
        yield _sample(k, item)


def feeds_for(model: ModelArg, feeds: Feeds) -> dict[str, np.ndarray]:
    """The subset of ``feeds`` that ``model`` takes, cast to its declared dtypes.

    Raises:
        MixprecError: An input of ``model`` has no array in ``feeds``.
    """
    if not isinstance(feeds, Mapping):
        raise MixprecError(
            f"inputs must be a dict of input name to array, not {type(feeds).__name__}"
        )
    out: dict[str, np.ndarray] = {}
    for value in graph_inputs(as_ir(model)):
        name = value.name or ""
        if name not in feeds:
            raise MixprecError(f"no input data for model input {name!r}")
        array = np.asarray(feeds[name])
        if isinstance(value.type, ir.TensorType) and value.type.dtype != ir.DataType.UNDEFINED:
            array = _cast_feed(name, array, value.type.dtype, "the feed")
        out[name] = array
    return out
