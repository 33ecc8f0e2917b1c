"""External data, resolved in one place for every way a model reaches mixprec.

A tensor may keep its bytes in another file (``data_location: EXTERNAL``): initializers,
in subgraphs too, ``Constant`` values and other tensor attributes, tensors in model-local
functions, and the values and indices of sparse initializers. Whatever the entry point
(a path, an ``onnx.ModelProto``, an ``onnx_ir.Model``), mixprec reads those bytes here
and nowhere else:

* the folder is the **real** folder of the model file (symbolic links resolved), or the
  ``base_dir=`` given with an in-memory model, or the ``base_dir`` of ``onnx_ir``'s
  external tensors (``ir.load(path)`` sets it). The current directory is never consulted;
  an in-memory model with external data and no folder is refused;
* a location must be a non-empty relative path without ``..`` or NUL bytes whose real
  path (symbolic links followed) stays inside that folder and names a regular file (not a
  folder, FIFO, socket or device: checked on the opened file, which is opened
  non-blocking, so a FIFO cannot hang the run);
* ``offset`` and ``length`` are non-negative integers, ``length`` is exactly the tensor's
  size, and the bytes lie inside the file;
* every external tensor is then replaced by an in-memory ``ir.Tensor`` over a read-only
  memory map of its file (pages are read when used), so no later stage, serialization or
  ONNX Runtime session can resolve a location again, against another folder;
* sparse initializers and ``Constant(sparse_value=...)`` (which ``onnx_ir`` cannot
  represent) become dense initializers and ``Constant(value=...)``.

The real paths of the files read (the model file and its data files) are kept in the
model's meta under :data:`INPUT_FILES`: :func:`mixprec.io.models.save_model` and the log folder
refuse to write over any of them.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import re
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.limits import PROTO_LIMIT
from mixprec.core.ops import is_onnx_domain, onnx_domain
from mixprec.io.data_files import DataReader, real_folder
from mixprec.io.proto_checks import check_proto, check_text
from mixprec.io.protos import FILE_SPAN, IN_MEMORY, iter_model_graphs

__all__ = [
    "DATA_FOLDER",
    "INPUT_FILES",
    "MAPPINGS",
    "RELEASE_EVERY",
    "SHARED_TENSORS",
    "ResolveExternalDataPass",
    "ResolveExternalDataResult",
    "add_input_files",
    "clone_model",
    "external_bytes",
    "external_locations",
    "folder_of",
    "input_files",
    "model_from_proto",
    "prepare_proto",
    "release_mapped_pages",
]

#: ``model.meta`` key: the real paths (strings) of every file the input model was read from.
INPUT_FILES = "mixprec.input_files"

#: ``model.meta`` key, True on both sides of :func:`clone_model`: the model's tensors are
#: shared with another model, so no pass may change one in place (release its bytes).
SHARED_TENSORS = "mixprec.shared_tensors"

#: A sparse tensor is densified only up to what one protobuf message can hold.
_MAX_DENSE_BYTES = PROTO_LIMIT
_INTEGER = re.compile(r"[0-9]+")


def input_files(model: ir.Model) -> frozenset[str]:
    """The real paths of the files ``model`` was read from (empty if none were)."""
    return frozenset(model.meta.get(INPUT_FILES, ()))


def add_input_files(model: ir.Model, paths: Iterable[str]) -> None:
    """Record real ``paths`` as files ``model`` was read from."""
    model.meta[INPUT_FILES] = sorted(input_files(model) | set(paths))


# --------------------------------------------------------------------------- protos


def _proto_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    for graph in iter_model_graphs(model):
        yield from graph.node
    for function in model.functions:
        yield from function.node


def _proto_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every dense tensor of ``model``, the parts of its sparse tensors included."""
    for graph in iter_model_graphs(model):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
    for node in _proto_nodes(model):
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)
            for sparse in attr.sparse_tensors:
                yield from (sparse.values, sparse.indices)


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}  # the last one wins


def external_locations(model: onnx.ModelProto) -> list[str]:
    """The external-data file names ``model``'s tensors refer to (relative to its folder)."""
    found = {_entries(t).get("location", "") for t in _proto_tensors(model) if _is_external(t)}
    return sorted(found - {""})


def _check_entries(tensor: onnx.TensorProto, where: str) -> None:
    entries = _entries(tensor)
    for key in ("offset", "length"):
        if key in entries and not _INTEGER.fullmatch(entries[key]):
            raise MixprecError(
                f"{where}: tensor {tensor.name!r}: external data {key} {entries[key]!r} is "
                "not a non-negative integer"
            )


