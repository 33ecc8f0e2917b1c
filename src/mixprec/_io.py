"""Loading and saving models: clear errors, never a half-written file, input untouched."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx.defs
import onnx_ir as ir
from google.protobuf.message import DecodeError

from mixprec._errors import MixprecError
from mixprec._protos import iter_proto_tensors

__all__ = ["check_output_path", "load_model", "save_model"]

_MAX_PROTO = 2**31 - 1


def _external_locations(proto: onnx.ModelProto) -> list[str]:
    return [
        entry.value
        for t in iter_proto_tensors(proto.graph)
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    ]


def load_model(path: str | os.PathLike[str]) -> ir.Model:
    """Load an ONNX model from ``path`` with one-line errors for every bad input.

    Raises:
        MixprecError: missing file, not an ONNX file, truncated protobuf, external data
            outside the model's folder, unsupported opset.
    """
    p = Path(path)
    if not p.exists():
        raise MixprecError(f"{p}: no such file")
    if p.is_dir():
        raise MixprecError(f"{p}: is a directory, not an ONNX file")
    try:
        proto = onnx.load(os.fspath(p), load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise MixprecError(f"{p}: not a valid ONNX file ({type(exc).__name__})") from None
    except OSError as exc:
        raise MixprecError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise MixprecError(f"{p}: not an ONNX model (no graph); truncated or another format?")
    base = p.resolve().parent
    for location in _external_locations(proto):
        target = (base / location).resolve()
        if base not in target.parents and target != base:
            raise MixprecError(
                f"{p}: external data location {location!r} points outside the model's folder"
            )
        if not target.exists():
            raise MixprecError(f"{p}: external data file {location!r} is missing")
    check_opset(proto, str(p))
    try:
        if not _external_locations(proto):
            return ir.from_proto(proto)  # parsed once; ir.load would parse the file again
        return ir.load(os.fspath(p))
    except Exception as exc:  # onnx_ir raises various errors on malformed models
        raise MixprecError(f"{p}: cannot be parsed as ONNX: {str(exc).splitlines()[0]}") from None


def check_opset(proto: onnx.ModelProto, where: str = "model") -> None:
    latest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            if opset.version < 7:
                raise MixprecError(
                    f"{where}: opset {opset.version} is too old (mixprec supports 7..{latest})"
                )
            if opset.version > latest:
                raise MixprecError(
                    f"{where}: opset {opset.version} is newer than this onnx package knows "
                    f"({latest}); upgrade onnx"
                )
    if not any(o.domain in ("", "ai.onnx") for o in proto.opset_import):
        raise MixprecError(f"{where}: no ai.onnx opset import")


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """Fail early, before any work, if ``path`` cannot be written."""
    p = Path(path)
    folder = p.resolve().parent
    if not folder.is_dir():
        raise MixprecError(f"{p}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise MixprecError(f"{p}: folder {folder} is not writable")
    if p.is_dir():
        raise MixprecError(f"{p}: is a directory")
    return p


def save_model(
    model: ir.Model, path: str | os.PathLike[str], *, external_data: bool = False
) -> None:
    """Write ``model`` to ``path`` atomically (temporary file in the same folder, then rename).

    Weights go to ``<name>.data`` beside the model when ``external_data`` is set or the
    model would exceed protobuf's 2 GB limit.
    """
    p = check_output_path(path)
    folder = p.resolve().parent
    total = sum(
        (v.const_value.nbytes if v.const_value is not None else 0)
        for v in model.graph.initializers.values()
    )
    use_external = external_data or total > _MAX_PROTO - 2**26
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a saved model follows the umask
    tmp_data = None
    try:
        if use_external:
            data_name = p.name + ".data"
            tmp_data_name = f".{data_name}.tmp"
            tmp_data = folder / tmp_data_name
            ir.save(model, tmp, external_data=tmp_data_name)
            # The model refers to the final data name; write it with that location.
            proto = onnx.load(tmp, load_external_data=False)
            for t in _iter_external(proto):
                for entry in t.external_data:
                    if entry.key == "location":
                        entry.value = data_name
            with open(tmp, "wb") as fh:
                fh.write(proto.SerializeToString())
            os.replace(tmp_data, folder / data_name)
            tmp_data = None
        else:
            _write_streaming(model, tmp)
        os.replace(tmp, p)
    except Exception as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if tmp_data is not None and tmp_data.exists():
            tmp_data.unlink()
        if isinstance(exc, MixprecError):
            raise
        raise MixprecError(f"{p}: cannot write the model: {exc}") from None


def _iter_external(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    return (
        t for t in iter_proto_tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL
    )


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_GRAPH_FIELD = 7  # ModelProto.graph
_INITIALIZER_FIELD = 5  # GraphProto.initializer


def _write_streaming(model: ir.Model, path: str, min_bytes: int = 1 << 16) -> None:
    """Write ``model`` as one .onnx file, serializing large initializers one at a time.

    The main graph is serialized without its large initializers; each of them is then
    serialized on its own and appended as a ``GraphProto.initializer`` field (protobuf
    concatenates repeated fields), so at most one tensor's bytes are duplicated in
    memory instead of the whole model's.
    """
    large = [
        value
        for value in model.graph.initializers.values()
        if value.const_value is not None and value.const_value.nbytes > min_bytes
    ]
    for value in large:
        model.graph.initializers.pop(value.name or "")
    try:
        proto = ir.to_proto(model)
    finally:
        for value in large:
            model.graph.initializers[value.name or ""] = value
    graph_bytes = proto.graph.SerializeToString()
    proto.ClearField("graph")
    head = proto.SerializeToString()
    del proto
    sizes = []
    for value in large:
        assert value.const_value is not None
        sizes.append(ir.serde.serialize_tensor(value.const_value).ByteSize())
    init_tag = _varint((_INITIALIZER_FIELD << 3) | 2)
    graph_len = len(graph_bytes) + sum(len(init_tag) + len(_varint(n)) + n for n in sizes)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.write(_varint((_GRAPH_FIELD << 3) | 2))
        fh.write(_varint(graph_len))
        fh.write(graph_bytes)
        for value, size in zip(large, sizes, strict=True):
            assert value.const_value is not None
            data = ir.serde.serialize_tensor(value.const_value).SerializeToString()
            if len(data) != size:  # pragma: no cover - serialization is deterministic
                raise MixprecError(f"{path}: tensor {value.name!r} changed while writing")
            fh.write(init_tag)
            fh.write(_varint(size))
            fh.write(data)
