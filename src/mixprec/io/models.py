"""Loading and saving models: clear errors, never a half-written file, input untouched.

Loading reads external data only through :mod:`mixprec.io.external` (the model file's real
folder, nothing outside it). Saving is atomic: every file is first written under a fresh
unique name in the target folder; the model file is renamed into place last, and its
external data (``--external-data``, or a model over 2 GB) goes to a data file that no
other model refers to (``OUT.data`` when that name is free, else ``OUT.<random>.data``),
so that a failure at any point leaves the old model with its old data or the new model
with its new data, never a mix. Temporary files are removed on every error and on
SIGINT/SIGTERM; no file the input model was read from is ever written over.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import onnx
import onnx.defs
import onnx_ir as ir
from google.protobuf.message import DecodeError

from mixprec.core.errors import MixprecError
from mixprec.core.limits import INLINE_LIMIT
from mixprec.core.ops import is_onnx_domain
from mixprec.core.sigstack import ensure_signal_stack
from mixprec.io.data_files import MissingDataFile, real_folder
from mixprec.io.external import add_input_files, folder_of, input_files, model_from_proto
from mixprec.io.protos import iter_proto_tensors

__all__ = [
    "ModelLike",
    "atomic_file",
    "check_output_path",
    "copy_model_file",
    "current_umask",
    "input_kind",
    "load_input",
    "load_model",
    "mapped_copy",
    "runnable_proto",
    "save_model",
    "write_text",
]

#: What every entry point accepts as a model.
ModelLike = str | os.PathLike[str] | onnx.ModelProto | ir.Model

#: An existing output model is parsed (to find the data files it refers to) up to this size.
_MAX_OLD_MODEL = 64 << 20


def _refuse_nul(path: str | os.PathLike[str]) -> None:
    if "\x00" in os.fspath(path):
        raise MixprecError(f"{os.fspath(path)!r}: a path cannot contain a NUL byte")


def load_model(path: str | os.PathLike[str]) -> ir.Model:
    """Load an ONNX model from ``path`` with one-line errors for every bad input.

    External data is read from the real folder of the model file only (see
    :mod:`mixprec.io.external`); the model's meta lists the files read.

    Raises:
        MixprecError: missing file, not an ONNX file, truncated protobuf, external data
            outside the model's folder or out of bounds, unsupported opset.
    """
    _refuse_nul(path)
    p = Path(path)
    if not p.exists():
        raise MixprecError(f"{p}: no such file")
    if p.is_dir():
        raise MixprecError(f"{p}: is a directory, not an ONNX file")
    real = os.path.realpath(p)
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise MixprecError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise MixprecError(f"{p}: not a regular file (a FIFO, socket or device)")
    try:
        proto = onnx.load(real, load_external_data=False)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise MixprecError(f"{p}: not a valid ONNX file ({type(exc).__name__})") from None
    except OSError as exc:
        raise MixprecError(f"{p}: cannot read ({exc.strerror or exc})") from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise MixprecError(f"{p}: not an ONNX model (no graph); truncated or another format?")
    check_opset(proto, str(p))
    try:
        model = model_from_proto(proto, where=str(p), folder=os.path.dirname(real))
    except MissingDataFile as exc:
        if os.path.dirname(os.path.abspath(p)) == os.path.dirname(real):
            raise
        # A link into another folder (a Hugging Face cache keeps each file as a blob).
        raise MixprecError(
            f"{exc}; {p} is a symbolic link into that folder and external data is read "
            "only beside the model file's target: put the model and its data files in "
            "one folder (e.g. huggingface-cli download --local-dir DIR)"
        ) from None
    add_input_files(model, [real])
    return model


def check_opset(proto: onnx.ModelProto, where: str = "model") -> None:
    latest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if is_onnx_domain(opset.domain):
            if opset.version < 7:
                raise MixprecError(
                    f"{where}: opset {opset.version} is too old (mixprec supports 7..{latest})"
                )
            if opset.version > latest:
                raise MixprecError(
                    f"{where}: opset {opset.version} is newer than this onnx package knows "
                    f"({latest}); upgrade onnx"
                )
    if not any(is_onnx_domain(o.domain) for o in proto.opset_import):
        raise MixprecError(f"{where}: no ai.onnx opset import")


def check_output_path(path: str | os.PathLike[str]) -> Path:
    """Fail early, before any work, if ``path`` cannot be written."""
    _refuse_nul(path)
    p = Path(path)
    if os.fspath(path).endswith(("/", os.sep)):  # Path() drops the slash: "new.onnx/"
        raise MixprecError(f"{os.fspath(path)}: names a folder (trailing slash), not a file")
    folder = p.resolve().parent
    if not folder.is_dir():
        raise MixprecError(f"{p}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise MixprecError(f"{p}: folder {folder} is not writable")
    if p.is_dir():
        raise MixprecError(f"{p}: is a directory")
    return p


# --------------------------------------------------------------------------- saving


class _Signalled(BaseException):
    """SIGINT/SIGTERM arrived while writing (raised by the handler, caught by _Writing)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Writing:
    """The temporary files of one save: removed on any error, SIGINT and SIGTERM included.

    While it is active (main thread only), SIGINT and SIGTERM raise inside the write so
    that the files are removed; afterwards the previous handlers are back and the signal
    takes its course: ``KeyboardInterrupt`` for Python's default SIGINT handler, an exit
    with status 128 + signal (130, 143) for the default action, or the previous Python
    handler is called (and the save reports that nothing was written, unless the model
    was already in place). A signal that arrives during the final rename, or while the
    files are being removed, waits until they are done.
    """

    def __init__(self, shown: Path, what: str = "the model", *, wrap: bool = True) -> None:
        self.shown = shown
        self.what = what
        self.wrap = wrap  # errors become one MixprecError line naming ``shown``
        self.files: list[str] = []
        self._previous: dict[int, Any] = {}
        self._raising = False
        self._pending: int | None = None
        self._committed = False

    def add(self, path: str) -> None:
        self.files.append(path)

    def commit(self, tmp: str, target: str) -> None:
        """Rename ``tmp`` to ``target``; every file of the save is then kept.

        Signals wait until the rename and the bookkeeping are both done: a signal in
        between would otherwise remove the data file the new model refers to.
        """
        self._raising = False
        os.replace(tmp, target)
        self.files.clear()
        self._committed = True

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._pending is None:
            self._pending = signum
        if self._raising:
            self._raising = False
            raise _Signalled(signum)

    def __enter__(self) -> _Writing:
        if threading.current_thread() is threading.main_thread():
            ensure_signal_stack()  # a handler on a freed stack would crash, not clean up
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.getsignal(sig)
                if old is signal.SIG_IGN or old is None:
                    continue  # ignored stays ignored; None: a handler not set from Python
                self._previous[sig] = old
                signal.signal(sig, self._handler)
        self._raising = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._raising = False
        if exc_type is not None:
            for path in reversed(self.files):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        if self._pending is not None:
            self._redeliver(self._pending)
        if not self.wrap:
            return
        if isinstance(exc, OSError):
            raise MixprecError(
                f"{self.shown}: cannot write {self.what} ({exc.strerror or exc}); nothing written"
            ) from None
        if isinstance(exc, Exception) and not isinstance(exc, MixprecError):
            raise MixprecError(f"{self.shown}: cannot write {self.what}: {exc}") from None

    def _redeliver(self, signum: int) -> None:
        old = self._previous.get(signum, signal.SIG_DFL)
        if old is signal.default_int_handler:
            raise KeyboardInterrupt from None
        if callable(old):
            old(signum, None)  # it may raise or exit
            if self._committed:
                return  # the new model is in place: the save succeeded
            raise MixprecError(
                f"{self.shown}: writing interrupted by {signal.Signals(signum).name}; "
                "nothing written"
            ) from None
        raise SystemExit(128 + signum) from None


