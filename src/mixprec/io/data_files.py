"""The data files of external tensors, opened safely: inside the model's real folder only,
regular files only (opened non-blocking: a FIFO cannot hang the run), read through
read-only memory maps, with offsets and lengths checked against the file.
:mod:`mixprec.io.external` decides which tensors are external and when to read them."""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import stat
import sys
from pathlib import PurePosixPath, PureWindowsPath

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.protos import FILE_SPAN

__all__ = ["DataFile", "DataReader", "MissingDataFile", "real_folder"]


@dataclasses.dataclass
class DataFile:
    path: str  # real path
    size: int
    buffer: mmap.mmap | None  # None for an empty file


class MissingDataFile(MixprecError):
    """An external data file that is not in the model's folder."""


class DataReader:
    """Opens and checks data files inside one folder; one read-only map per file."""

    def __init__(self, folder: str, where: str) -> None:
        self.folder = folder  # a real path
        self.where = where
        self.files: dict[str, DataFile] = {}

    def fail(self, name: str, message: str) -> MixprecError:
        return MixprecError(f"{self.where}: tensor {name!r}: {message}")

    def open(self, name: str, location: object) -> DataFile:
        if not isinstance(location, str) or location == "":
            raise self.fail(name, "external data location is empty")
        if location in self.files:
            return self.files[location]
        if "\x00" in location:
            raise self.fail(name, f"external data location {location!r} contains a NUL byte")
        if (
            os.path.isabs(location)
            or location.startswith(("/", "\\"))
            or PureWindowsPath(location).drive
        ):
            raise self.fail(
                name,
                f"external data location {location!r} is an absolute path; it must be "
                "relative to the model's folder",
            )
        if ".." in PurePosixPath(location.replace(os.sep, "/")).parts:
            raise self.fail(
                name,
                f"external data location {location!r} points outside the model's folder "
                f"{self.folder}",
            )
        real = os.path.realpath(os.path.join(self.folder, location))
        if real == self.folder:
            raise self.fail(name, f"external data location {location!r} is a folder, not a file")
        if os.path.commonpath([real, self.folder]) != self.folder:
            raise self.fail(
                name,
                f"external data location {location!r} points outside the model's folder "
                f"{self.folder} (through a symbolic link, to {real})",
            )
        self.files[location] = self._open_real(name, location, real)
        return self.files[location]

    def _open_real(self, name: str, location: str, real: str) -> DataFile:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        flags |= getattr(os, "O_NOFOLLOW", 0)  # ``real`` has no link left to follow
        try:
            fd = os.open(real, flags)
        except FileNotFoundError:
            raise MissingDataFile(
                f"{self.where}: tensor {name!r}: external data file {location!r} is missing "
                f"(looked in {self.folder})"
            ) from None
        except OSError as exc:
            raise self.fail(
                name, f"cannot read external data file {location!r} ({exc.strerror or exc})"
            ) from None
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise self.fail(
                    name, f"external data location {location!r} is a folder, not a file"
                )
            if not stat.S_ISREG(st.st_mode):
                raise self.fail(
                    name,
                    f"external data file {location!r} is not a regular file (a FIFO, socket "
                    "or device)",
                )
            try:
                buffer = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size > 0 else None
            except (OSError, ValueError) as exc:
                raise self.fail(
                    name, f"cannot read external data file {location!r} ({exc})"
                ) from None
            return DataFile(real, st.st_size, buffer)
        finally:
            os.close(fd)

    def bytes_of(
        self,
        name: str,
        location: object,
        offset: int | None,
        length: int | None,
        nbytes: int,
    ) -> tuple[DataFile, int]:
        """The checked file and offset of a tensor of ``nbytes`` bytes."""
        data = self.open(name, location)
        offset = 0 if offset is None else offset
        if offset < 0:
            raise self.fail(name, f"external data offset {offset} is negative")
        if length is not None and length != nbytes:
            raise self.fail(
                name,
                f"external data length {length} does not match the tensor's size ({nbytes} bytes)",
            )
        if offset + nbytes > data.size:
            raise self.fail(
                name,
                f"external data at offset {offset} with length {nbytes} runs past the end "
                f"of {location!r} ({data.size} bytes)",
            )
        return data, offset

    def tensor(
        self,
        name: str,
        location: object,
        offset: int | None,
        length: int | None,
        dtype: ir.DataType,
        dims: tuple[int, ...],
        doc_string: str | None = None,
        metadata_props: dict[str, str] | None = None,
    ) -> ir.TensorProtocol:
        """The tensor's bytes as an in-memory tensor over the file's read-only map."""
        if dtype in (ir.DataType.STRING, ir.DataType.UNDEFINED):
            raise self.fail(name, f"a {dtype.name} tensor cannot be stored as external data")
        if any(d < 0 for d in dims):
            raise self.fail(name, f"negative dimension in shape {list(dims)}")
        numel = math.prod(dims)
        nbytes = (numel * dtype.bitwidth + 7) // 8
        data, offset = self.bytes_of(name, location, offset, length, nbytes)
        if dtype.bitwidth % 8:  # packed 2/4/6-bit types: onnx_ir unpacks a raw_data proto
            proto = onnx.TensorProto(name=name, data_type=dtype.value, dims=list(dims))
            proto.raw_data = data.buffer[offset : offset + nbytes] if data.buffer else b""
            if doc_string:
                proto.doc_string = doc_string
            for key, value in (metadata_props or {}).items():
                proto.metadata_props.add(key=key, value=value)
            return ir.serde.deserialize_tensor(proto)
        np_dtype = np.dtype(dtype.numpy()).newbyteorder("<")
        if numel == 0 or data.buffer is None:
            array = np.empty(dims, dtype=np_dtype.newbyteorder("="))
        else:
            array = np.frombuffer(data.buffer, dtype=np_dtype, count=numel, offset=offset)
            array = array.reshape(dims)
            if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
                array = array.astype(np_dtype.newbyteorder("="))
        tensor = ir.Tensor(
            array,
            dtype=dtype,
            name=name,
            doc_string=doc_string,
            metadata_props=dict(metadata_props) if metadata_props else None,
        )
        if numel and data.buffer is not None and sys.byteorder == "little":
            tensor.meta[FILE_SPAN] = (data.path, offset)  # ORT may map the file itself
        return tensor


def real_folder(base_dir: str | os.PathLike[str], what: str = "base_dir") -> str:
    """The real path of folder ``base_dir``; ``what`` names it in errors."""
    if not isinstance(base_dir, str | os.PathLike) or "\x00" in os.fspath(base_dir):
        raise MixprecError(f"{what} must be a path to a folder, not {base_dir!r}")
    real = os.path.realpath(os.fspath(base_dir))
    if not os.path.isdir(real):
        raise MixprecError(f"{what} {os.fspath(base_dir)}: not a folder")
    return real