def _no_folder(where: str, tensor_name: str, location: object) -> MixprecError:
    return MixprecError(
        f"{where}: tensor {tensor_name!r} keeps its data in the external file {location!r} "
        "and an in-memory model has no folder to read it from: pass base_dir= (the folder "
        "of the .onnx file), or the model's path"
    )


def _proto_array(tensor: onnx.TensorProto, reader: DataReader | None, where: str) -> np.ndarray:
    if not _is_external(tensor):
        return onnx.numpy_helper.to_array(tensor)
    entries = _entries(tensor)
    if reader is None:
        raise _no_folder(where, tensor.name, entries.get("location", ""))
    offset, length = entries.get("offset"), entries.get("length")
    return reader.tensor(
        tensor.name,
        entries.get("location", ""),
        None if offset is None else int(offset),
        None if length is None else int(length),
        ir.DataType(tensor.data_type),
        tuple(int(d) for d in tensor.dims),
    ).numpy()


def _densify(
    sparse: onnx.SparseTensorProto, name: str, reader: DataReader | None, where: str
) -> onnx.TensorProto:
    """A dense tensor holding ``sparse``'s values (ONNX: linear or per-axis indices)."""
    dims = [int(d) for d in sparse.dims]
    values = _proto_array(sparse.values, reader, where)
    indices = _proto_array(sparse.indices, reader, where)
    numel = math.prod(dims)
    if any(d < 0 for d in dims) or numel * values.dtype.itemsize > _MAX_DENSE_BYTES:
        raise MixprecError(
            f"{where}: sparse tensor {name!r} of shape {dims} is too large to make dense"
        )
    bad = MixprecError(f"{where}: sparse tensor {name!r}: its indices do not fit shape {dims}")
    if values.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise bad
    if indices.ndim == 2 and indices.shape[1] == len(dims) and len(dims) > 0:
        if (indices < 0).any() or (indices >= np.array(dims)).any():
            raise bad
        linear = np.ravel_multi_index(tuple(indices.T), dims) if indices.size else indices[:, 0]
    elif indices.ndim == 1:
        linear = indices
    else:
        raise bad
    if linear.shape[0] != values.shape[0] or (linear < 0).any() or (linear >= numel).any():
        raise bad
    dense = np.zeros(numel, dtype=values.dtype)
    dense[linear.astype(np.int64)] = values
    return onnx.numpy_helper.from_array(dense.reshape(dims), name=name)


def prepare_proto(
    model: onnx.ModelProto, where: str, folder: str | os.PathLike[str] | None
) -> frozenset[str]:
    """Check ``model``'s external data entries and make its sparse tensors dense, in place.

    Call it on a private copy, before ``ir.from_proto`` (``onnx_ir`` drops sparse
    initializers and cannot read sparse ``Constant`` values). ``folder`` is where
    external data is read from (``None``: the model has none it may read).

    Returns:
        The real paths of the data files read (those of sparse tensors).

    Raises:
        MixprecError: a malformed entry, a bad location, data out of bounds.
    """
    for tensor in _proto_tensors(model):
        if _is_external(tensor):
            _check_entries(tensor, where)
    reader = None if folder is None else DataReader(real_folder(folder, "base_dir"), where)
    for graph in iter_model_graphs(model):
        if graph.sparse_initializer:
            dense = [_densify(s, s.values.name, reader, where) for s in graph.sparse_initializer]
            graph.initializer.extend(dense)
            del graph.sparse_initializer[:]
    for node in _proto_nodes(model):
        if node.op_type != "Constant" or not is_onnx_domain(node.domain):
            continue
        for attr in node.attribute:
            if attr.name == "sparse_value" and attr.HasField("sparse_tensor"):
                dense_t = _densify(attr.sparse_tensor, node.output[0], reader, where)
                attr.Clear()
                attr.name, attr.type = "value", onnx.AttributeProto.TENSOR
                attr.t.CopyFrom(dense_t)
    return frozenset() if reader is None else frozenset(f.path for f in reader.files.values())


# --------------------------------------------------------------------------- onnx_ir


def _ir_graphs(model: ir.Model) -> Iterator[ir.Graph]:
    yield from model.graphs()
    for function in model.functions.values():
        yield function.graph
        yield from function.graph.subgraphs()


def _external_tensors(model: ir.Model) -> Iterator[ir.ExternalTensor]:
    """Every external tensor of ``model`` (mixprec's in-memory placeholders excepted)."""
    for tensor in _all_tensors(model):
        if isinstance(tensor, ir.ExternalTensor) and tensor.location != IN_MEMORY:
            yield tensor