def _refuse_inputs(model: ir.Model, paths: dict[str, str]) -> None:
    """Refuse to write over a file ``model`` was read from (by real path or inode)."""
    inputs = input_files(model)
    if not inputs:
        return
    inodes = set()
    for path in inputs:
        with contextlib.suppress(OSError):
            st = os.stat(path)
            inodes.add((st.st_dev, st.st_ino))
    for shown, path in paths.items():
        same = os.path.realpath(path) in inputs
        with contextlib.suppress(OSError):
            st = os.stat(path)
            same = same or (st.st_dev, st.st_ino) in inodes
        if same:
            raise MixprecError(
                f"{shown}: the input model reads this file; refusing to write over it "
                "(choose another output name)"
            )


def _data_refs(path: str) -> set[str]:
    """The external data locations of the model file at ``path`` (best effort)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode) or os.path.getsize(path) > _MAX_OLD_MODEL:
            return set()
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # not there, not readable, not a model: it refers to nothing we know
        return set()
    return {
        entry.value
        for t in iter_proto_tensors(proto.graph)
        if t.data_location == onnx.TensorProto.EXTERNAL
        for entry in t.external_data
        if entry.key == "location"
    }


def _claim_data_file(folder: str, name: str, taken: set[str]) -> str:
    """Create an empty data file no model refers to: ``NAME.data`` if free, else unique."""
    candidates = [f"{name}.data"] + [f"{name}.{secrets.token_hex(4)}.data" for _ in range(64)]
    for candidate in candidates:
        if candidate in taken:
            continue
        try:
            fd = os.open(
                os.path.join(folder, candidate),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                0o666,  # the umask applies, as for any saved file
            )
        except FileExistsError:
            continue
        os.close(fd)
        return candidate
    raise MixprecError(f"{os.path.join(folder, name)}: no free name for its external data")


def _is_ours(location: str, name: str) -> bool:
    """Data names this module gives the data of model ``name``."""
    return re.fullmatch(re.escape(name) + r"(\.[0-9a-f]{8})?\.data", location) is not None


def save_model(
    model: ir.Model, path: str | os.PathLike[str], *, external_data: bool = False
) -> None:
    """Write ``model`` to ``path`` atomically; never over a file the input was read from.

    Weights go to an external data file beside the model when ``external_data`` is set or
    the model would exceed protobuf's 2 GB limit: ``<name>.data`` when no file has that
    name, else ``<name>.<8 hex digits>.data``. The model file is renamed into place last;
    data files of the model it replaces that carry those names and that the new model
    does not use are removed afterwards.

    Raises:
        MixprecError: the folder is missing or not writable, ``path`` (or, with external
            data, ``<name>.data``) is a file the input model reads, the disk is full, ...
    """
    p = check_output_path(path)
    folder = os.path.realpath(p.parent)
    target = os.path.join(folder, p.name)
    total = sum(
        (v.const_value.nbytes if v.const_value is not None else 0)
        for v in model.graph.initializers.values()
    )
    use_external = external_data or total > INLINE_LIMIT
    protected = {str(p): target}
    if use_external:
        protected[f"{p}.data"] = f"{target}.data"
    _refuse_inputs(model, protected)
    with _Writing(p) as writing:
        tmp = _temp_beside(p.name, folder, writing)
        data_name = None
        if use_external:
            data_name = _claim_data_file(folder, p.name, _data_refs(target))
            writing.add(os.path.join(folder, data_name))
            ir.save(model, tmp, external_data=data_name)  # data: a temporary file, renamed
        else:
            _write_streaming(model, tmp)
        stale = {loc for loc in _data_refs(target) if loc != data_name and _is_ours(loc, p.name)}
        writing.commit(tmp, target)
    inputs = input_files(model)
    for loc in stale:
        old = os.path.join(folder, loc)
        if os.path.realpath(old) not in inputs:
            with contextlib.suppress(OSError):
                os.unlink(old)


def mapped_copy(model: ir.Model, folder: str | os.PathLike[str]) -> ir.Model:
    """``model`` written to ``folder`` with its weights in external data and read back, its
    weights memory-mapped: a model held in memory (one ``.onnx`` file without external
    data) that a long run would otherwise hold twice (the parsed model and a protobuf
    copy). The copy keeps ``model``'s input files, so that no output may overwrite them;
    ``folder`` must outlive every session that reads the copy's data file by path."""
    path = Path(folder) / "model.onnx"
    save_model(model, path, external_data=True)
    copy = load_model(path)
    add_input_files(copy, input_files(model))
    return copy


