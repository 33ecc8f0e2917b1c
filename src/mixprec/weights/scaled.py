"""A weight that activation-aware scaling multiplied or divided, kept as what it was made
from: the stored tensor (often a read-only map of an external data file) and the factors.

:func:`rescale` replaces a constant's value by an ``onnx_ir`` lazy tensor, whose bytes are
made each time they are read (a save, a session) and never kept, and records the stored
tensor and the steps on the value (``value.meta[SCALED]``). :func:`scaled_matrix` gives
the weight as a MatMul reads it: a plain array when it is small, else a
:class:`ScaledArray`, whose column slices are made from the same slices of the stored
tensor, so that the slice-at-a-time readers (:mod:`mixprec.weights.slices`) never hold the
whole scaled weight. On a 0.5B decoder the scaled lm_head alone is 545 MB; made whole,
with the copy ``astype`` makes and the mapped pages it read, it lifted the run's peak by
about 2 GB.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from mixprec.weights.slices import SLICE_BYTES

__all__ = ["SCALED", "Scaled", "ScaledArray", "rescale", "scaled_matrix"]

#: ``value.meta`` key of a constant's :class:`Scaled` record and the lazy tensor it made.
SCALED = "mixprec.weights.scaled"
#: A scaled weight of more bytes than this is read as a :class:`ScaledArray`: the size
#: above which the slice readers cut a weight.
WHOLE_BYTES = SLICE_BYTES


@dataclasses.dataclass(frozen=True)
class Scaled:
    """The stored tensor and the steps applied to it in order: ``(factor, divide)``, each
    factor broadcast against the stored layout (``[rows, 1]`` or ``[1, cols]``)."""

    stored: ir.TensorProtocol
    steps: tuple[tuple[np.ndarray, bool], ...]

    def apply(self, array: np.ndarray, rows: slice, cols: slice) -> np.ndarray:
        """The steps on ``array``, the stored tensor's ``[rows, cols]`` region."""
        for factor, divide in self.steps:
            part = factor
            if factor.ndim == 2:  # a weight's factor: [rows, 1] or [1, cols]
                part = factor[
                    rows if factor.shape[0] > 1 else slice(None),
                    cols if factor.shape[1] > 1 else slice(None),
                ]
            array = array / part if divide else array * part
        return array.astype(np.float32, copy=False)

    def whole(self) -> np.ndarray:
        everything = slice(None)
        return self.apply(self.stored.numpy(), everything, everything)


class ScaledArray:
    """A large scaled weight ``[K, N]`` as a MatMul reads it (the stored tensor or its
    transpose): ``shape``, ``nbytes`` and ``[:, columns]`` slices, each made from the
    stored tensor's matching slice; ``np.asarray`` makes the whole."""

    dtype = np.dtype(np.float32)
    ndim = 2

    def __init__(self, scaled: Scaled, transposed: bool) -> None:
        self._scaled = scaled
        self._transposed = transposed
        rows, cols = (int(d) for d in scaled.stored.shape.numpy())
        self.shape = (cols, rows) if transposed else (rows, cols)
        self.nbytes = 4 * rows * cols

    def __getitem__(self, key: tuple[slice, slice]) -> np.ndarray:
        first, second = key
        if first != slice(None) or not isinstance(second, slice):
            raise TypeError("a scaled weight is read by [:, columns] slices")
        stored = self._scaled.stored.numpy()
        if self._transposed:  # the MatMul's columns are the stored rows
            rows, cols = second, slice(None)
            return self._scaled.apply(stored[rows, :], rows, cols).T
        rows, cols = slice(None), second
        return self._scaled.apply(stored[:, cols], rows, cols)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        whole = self._scaled.whole()
        return whole.T if self._transposed else whole

    def astype(self, dtype: object) -> np.ndarray:
        return np.asarray(self).astype(dtype)  # type: ignore[call-overload]


def rescale(value: ir.Value, factor: np.ndarray, divide: bool = False) -> None:
    """``value``'s constant times ``factor`` (or divided by it; ``factor`` broadcast
    against the stored layout), made when read and never kept (module doc)."""
    tensor = value.const_value
    assert tensor is not None
    before = _record(value)
    if before is not None:
        scaled = Scaled(before.stored, (*before.steps, (factor, divide)))
    else:
        scaled = Scaled(tensor, ((factor, divide),))
    shape = ir.Shape(tensor.shape.numpy())

    def made() -> ir.TensorProtocol:
        return ir.tensor(scaled.whole(), name=value.name)

    lazy = ir.LazyTensor(made, ir.DataType.FLOAT, shape, name=value.name)
    value.const_value = lazy
    value.meta[SCALED] = (scaled, lazy)


def _record(value: ir.Value) -> Scaled | None:
    """``value``'s :class:`Scaled` record while its constant is still the lazy tensor
    :func:`rescale` made (a later replacement makes the record stale)."""
    found = value.meta.get(SCALED)
    if isinstance(found, tuple) and found[1] is value.const_value and isinstance(found[0], Scaled):
        return found[0]
    return None


def scaled_matrix(value: ir.Value, transposed: bool) -> np.ndarray | ScaledArray | None:
    """The scaled weight ``value`` holds as a MatMul reads it (None: not scaled): a plain
    array up to :data:`WHOLE_BYTES`, else a :class:`ScaledArray`."""
    scaled = _record(value)
    if scaled is None:
        return None
    lazy = ScaledArray(scaled, transposed)
    return np.asarray(lazy) if lazy.nbytes <= WHOLE_BYTES else lazy
