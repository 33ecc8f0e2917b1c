"""The accuracy guard's samples, streamed: the held-out draw, and samples read again from
their source instead of kept in memory.

The guard reads its samples several times (the FP32 reference, the calibration, the INT8
check, the repair's search and its grading). A source is read afresh each time:

* a list or tuple of feed dicts (already in memory: only the user's references are held);
* a path (a folder of ``.npz``, or an ``.npz`` with a leading sample axis), as
  :class:`~mixprec.inputs.samples.NpzSamples`: re-read each time, its length from the
  listing or the array headers; arrays that are not model inputs stay in each sample as
  its labels (for the user's metric);
* any other iterable that starts over when iterated again (``iter(x) is not x``: a
  dataset class with ``__iter__``): iterated again, counted once when it has no ``len``;
* one feed dict;
* a one-shot iterator (a generator): it cannot be read twice, so its samples are kept in
  memory, at most :data:`MAX_ONE_SHOT` of them, with a warning naming the forms that
  stream.

The held-out draw is decided from the sample count and the first sample, before any
other is read: a seeded random :data:`HELD_OUT_SHARE` of the samples (at least one, at
most :data:`MAX_HELD_OUT`, or where each sample holds few rows enough samples for
:data:`ROWS_TO_CONFIRM` rows, their FP32 outputs under :data:`HELD_OUTPUT_BYTES`:
:func:`held_out_cap`) when there are :data:`GUARD_MIN_SAMPLES` or more, so each sample's
part (calibration or check) is known as it streams by. 64 one-image samples cannot
confirm top-1 >= 0.99 however well they agree (95% lower bound 0.959); 300 can. Random,
not the last part: ordered data (a sorted folder, one class after another) would bias the
check.

Half, not a fifth: the check's pass is only as sure as the rows it is measured on
(:mod:`mixprec.checks.confidence`), and the repair grades on half of them, while ranges
settle on far fewer samples than that (a fifth of 20 batches of 16 rows graded the repair
on 32 rows, which cannot tell 0.99 from 0.98; a model passed there agreed on 0.984 of new
rows).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.core.held_out import held_out_draw
from mixprec.inputs.feeds import calibration_feeds
from mixprec.inputs.samples import NpzSamples

__all__ = [
    "GUARD_MIN_SAMPLES",
    "HELD_OUTPUT_BYTES",
    "HELD_OUT_SHARE",
    "MAX_HELD_OUT",
    "MAX_ONE_SHOT",
    "ROWS_TO_CONFIRM",
    "WINDOWS_HELD_OUT_SHARE",
    "GuardSplit",
    "Samples",
    "held_out_cap",
    "held_out_indices",
    "label_dicts",
    "samples_of",
    "split_for_guard",
]

logger = logging.getLogger(__name__)

#: Samples are held out of the calibration only when there are at least this many.
GUARD_MIN_SAMPLES = 5
#: The share held out (at least one sample) ...
HELD_OUT_SHARE = 0.5
#: ... of a language model's text windows: its guard checks at most a few of them
#: (:data:`~mixprec.pipeline.weight_only.CHECK_SAMPLES`), and the rest calibrate.
WINDOWS_HELD_OUT_SHARE = 0.2
#: ... and at most this many: a bound on the FP32 outputs the guard keeps, whatever the
#: number of samples (rows can still confirm a budget: batches of rows count each row) ...
MAX_HELD_OUT = 64
#: ... unless more samples are needed for this many rows, the fewest that confirm the
#: tightest default budget (0.99) at full agreement (Wilson's 95% bound: 268), with a
#: margin: then up to that many rows' samples are held out, where the data has them ...
ROWS_TO_CONFIRM = 300
#: ... and the FP32 outputs kept of them (known from the model's output shapes) stay
#: under this many bytes.
HELD_OUTPUT_BYTES = 256 << 20
#: A one-shot iterator's samples are kept in memory (it cannot be read twice), at most
#: this many: the rest is not read.
MAX_ONE_SHOT = 1024

Feeds = dict[str, np.ndarray]


class Samples:
    """Samples read afresh from their source at each iteration (validated as calibration
    samples are); :meth:`only` and :meth:`without` are views by position, still streamed.

    Args:
        read: returns a new iterable of the source's items (feed dicts).
        count: the number of samples, when known without reading them.
        indexable: the source's items, when they are a sequence (views then index it
            instead of streaming past the samples they skip).
        checked: ``read`` yields samples already checked (a view of checked samples).
    """

    def __init__(
        self,
        read: Callable[[], Iterable[Any]],
        count: int | None = None,
        indexable: Sequence[Any] | None = None,
        checked: bool = False,
    ) -> None:
        self._read = read
        self._count = count
        self._items = indexable
        self._checked = checked

    def __iter__(self) -> Iterator[Feeds]:
        if self._checked:
            return iter(self._read())
        found = calibration_feeds(self._read())
        return iter(()) if found is None else found

    def __len__(self) -> int:
        if self._count is None:  # a re-iterable source without len: one counting pass
            self._count = sum(1 for _ in self._read())
        return self._count

    def only(self, positions: Collection[int]) -> Samples:
        """The samples at ``positions`` (in this view's order), in order."""
        wanted = sorted(set(positions))
        if self._items is not None:
            items = self._items
            picked = [items[k] for k in wanted]
            return Samples(lambda: picked, len(picked), picked)
        keep = frozenset(wanted)
        return Samples(lambda: _filtered(self, keep.__contains__), len(wanted), checked=True)

    def without(self, positions: Collection[int]) -> Samples:
        """Every sample but those at ``positions``, in order."""
        drop = frozenset(positions)
        if self._items is not None:
            items = self._items
            kept = [s for k, s in enumerate(items) if k not in drop]
            return Samples(lambda: kept, len(kept), kept)
        count = None if self._count is None else self._count - len(drop)
        return Samples(lambda: _filtered(self, lambda k: k not in drop), count, checked=True)

    def first(self) -> Feeds:
        """The first sample (the repair's timing input)."""
        return next(iter(self))


def _filtered(samples: Samples, keep: Callable[[int], bool]) -> Iterator[Feeds]:
    return (s for k, s in enumerate(samples) if keep(k))


def samples_of(data: Any, model: ir.Model, what: str = "calibration_data") -> Samples | None:
    """``data`` (any form ``calibration_data`` / ``eval_data`` takes) as :class:`Samples`
    read afresh each time; None stays None. A one-shot iterator is kept in memory (at
    most :data:`MAX_ONE_SHOT` samples), with a warning."""
    if data is None:
        return None
    if isinstance(data, str | os.PathLike):
        data = NpzSamples(data, model, labels=True)
    if isinstance(data, Mapping):
        one = [data]
        return Samples(lambda: one, 1, one)
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return Samples(lambda: data, len(data), data)
    if not isinstance(data, Iterable) or isinstance(data, np.ndarray):
        return Samples(lambda: data)  # calibration_feeds says what is wrong, when read
    if iter(data) is not data:
        count = len(data) if hasattr(data, "__len__") else None  # type: ignore[arg-type]
        return Samples(lambda: data, count)
    kept = list(itertools.islice(data, MAX_ONE_SHOT + 1))
    more = len(kept) > MAX_ONE_SHOT
    logger.warning(
        "%s is a one-shot iterator: the accuracy guard reads its samples more than once, so "
        "%s kept in memory; give a list, a path, or an object whose __iter__ starts over "
        "to stream them",
        what,
        f"only its first {MAX_ONE_SHOT} samples are read and" if more else "they are",
    )
    kept = kept[:MAX_ONE_SHOT]
    return Samples(lambda: kept, len(kept), kept)


def held_out_indices(
    count: int, seed: int = 0, share: float = HELD_OUT_SHARE, cap: int = MAX_HELD_OUT
) -> list[int]:
    """The positions held out of ``count`` samples (:data:`GUARD_MIN_SAMPLES` or more): a
    seeded random ``share``, at least one and at most ``cap``, sorted. The same draw
    every run (:func:`~mixprec.core.held_out.held_out_draw`, with the guard's share)."""
    return held_out_draw(count, share, cap, seed)


def held_out_cap(model: ir.Model, first: Mapping[str, Any]) -> int:
    """The most samples held out of a model's calibration data: :data:`MAX_HELD_OUT`, or
    more where its samples hold few rows each (``first``'s batch: the leading dim of the
    model's first input), enough for :data:`ROWS_TO_CONFIRM` rows, while the FP32 outputs
    kept of them stay under :data:`HELD_OUTPUT_BYTES` (a model whose output sizes are not
    known from its shapes keeps the default)."""
    inputs = [v.name for v in model.graph.inputs if v.name is not None and v.name in first]
    shape = np.shape(first[inputs[0]]) if inputs else ()
    batch = max(int(shape[0]) if shape else 1, 1)
    wanted = -(-ROWS_TO_CONFIRM // batch)
    if wanted <= MAX_HELD_OUT:
        return MAX_HELD_OUT
    per_sample = _output_bytes(model, batch)
    if per_sample is None:
        return MAX_HELD_OUT
    return max(MAX_HELD_OUT, min(wanted, HELD_OUTPUT_BYTES // max(per_sample, 1)))


def _output_bytes(model: ir.Model, batch: int) -> int | None:
    """The bytes of one sample's outputs from their declared shapes (a symbolic leading
    dim is the batch); None when a shape or another dim is not known."""
    total = 0
    for value in model.graph.outputs:
        if value.shape is None or value.dtype is None:
            return None
        size = 1
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int):
                size *= dim
            elif axis == 0:
                size *= batch
            else:
                return None
        total += int(size * value.dtype.itemsize)
    return total


@dataclass(frozen=True)
class GuardSplit:
    """The guard's two streams: what calibrates, and what the INT8 model is checked on.

    Attributes:
        calibration: the calibration samples (None: none given).
        held: the samples the check runs on.
        in_sample: too few samples to hold any out: every one calibrates and checks.
        given: ``held`` is the user's ``eval_data``.
    """

    calibration: Samples | None
    held: Samples
    in_sample: bool
    given: bool


def split_for_guard(
    calibration_data: Any,
    eval_data: Any,
    model: ir.Model,
    share: float = HELD_OUT_SHARE,
    cap: int | None = None,
) -> GuardSplit:
    """The guard's streams for ``model``: ``eval_data`` when given, else the held-out draw
    (:func:`held_out_indices`, ``share`` of the samples, at most ``cap``; None: as many
    as :func:`held_out_cap` allows, which reads the first sample) of
    ``calibration_data``; nothing else is read but counted."""
    calib = samples_of(calibration_data, model)
    if eval_data is not None:
        held = samples_of(eval_data, model, "eval_data")
        assert held is not None
        return GuardSplit(calib, held, False, True)
    if calib is None:
        raise ValueError("the guard needs calibration_data or eval_data")  # internal order
    count = len(calib)
    if count < GUARD_MIN_SAMPLES:
        return GuardSplit(calib, calib, True, False)
    if cap is None:
        cap = held_out_cap(model, calib.first()) if count * share > MAX_HELD_OUT else MAX_HELD_OUT
    held_out = held_out_indices(count, share=share, cap=cap)
    return GuardSplit(calib.without(held_out), calib.only(held_out), False, False)


def label_dicts(samples: Iterable[Mapping[str, Any]], inputs: Collection[str]) -> list[Feeds]:
    """Each sample's arrays that are not model ``inputs`` (labels, boxes), one dict per
    sample, in order."""
    return [{k: np.asarray(v) for k, v in s.items() if k not in inputs} for s in samples]
