"""Generated model inputs: concrete input shapes and seeded feeds.

* :func:`resolve_input_shapes` is the one rule for symbolic input dims, used by
  ``convert``, ``validate`` and :func:`make_inputs`: a user shape wins; else declared dims;
  a symbolic first dim (batch) becomes 1, the length of a KV-cache input
  (``past_key_values.*``) 0, and any other symbolic dim :data:`DEFAULT_SYMBOLIC_DIM`,
  each with a note saying so.
* :func:`guessed_dims` says which dims were guessed, and what a sample at given shapes
  weighs (:data:`MAX_SAMPLE_BYTES` bounds what mixprec generates unasked).
* :func:`make_inputs` generates one seeded feed dict from the signature.

Given samples (``.npz`` files, calibration streams) are read by :mod:`mixprec.inputs.samples`,
whose functions are re-exported here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import FLOAT_TYPES
from mixprec.inputs.bounds import LENGTH_STEPS, length_bounds, length_readers, next_step
from mixprec.inputs.samples import (
    calibration_feeds,
    feeds_for,
    iter_calibration_npz,
    load_inputs_npz,
)
from mixprec.inputs.signature import (
    Feeds,
    ModelArg,
    as_ir,
    declared_dims,
    dtype_of,
    first_line,
    fmt_dims,
    graph_inputs,
)

__all__ = [
    "DEFAULT_SYMBOLIC_DIM",
    "MAX_SAMPLE_BYTES",
    "CheckGeneratedSizePass",
    "Feeds",
    "GuessedDims",
    "ModelArg",
    "as_ir",
    "calibration_feeds",
    "feeds_for",
    "first_line",
    "graph_inputs",
    "guessed_dims",
    "iter_calibration_npz",
    "load_inputs_npz",
    "make_inputs",
    "resolve_input_shapes",
]

#: Symbolic dims without a user shape: a batch-like dim gets 1, others this value (or
#: the first of :data:`~mixprec.inputs.bounds.LENGTH_STEPS` above what the ops need).
DEFAULT_SYMBOLIC_DIM = LENGTH_STEPS[0]
#: The most bytes one generated sample may take, the inputs the user gave a shape for
#: aside (theirs is whatever ``--shape`` asks for).
MAX_SAMPLE_BYTES = 256 << 20

_INDEX_PASSTHROUGH = frozenset({"Cast", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity"})


def _check_override(name: str, declared: list[int | str | None] | None, dims: list[int]) -> None:
    if any(d < 0 for d in dims):
        raise MixprecError(f"--shape for input {name!r} has a negative dim: {dims}")
    if declared is None:
        return
    if len(declared) != len(dims):
        raise MixprecError(
            f"--shape for input {name!r} has rank {len(dims)} but the model declares "
            f"rank {len(declared)} {fmt_dims(declared)}"
        )
    for i, (want, got) in enumerate(zip(declared, dims, strict=True)):
        if isinstance(want, int) and want != got:
            raise MixprecError(
                f"--shape for input {name!r} gives dim {i} = {got} but the model "
                f"declares {want} {fmt_dims(declared)}"
            )


def resolve_input_shapes(
    model: ModelArg, shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[dict[str, list[int]], list[str]]:
    """Concrete shapes of the graph inputs: the one rule for symbolic dims.

    A shape in ``shapes`` wins (checked against the declared rank and fixed dims).
    Otherwise the declared dims are used; a symbolic or unknown first dim becomes 1, the
    length of a KV-cache input 0 (an empty cache) and any other one
    :data:`DEFAULT_SYMBOLIC_DIM`, with one note per dim. Inputs of unknown
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
        declared = declared_dims(value)
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


#: Graph inputs holding a decoder's KV cache (``past_key_values.0.key``, ``past_value``,
#: ``kv_cache``...).
_CACHE_NAME = re.compile(r"(^|[._/:-])past|kv_cache|key_cache|value_cache", re.IGNORECASE)


def _cache_length_axis(name: str, declared: Sequence[int | str | None]) -> int | None:
    """The length axis of a KV-cache input (its one symbolic dim after the batch), else
    None. It is generated 0, an empty cache as at the first decoding step: with the ids
    and the mask at one guessed length, a cache of that length too would make the mask
    shorter than cache + ids."""
    if not _CACHE_NAME.search(name) or len(declared) < 3:
        return None
    rest = [k for k, d in enumerate(declared) if k > 0 and not isinstance(d, int)]
    return rest[0] if len(rest) == 1 else None


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
    cache = _cache_length_axis(name, declared)
    for k, d in enumerate(declared):
        if isinstance(d, int):
            concrete.append(d)
            continue
        if d and d in symbols:
            used, why = symbols[d], f"as {d!r} elsewhere"
        elif k == cache:
            used, why = 0, "a KV-cache length: an empty cache, the first decoding step"
            if d:
                symbols[d] = used
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


