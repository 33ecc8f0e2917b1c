"""Large weights quantized a slice of columns at a time, in bounded memory.

Block quantization works column by column (each output column's blocks run along ``K``:
:mod:`mixprec.weights.blocks`), so a ``[K, N]`` weight can be cut into slices of columns,
each quantized alone, and the slices' codes, scales and zero points put side by side give
exactly the codes of the whole weight. Round to nearest holds a few float32 copies of
what it quantizes (the padded blocks, the division, the rounding): on a 2 GB weight that
is several GB, on a slice of :data:`SLICE_BYTES` a few hundred MB.

A weight read from an external data file is a read-only memory map: the pages a slice
read stay resident (and count in the process's memory) until ``release`` lets them go,
which is called after each slice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np

from mixprec.weights.blocks import BlockQuant

__all__ = [
    "SLICE_BYTES",
    "column_slices",
    "digest_in_slices",
    "errors_in_slices",
    "quantize_in_slices",
]

#: A float32 weight larger than this is quantized in slices of columns of about this size.
SLICE_BYTES = 32 << 20


def column_slices(k: int, n: int, max_bytes: int | None = None) -> list[slice]:
    """Consecutive column ranges of a float32 ``[K, N]`` weight, each about ``max_bytes``
    (default :data:`SLICE_BYTES`)."""
    width = max(1, (max_bytes or SLICE_BYTES) // max(4 * k, 1))
    return [slice(start, min(start + width, n)) for start in range(0, n, width)]


def _slices(
    matrix: np.ndarray, release: Callable[[], None] | None, max_bytes: int | None
) -> Iterator[np.ndarray]:
    """Each column slice of ``matrix`` as a contiguous float32 copy; ``release`` after each."""
    k, n = matrix.shape
    for part in column_slices(k, n, max_bytes):
        yield np.ascontiguousarray(matrix[:, part], dtype=np.float32)
        if release is not None:
            release()


def quantize_in_slices(
    quantize: Callable[[np.ndarray], BlockQuant],
    matrix: np.ndarray,
    release: Callable[[], None] | None = None,
    max_bytes: int | None = None,
) -> BlockQuant:
    """``quantize(matrix)`` done a slice of columns at a time (module doc); the same codes.

    ``quantize`` must treat columns independently (round to nearest does; GPTQ does for a
    given ``H``, but its cached results are per weight: give it the whole weight).
    """
    if matrix.nbytes <= (max_bytes or SLICE_BYTES):
        return quantize(matrix)
    parts = [quantize(piece) for piece in _slices(matrix, release, max_bytes)]
    return BlockQuant(
        codes=np.concatenate([p.codes for p in parts]),
        scales=np.concatenate([p.scales for p in parts]),
        zero_points=np.concatenate([p.zero_points for p in parts]),
        k=parts[0].k,
        spec=parts[0].spec,
    )


def digest_in_slices(
    matrix: np.ndarray, release: Callable[[], None] | None = None, max_bytes: int | None = None
) -> bytes:
    """A digest of ``matrix``'s float32 values, read a slice of columns at a time."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr(matrix.shape).encode())
    for piece in _slices(matrix, release, max_bytes):
        digest.update(piece.data)
    return digest.digest()


def errors_in_slices(
    matrix: np.ndarray,
    errors: Callable[[np.ndarray], tuple[float, float]],
    release: Callable[[], None] | None = None,
    max_bytes: int | None = None,
) -> tuple[float, float]:
    """``errors`` of each column slice, summed (errors that are sums over columns)."""
    if matrix.nbytes <= (max_bytes or SLICE_BYTES):
        return errors(np.asarray(matrix, dtype=np.float32))
    first, second = 0.0, 0.0
    for piece in _slices(matrix, release, max_bytes):
        a, b = errors(piece)
        first, second = first + a, second + b
    return first, second