def copy_model_file(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Write the bytes of the model file ``source`` to ``path`` atomically (a model that
    mixprec decided not to change is written as it was given, byte for byte)."""
    p = check_output_path(path)
    target = os.path.join(os.path.realpath(p.parent), p.name)
    if os.path.exists(target) and os.path.samefile(source, target):
        raise MixprecError(f"{path}: output would overwrite the input model")
    with atomic_file(path, "the model") as tmp:
        shutil.copyfile(source, tmp)


def write_text(path: str | os.PathLike[str], text: str | bytes, *, wrap: bool = True) -> None:
    """Write a text (or bytes) file, a report page or a JSON overlay, atomically
    (:func:`atomic_file`)."""
    with atomic_file(path, wrap=wrap) as tmp, open(tmp, "wb") as fh:
        fh.write(text.encode("utf-8") if isinstance(text, str) else text)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], what: str = "the file", *, wrap: bool = True
) -> Iterator[str]:
    """The one way mixprec writes a file: the block fills a temporary file in the same
    folder (its path yielded), which then takes the umask's permissions and is renamed to
    ``path``; on any error, SIGINT/SIGTERM included, it is removed and nothing is written
    (:class:`_Writing`). ``wrap``: the path is checked first and an error becomes one
    line naming it; else (a caller that names the error itself) errors pass as raised."""
    p = check_output_path(path) if wrap else Path(path)
    folder = os.path.realpath(p.parent)
    with _Writing(p, what, wrap=wrap) as writing:
        tmp = _temp_beside(p.name, folder, writing)
        yield tmp
        writing.commit(tmp, os.path.join(folder, p.name))


def _temp_beside(name: str, folder: str, writing: _Writing) -> str:
    """An empty temporary file for ``name`` in ``folder``, removed if the save fails, with
    the permissions of a file written there (mkstemp makes it 0600)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    writing.add(tmp)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~current_umask())
    return tmp


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def input_kind(model: ModelLike) -> str:
    """The form ``model`` came in: "ir", "proto" or "path" (what results hand back)."""
    if isinstance(model, ir.Model):
        return "ir"
    return "proto" if isinstance(model, onnx.ModelProto) else "path"