class GuessedDims(dict[tuple[str, int], str]):
    """``{(input, axis): label}`` of the dims mixprec guessed, and what learning from
    ONNX Runtime's refusals (:func:`~mixprec.runtime.fit.fit_shapes`) needs beside:
    the bytes a sample takes and which guessed dims an op reads.

    Args:
        labels: the guessed dims and their labels (the symbol, or ``"?"``).
        itemsizes: bytes per element of each input the user gave no shape for: those
            mixprec chooses, bounded by :data:`MAX_SAMPLE_BYTES` together.
        model: the model, read when an op refuses a length (:meth:`readers`).
    """

    def __init__(
        self,
        labels: Mapping[tuple[str, int], str],
        itemsizes: Mapping[str, int],
        model: ir.Model | None = None,
    ) -> None:
        super().__init__(labels)
        self.itemsizes = dict(itemsizes)
        self.model = model
        self._readers: dict[str, dict[int, list[tuple[str, int]]]] | None = None

    def sample_bytes(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """Bytes of the inputs mixprec chooses, generated at ``shapes``."""
        return sum(
            math.prod(int(d) for d in shapes[name]) * size
            for name, size in self.itemsizes.items()
            if name in shapes
        )

    def oversize(self, shapes: Mapping[str, Sequence[int]]) -> MixprecError | None:
        """The error for a sample at ``shapes`` over :data:`MAX_SAMPLE_BYTES`, else None."""
        total = self.sample_bytes(shapes)
        if total <= MAX_SAMPLE_BYTES:
            return None
        name = max(
            (n for n in self.itemsizes if n in shapes),
            key=lambda n: math.prod(int(d) for d in shapes[n]) * self.itemsizes[n],
        )
        return oversize_error(name, list(shapes[name]), total, self)

    def readers(self, node: str) -> dict[int, list[tuple[str, int]]]:
        """``{node axis: [(input, axis), ...]}``: the guessed dims that the length axes of
        node ``node``'s first input carry (:func:`~mixprec.inputs.bounds.length_readers`)."""
        if self._readers is None:
            found = length_readers(self.model, self) if self.model is not None else {}
            self._readers = found
        return self._readers.get(node, {})


def _human(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.2f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover


def oversize_error(
    name: str, dims: list[int], total: int, guessed: Mapping[tuple[str, int], str]
) -> MixprecError:
    """One line: a generated sample of ``total`` bytes is over :data:`MAX_SAMPLE_BYTES`;
    names input ``name``'s largest dim and the ``--shape`` to use."""
    k = max(range(len(dims)), key=lambda i: dims[i], default=0)
    head = (
        f"a generated sample would take {_human(total)}, over the "
        f"{_human(MAX_SAMPLE_BYTES)} limit on generated inputs"
    )
    if (name, k) in guessed:
        shown = ",".join("N" if (name, i) in guessed else str(d) for i, d in enumerate(dims))
        return MixprecError(
            f"{head} (input {name!r} dim {k} ({guessed[(name, k)]}) was guessed {dims[k]}): "
            f"give the shapes, e.g. --shape {name}={shown} with the N the model needs"
        )
    where = f"input {name!r} dim {k} is declared {dims[k]}" if dims else f"input {name!r}"
    return MixprecError(
        f"{head} ({where}): pass real inputs (--calibration-data or --inputs), or ask "
        f"for it with --shape {name}={','.join(map(str, dims))}"
    )


def guessed_dims(model: ModelArg, shapes: Mapping[str, Sequence[int]] | None = None) -> GuessedDims:
    """``{(input, axis): label}`` of the dims :func:`resolve_input_shapes` guesses: the
    symbolic dims of the inputs not given in ``shapes`` (a :class:`GuessedDims`, which
    also knows the sample's bytes and the model's length ops)."""
    m = as_ir(model)
    found = {}
    itemsizes = {}
    for value in graph_inputs(m):
        name = value.name or ""
        declared = declared_dims(value)
        if name in (shapes or {}) or declared is None:
            continue
        if isinstance(value.type, ir.TensorType) and value.type.dtype != ir.DataType.STRING:
            itemsizes[name] = _itemsize(value.type.dtype)
        for k, d in enumerate(declared):
            if not isinstance(d, int):
                found[(name, k)] = d or "?"
    return GuessedDims(found, itemsizes, m)


class CheckGeneratedSizePass(ir.passes.InPlacePass):
    """Refuse, in one line and at once, a model whose generated sample would be over
    :data:`MAX_SAMPLE_BYTES` at the shapes :func:`resolve_input_shapes` picks (the
    user's ``shapes`` first): run where no data was given, before anything reads the
    declared dims. A file-type classifier declaring ``bytes`` of length 2^40 ran past
    110 s: ONNX's shape inference with data propagation builds one dim per element of a
    1-D input (minutes and gigabytes from 2^26 on), long before the sample was made.
    Changes nothing.

    Args:
        shapes: the user's shapes by input name (``--shape``), or None.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]] | None = None) -> None:
        super().__init__()
        self.shapes = shapes

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        resolved, _ = resolve_input_shapes(model, self.shapes)
        error = guessed_dims(model, self.shapes).oversize(resolved)
        if error is not None:
            raise error
        return ir.passes.PassResult(model, modified=False)


def _itemsize(dtype: ir.DataType) -> int:
    """Bytes per element of a generated array (at least one; 4-bit types count one)."""
    try:
        return max(1, np.dtype(dtype.numpy()).itemsize)
    except (TypeError, ValueError):
        return 8


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
    too_large = guessed_dims(m, shapes).oversize(concrete)
    if too_large is not None:
        raise too_large
    rng = np.random.default_rng(seed)
    bounds = _index_bounds(m)
    feeds: dict[str, np.ndarray] = {}
    for value in graph_inputs(m):
        name = value.name or ""
        dtype = dtype_of(value)
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
        try:
            feeds[name] = _generate(name, dtype, shape, rng, notes, bounds.get(name))
        except MemoryError:
            raise MixprecError(
                f"cannot allocate the generated input {name!r} of shape {list(shape)} "
                "(out of memory): give a smaller --shape or real inputs"
            ) from None
    return feeds, notes