def _all_tensors(model: ir.Model) -> list[ir.TensorProtocol]:
    """Every tensor of ``model``, subgraphs included (:func:`_replace_tensors`' walk)."""
    found: list[ir.TensorProtocol] = []

    def note(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        found.append(tensor)
        return tensor

    _replace_tensors(model, note)
    return found


def folder_of(model: ir.Model, base_dir: str | os.PathLike[str] | None) -> str | None:
    """The one real folder ``model``'s external tensors are read from, or ``None``.

    ``base_dir`` (the caller's) wins; each tensor's own non-empty ``base_dir`` (what
    ``ir.load(path)`` sets) must then name the same real folder. Without ``base_dir``, all
    tensors must carry the same folder.

    Raises:
        MixprecError: tensors without a folder, or folders that disagree.
    """
    given = None if base_dir is None else real_folder(base_dir, "base_dir")
    found: dict[str, str] = {}  # real folder -> first tensor name seen there
    for tensor in _external_tensors(model):
        own = os.fspath(tensor.base_dir)
        if not own:
            if given is None:
                raise _no_folder("model", tensor.name or "", tensor.location)
            continue
        real = os.path.realpath(own)
        if given is not None and real != given:
            raise MixprecError(
                f"model: tensor {tensor.name!r} was loaded from {own} (its base_dir), which "
                f"is not base_dir={os.fspath(base_dir or '')}"
            )
        found.setdefault(real, tensor.name or "")
    if given is not None:
        return given
    if len(found) > 1:
        (a, ta), (b, tb) = list(found.items())[:2]
        raise MixprecError(
            f"model: external tensors come from different folders ({ta!r} from {a}, {tb!r} "
            f"from {b}); mixprec reads a model's external data from one folder"
        )
    return next(iter(found), None)


@dataclasses.dataclass
class ResolveExternalDataResult(ir.passes.PassResult):
    """``resolved``: how many external tensors now hold their bytes; ``files``: their files."""

    resolved: int = 0
    files: list[str] = dataclasses.field(default_factory=list)


class ResolveExternalDataPass(ir.passes.InPlacePass):
    """Replace every external tensor by its checked bytes (a read-only memory map).

    Covers initializers of every graph and function, ``Constant`` values and other
    tensor attributes. Afterwards no tensor of the model refers to a file, so nothing
    downstream can read one relative to another folder. ``modified`` is true when a
    tensor was replaced; the files read are added to ``model.meta[INPUT_FILES]``.

    Args:
        base_dir: the folder to read from (see :func:`folder_of`); for a model loaded
            from a path, the real folder of that file.
        where: how errors name the model (its path, or "model").

    Raises:
        MixprecError: no folder, a location outside it, a missing file or one that is
            not a regular file, an offset or length that does not fit.

    Example:
        >>> model = ir.load("m.onnx")                                     # doctest: +SKIP
        >>> ResolveExternalDataPass()(model)  # reads m.onnx's folder only  # doctest: +SKIP
    """

    def __init__(
        self, base_dir: str | os.PathLike[str] | None = None, *, where: str = "model"
    ) -> None:
        super().__init__()
        self.base_dir = base_dir
        self.where = where

    def call(self, model: ir.Model) -> ResolveExternalDataResult:
        if not any(True for _ in _external_tensors(model)):
            return ResolveExternalDataResult(model, modified=False)
        folder = folder_of(model, self.base_dir)
        if folder is None:  # pragma: no cover - folder_of raises when a tensor has none
            raise MixprecError(f"{self.where}: no folder to read external data from")
        reader = DataReader(folder, self.where)
        replaced: dict[int, ir.TensorProtocol] = {}

        def swap(tensor: ir.TensorProtocol) -> ir.TensorProtocol:
            if not isinstance(tensor, ir.ExternalTensor) or tensor.location == IN_MEMORY:
                return tensor
            if id(tensor) not in replaced:
                new = reader.tensor(
                    tensor.name or "",
                    os.fspath(tensor.location),
                    tensor.offset,
                    tensor.length,
                    tensor.dtype,
                    tuple(int(d) for d in tensor.shape.numpy()),
                    tensor.doc_string,
                    dict(tensor.metadata_props),
                )
                replaced[id(tensor)] = new
            return replaced[id(tensor)]

        _replace_tensors(model, swap)
        maps = [f.buffer for f in reader.files.values() if f.buffer is not None]
        if maps:
            model.meta.setdefault(MAPPINGS, []).extend(maps)
        model.meta[DATA_FOLDER] = folder
        files = sorted({f.path for f in reader.files.values()})
        add_input_files(model, files)
        return ResolveExternalDataResult(
            model, modified=bool(replaced), resolved=len(replaced), files=files
        )


#: ``model.meta`` key: the read-only maps of the model's external data files.
MAPPINGS = "mixprec.mappings"
#: ``model.meta`` key: the real folder the model's external data files were read from.
DATA_FOLDER = "mixprec.data_folder"
#: Bytes read from the maps after which a pass lets their pages go again.
RELEASE_EVERY = 64 << 20


def clone_model(model: ir.Model) -> ir.Model:
    """A copy of ``model``'s graphs that shares its tensors (no weight is copied or read:
    memory-mapped ones stay mapped) and carries its meta (the maps, the data folder, the
    input files); both are marked :data:`SHARED_TENSORS`. Each value of the copy has a
    type of its own: ``onnx_ir``'s clone shares them, and setting a value's ``dtype``
    changes its type object in place (the fp16 fallback's painting of one model retyped
    the other's values)."""
    copy = model.clone()
    model.meta[SHARED_TENSORS] = True
    for key, value in model.meta.items():
        copy.meta[key] = value
    for graph in _ir_graphs(copy):
        values = [*graph.inputs, *graph.initializers.values()]
        values += [v for node in graph for v in node.outputs]
        for v in values:
            if isinstance(v.type, ir.TensorType):
                v.type = ir.TensorType(v.type.dtype)
    return copy


def external_bytes(model: ir.Model) -> int:
    """Bytes of ``model``'s tensors that are spans of its external data files."""
    return sum(t.nbytes for t in _all_tensors(model) if FILE_SPAN in t.meta)


def release_mapped_pages(model: ir.Model) -> None:
    """Let the kernel drop the resident pages of the model's external-data maps.

    The maps are read-only views of files: a page dropped here is read again from the
    file if a tensor still needs it. Called as weights are converted, so that a large
    model's pages do not all stay resident (and counted in the process's memory).
    """
    for buffer in model.meta.get(MAPPINGS, []):
        try:
            buffer.madvise(mmap.MADV_DONTNEED)
        except (AttributeError, OSError, ValueError):  # no madvise here, or a closed map
            continue


def _replace_tensors(
    model: ir.Model, swap: Callable[[ir.TensorProtocol], ir.TensorProtocol]
) -> None:
    for graph in _ir_graphs(model):
        for value in graph.initializers.values():
            if value.const_value is not None:
                value.const_value = swap(value.const_value)
        for node in graph:
            for value in node.outputs:
                if value.const_value is not None:
                    value.const_value = swap(value.const_value)
            for name, attr in list(node.attributes.items()):
                if attr.is_ref() or attr.value is None:
                    continue
                if attr.type == ir.AttributeType.TENSOR:
                    new = swap(attr.value)
                    if new is not attr.value:
                        node.attributes[name] = ir.Attr(
                            name, attr.type, new, doc_string=attr.doc_string
                        )
                elif attr.type == ir.AttributeType.TENSORS:
                    tensors = [swap(t) for t in attr.value]
                    if any(n is not o for n, o in zip(tensors, attr.value, strict=True)):
                        node.attributes[name] = ir.Attr(
                            name, attr.type, tensors, doc_string=attr.doc_string
                        )


def model_from_proto(
    proto: onnx.ModelProto, *, where: str, folder: str | os.PathLike[str] | None
) -> ir.Model:
    """``proto`` (a private copy: it is changed) as an ``onnx_ir`` model with no external
    tensor left: sparse tensors made dense, external data read from ``folder`` only.

    Raises:
        MixprecError: see :func:`prepare_proto` and :class:`ResolveExternalDataPass`;
            external data and no ``folder``; a proto ``onnx_ir`` cannot represent.
    """
    check_text(proto, where)  # before anything reads a name, op type or location
    files = prepare_proto(proto, where, folder)
    check_proto(proto, where)  # what onnx_ir cannot parse sanely
    _drop_repeated_opsets(proto)
    try:
        model = ir.from_proto(proto)
    except Exception as exc:  # onnx_ir raises various errors on malformed models
        raise MixprecError(f"{where}: cannot be parsed as ONNX: {_first_line(exc)}") from None
    ResolveExternalDataPass(folder, where=where)(model)
    add_input_files(model, files)
    return model


def _drop_repeated_opsets(proto: onnx.ModelProto) -> None:
    """Keep one of several identical opset imports of a domain (the version converter
    would raise only one of them, and ONNX Runtime then reads the other)."""
    seen: set[tuple[str, int]] = set()
    kept = []
    for opset in proto.opset_import:
        key = (onnx_domain(opset.domain), opset.version)
        if key not in seen:
            seen.add(key)
            kept.append(opset)
    if len(kept) != len(proto.opset_import):
        del proto.opset_import[:]
        proto.opset_import.extend(kept)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    if exc.__cause__ is not None and "Error calling" in text:  # onnx_ir's SerdeError wrapper
        text = f"{text.splitlines()[0]}: {str(exc.__cause__).strip()}"
    return text.splitlines()[0] if text else type(exc).__name__
