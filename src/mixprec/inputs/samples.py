"""Given samples: ``.npz`` files, calibration streams and feed dicts, checked against a
model's inputs.

* :func:`load_inputs_npz` reads one feed dict from an ``.npz`` file;
  :func:`iter_calibration_npz` streams many (a leading sample axis, or a folder);
  :class:`NpzSamples` is such a path as a re-iterable stream (read afresh each time, its
  length known without reading the arrays), labels kept when asked.
* :func:`calibration_feeds` normalizes the forms ``calibration_data`` can take.
* :func:`feeds_for` picks and casts the arrays a model takes.
"""

from __future__ import annotations

import logging
import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.ops import is_float_dtype
from mixprec.inputs.signature import (
    BF16,
    Feeds,
    ModelArg,
    as_ir,
    declared_dims,
    dtype_of,
    first_line,
    fmt_dims,
    graph_inputs,
    signature_only,
)

__all__ = [
    "NpzSamples",
    "calibration_feeds",
    "feeds_for",
    "iter_calibration_npz",
    "load_inputs_npz",
]

logger = logging.getLogger(__name__)


def _cast_feed(name: str, array: np.ndarray, dtype: ir.DataType, source: str) -> np.ndarray:
    """Casts ``array`` to the declared type when only the width/precision differs."""
    want = np.dtype(dtype.numpy())
    have = array.dtype
    if have == want:
        return array
    if want == BF16 and have.kind == "V" and have.itemsize == 2:
        return array.view(BF16)
    if is_float_dtype(want) and is_float_dtype(have):
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
    arrays: Mapping[str, np.ndarray],
    model: ir.Model,
    label: str,
    *,
    leading: int = 0,
    labels: bool = False,
) -> dict[str, np.ndarray]:
    """The arrays for ``model``'s inputs, cast to their dtypes; ``leading`` extra axes;
    ``labels``: the other arrays too, as they are (else ignored with a warning)."""
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
        declared = declared_dims(value)
        if declared is not None and len(declared) + leading != array.ndim:
            extra = " plus a leading sample axis" if leading else ""
            raise MixprecError(
                f"input {name!r} in {label} has rank {array.ndim} but the model "
                f"declares rank {len(declared)} {fmt_dims(declared)}{extra}"
            )
        feeds[name] = _cast_feed(name, array, dtype_of(value), label)
    extra_names = sorted(set(arrays) - {v.name for v in inputs})
    if labels:
        feeds.update({name: np.asarray(arrays[name]) for name in extra_names})
    elif extra_names:
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
    path: str | os.PathLike[str], model: ModelArg, *, labels: bool = False
) -> Iterator[dict[str, np.ndarray]]:
    """Streams samples from ``path``, checked against ``model``'s inputs: the one reader
    behind every command's ``--inputs`` and ``--calibration-data``.

    ``path`` is one of:

    * a folder of ``.npz`` files, one sample each (read in name order, one file at a
      time; shapes may differ between files);
    * an ``.npz`` whose arrays have a leading sample axis (N samples, the same N for every
      input);
    * an ``.npz`` of one sample (every array has its input's declared rank).

    With ``labels``, arrays that are not model inputs (labels, boxes) stay in each sample
    (split along the leading sample axis like the inputs, when they have one of the same
    length), for the user's metric; otherwise they are ignored with a warning.

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
        return (
            _check_arrays(_read_npz(f), m, f"samples file {f.name!r}", labels=labels) for f in files
        )
    label = f"samples file {p.name!r}"
    arrays = _read_npz(p, "samples file")
    if _one_sample(arrays, m):
        return iter([_check_arrays(arrays, m, label, labels=labels)])
    stacked = _check_arrays(arrays, m, label, leading=1, labels=labels)
    inputs = {v.name for v in graph_inputs(m)}
    counts = {name: a.shape[0] for name, a in stacked.items() if name in inputs}
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"{k}: {v}" for k, v in counts.items())
        raise MixprecError(f"{label} has inconsistent sample counts ({shown})")
    n = next(iter(counts.values()), 0)
    if n == 0:
        raise MixprecError(f"{label} holds no sample")
    odd = sorted(k for k, a in stacked.items() if k not in inputs and np.shape(a)[:1] != (n,))
    if odd:  # labels that cannot be split per sample
        logger.warning("%s: ignoring arrays %s (no leading axis of %d samples)", label, odd, n)
    kept = {k: a for k, a in stacked.items() if k not in odd}
    return ({name: a[i] for name, a in kept.items()} for i in range(n))


class NpzSamples:
    """The samples of an ``.npz`` path (the forms :func:`iter_calibration_npz` reads), read
    afresh each time they are iterated: a stream that can be read again, keeping nothing.

    Args:
        path: a folder of ``.npz`` files, or one ``.npz`` (a leading sample axis, or one
            sample).
        model: the model whose inputs the samples feed.
        labels: keep the arrays that are not model inputs in each sample (for the user's
            metric) instead of ignoring them with a warning.

    Example:
        >>> samples = NpzSamples("calib/", "model.onnx")     # doctest: +SKIP
        >>> len(samples), next(iter(samples)).keys()         # doctest: +SKIP
    """

    def __init__(
        self, path: str | os.PathLike[str], model: ModelArg, *, labels: bool = False
    ) -> None:
        self.path = Path(path)
        self.model = signature_only(model)
        self.labels = labels
        self._count: int | None = None

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter_calibration_npz(self.path, self.model, labels=self.labels)

    def __len__(self) -> int:
        """The sample count, from the folder listing or the arrays' headers (the arrays
        themselves are not read)."""
        if self._count is None:
            self._count = _npz_count(self.path, self.model)
        return self._count


def _npz_count(path: Path, model: ir.Model) -> int:
    if path.is_dir():
        return sum(1 for f in path.iterdir() if f.suffix == ".npz" and f.is_file())
    try:
        with zipfile.ZipFile(path) as archive:
            shapes = {
                info.filename.removesuffix(".npy"): _npy_shape(archive, info.filename)
                for info in archive.infolist()
                if info.filename.endswith(".npy")
            }
    except (OSError, ValueError, zipfile.BadZipFile):
        return sum(1 for _ in iter_calibration_npz(path, model))  # its own error
    ranks = [
        (len(declared), len(shapes[v.name or ""]))
        for v in graph_inputs(model)
        if (declared := declared_dims(v)) is not None and (v.name or "") in shapes
    ]
    if ranks and all(want == got for want, got in ranks):
        return 1  # one sample, as _one_sample reads it
    leading = [shapes[v.name or ""] for v in graph_inputs(model) if (v.name or "") in shapes]
    return int(leading[0][0]) if leading and leading[0] else 0


def _npy_shape(archive: zipfile.ZipFile, member: str) -> tuple[int, ...]:
    """An ``.npy`` member's shape, from its header."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, _ = np.lib.format.read_array_header_1_0(f)
        else:
            shape, _, _ = np.lib.format.read_array_header_2_0(f)
    return tuple(int(d) for d in shape)


def _one_sample(arrays: Mapping[str, np.ndarray], model: ir.Model) -> bool:
    """Whether an ``.npz``'s arrays are one sample: each input with a declared rank has
    exactly that rank (else they are read as a stack with a leading sample axis)."""
    ranks = [
        (len(declared), np.ndim(arrays[v.name or ""]))
        for v in graph_inputs(model)
        if (declared := declared_dims(v)) is not None and (v.name or "") in arrays
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
        if array.size and np.issubdtype(array.dtype, np.floating) and np.isnan(array).all():
            raise MixprecError(f"calibration sample {k}: input {name!r} is all NaN")
        out[name] = array
    # an empty input is a zero-length state (a decoder's past of length 0) when another
    # input carries data; a sample of empty arrays only measures nothing
    if all(a.size == 0 for a in out.values()):
        name, array = next(iter(out.items()))
        raise MixprecError(f"calibration sample {k}: input {name!r} is empty {array.shape}")
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