def load_input(
    model: ModelLike, base_dir: str | os.PathLike[str] | None = None
) -> tuple[ir.Model, str]:
    """A private copy of ``model`` and the form it came in ("ir", "proto" or "path").

    External data is read (and checked) here, through :mod:`mixprec.io.external`: from the
    real folder of a model file; for an in-memory model from ``base_dir``, or the folder
    its ``onnx_ir`` tensors were loaded from. The copy holds no external tensor.
    """
    if isinstance(model, ir.Model):
        folder = folder_of(model, base_dir)
        return model_from_proto(ir.to_proto(model), where="model", folder=folder), "ir"
    if isinstance(model, onnx.ModelProto):
        check_opset(model)
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return model_from_proto(copy, where="model", folder=base_dir), "proto"
    if isinstance(model, str | os.PathLike):
        loaded = load_model(model)
        if base_dir is not None:
            own = os.path.dirname(os.path.realpath(model))
            if real_folder(base_dir) != own:
                raise MixprecError(
                    f"{os.fspath(model)}: base_dir={os.fspath(base_dir)} is not the folder of "
                    f"the model file ({own}), where its external data is read from"
                )
        return loaded, "path"
    raise MixprecError(
        f"model must be a path, onnx.ModelProto or onnx_ir.Model, not {type(model).__name__}"
    )


def runnable_proto(model: ModelLike, base_dir: str | os.PathLike[str] | None) -> onnx.ModelProto:
    """The model as a proto to run, every external tensor read from its own folder
    (checked); a path whose model cannot be read as it is is one error line."""
    if isinstance(model, str | os.PathLike):
        try:
            return ir.to_proto(load_model(model))  # read from the file's own folder
        except ir.serde.SerdeError as e:  # e.g. a node name that is not UTF-8
            cause: BaseException = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
            reason = f"{type(cause).__name__}: {cause}".splitlines()[0]
            raise MixprecError(f"{model}: cannot be run as it is ({reason})") from e
    if not isinstance(model, str | os.PathLike | onnx.ModelProto | ir.Model):
        raise MixprecError(f"expected a path or a model, not {type(model).__name__}")
    return ir.to_proto(load_input(model, base_dir)[0])
