"""Block quantization of a weight matrix in numpy, and the layouts ONNX Runtime reads.

A weight ``W`` of shape ``[K, N]`` (``y = x @ W``) is cut into blocks of ``block_size``
consecutive rows along ``K`` (the input dimension), one block per output column and
``ceil(K / block_size)`` blocks per column; the last block is padded with zeros. Each
block has one float scale and one integer zero point, and each weight is stored as an
unsigned code::

    W[k, n] ~= (code[n, b, i] - zero_point[n, b]) * scale[n, b],   k = b * block_size + i

* symmetric: the zero point is ``2 ** (bits - 1)`` (8 for 4 bits, 128 for 8 bits, the
  default ``MatMulNBits`` assumes when no zero point is given) and the scale maps the
  block's value of largest magnitude exactly onto the lowest code
  (``scale = peak / -2 ** (bits - 1)``, negative when that value is positive), as ONNX
  Runtime's own quantizer does: the whole code range is used, not ``2 ** bits - 1`` codes;
* asymmetric: the block's range, widened to hold 0, spans the codes
  ``0 .. 2 ** bits - 1``, and the zero point is the code of 0.

Packing (:func:`pack_codes`) puts two 4-bit codes in a byte, the first in the low nibble:
``MatMulNBits`` reads ``B`` as ``uint8 [N, n_blocks, block_size * bits / 8]``, ``scales``
as ``[N * n_blocks]`` and packed zero points as ``[N * ceil(n_blocks * bits / 8)]``;
``GatherBlockQuantized`` reads an embedding table ``[V, H]`` as the weight ``W = table.T``
quantized the same way (blocks along ``H``), so one quantization serves a table tied
between an embedding and the lm_head.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = [
    "BITS",
    "BLOCK_SIZES",
    "BlockQuant",
    "BlockSpec",
    "GatherArrays",
    "MatMulNBitsArrays",
    "gather_arrays",
    "matmul_nbits_arrays",
    "pack_codes",
    "quantize_rtn",
]

#: Weight bits mixprec writes (``MatMulNBits`` also takes 2; nothing here uses it).
BITS = (4, 8)
#: Block sizes ONNX Runtime's CPU kernels take (powers of two from 16; MLAS's fast
#: kernels stop at 256).
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """How one weight is quantized: ``bits`` (4 or 8), ``block_size`` along ``K``,
    ``symmetric`` (fixed zero point) or not."""

    bits: int
    block_size: int
    symmetric: bool

    @property
    def levels(self) -> int:
        """The highest code, ``2 ** bits - 1``."""
        return (1 << self.bits) - 1

    @property
    def mid(self) -> int:
        """The symmetric zero point, ``2 ** (bits - 1)``."""
        return 1 << (self.bits - 1)

    def describe(self) -> str:
        kind = "symmetric" if self.symmetric else "asymmetric"
        return f"int{self.bits}, block {self.block_size}, {kind}"


@dataclasses.dataclass(frozen=True)
class BlockQuant:
    """A quantized ``[K, N]`` weight.

    Attributes:
        codes: ``uint8 [N, n_blocks, block_size]``, each in ``0 .. 2 ** bits - 1``.
        scales: ``float32 [N, n_blocks]``.
        zero_points: ``uint8 [N, n_blocks]`` (all ``2 ** (bits - 1)`` when symmetric).
        k: the weight's true ``K`` (the codes are padded to a whole number of blocks).
        spec: how it was quantized.
    """

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    k: int
    spec: BlockSpec

    @property
    def n(self) -> int:
        return int(self.codes.shape[0])

    @property
    def n_blocks(self) -> int:
        return int(self.codes.shape[1])

    def dequantize(self) -> np.ndarray:
        """The float32 ``[K, N]`` weight the codes stand for."""
        values = self.codes.astype(np.float32)
        values -= self.zero_points[..., None].astype(np.float32)
        values *= self.scales[..., None]
        weight = np.empty((self.k, self.n), dtype=np.float32)
        _transpose_into(weight, values.reshape(self.n, -1)[:, : self.k])
        return weight


#: Rows of ``W`` transposed at a time by :func:`to_blocks` (a tiled transpose stays in
#: cache: 4x faster than numpy's whole-array one on a [8192, 512] float32 weight).
_TILE = 64


def _transpose_into(out: np.ndarray, source: np.ndarray) -> None:
    """``out[:, :rows] = source.T`` (``source`` ``[rows, cols]``), a tile of rows at a time."""
    rows = source.shape[0]
    for start in range(0, rows, _TILE):
        end = min(start + _TILE, rows)
        out[:, start:end] = source[start:end].T


def to_blocks(weight: np.ndarray, block_size: int) -> np.ndarray:
    """``[K, N]`` -> float32 ``[N, n_blocks, block_size]``, the last block zero-padded."""
    k, n = weight.shape
    n_blocks = -(-k // block_size)
    blocks = np.empty((n, n_blocks * block_size), dtype=np.float32)
    _transpose_into(blocks, weight)
    blocks[:, k:] = 0.0
    return blocks.reshape(n, n_blocks, block_size)


def quantize_rtn(
    weight: np.ndarray, spec: BlockSpec, scales: np.ndarray | None = None
) -> BlockQuant:
    """Round-to-nearest block quantization of a ``[K, N]`` weight (module doc).

    ``scales`` (``[N, n_blocks]``), when given, replace the scales RTN would choose: a
    data-aware method that searches scales rounds with this function (asymmetric zero
    points then follow from each block's minimum).

    Example:
        >>> q = quantize_rtn(w, BlockSpec(4, 32, symmetric=True))  # doctest: +SKIP
        >>> error = np.abs(q.dequantize() - w).max()                 # doctest: +SKIP
    """
    if weight.ndim != 2:
        raise ValueError(f"a weight to quantize in blocks is 2-D, not {list(weight.shape)}")
    blocks = to_blocks(weight, spec.block_size)
    high, low = blocks.max(axis=-1), blocks.min(axis=-1)
    if spec.symmetric:
        peak = np.where(np.abs(high) >= np.abs(low), high, low)
        scale = peak / np.float32(-spec.mid) if scales is None else scales
        zero = np.full(scale.shape, spec.mid, dtype=np.float32)
    else:
        low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)
        scale = (high - low) / np.float32(spec.levels) if scales is None else scales
        safe = np.where(scale == 0, np.float32(1), scale)
        zero = np.clip(np.round(-low / safe), 0, spec.levels)
    scale = np.asarray(scale, dtype=np.float32)
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    # codes = clip(round(blocks / safe) + zero, 0, levels), in place: no float copies
    np.divide(blocks, safe, out=blocks)
    np.round(blocks, out=blocks)
    np.add(blocks, zero[..., None], out=blocks)
    np.clip(blocks, 0, spec.levels, out=blocks)
    return BlockQuant(
        codes=blocks.astype(np.uint8),
        scales=scale,
        zero_points=zero.astype(np.uint8),
        k=int(weight.shape[0]),
        spec=spec,
    )


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes packed along the last axis: 8 bits as they are, 4 bits two to a byte (the
    first in the low nibble; an odd count is padded with a zero code)."""
    codes = np.asarray(codes, dtype=np.uint8)
    if bits == 8:
        return codes
    if bits != 4:
        raise ValueError(f"packing of {bits}-bit codes is not implemented")
    if codes.shape[-1] % 2:
        pad = np.zeros((*codes.shape[:-1], 1), dtype=np.uint8)
        codes = np.concatenate([codes, pad], axis=-1)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


@dataclasses.dataclass(frozen=True)
class MatMulNBitsArrays:
    """The initializers of one ``MatMulNBits`` and its attributes."""

    b: np.ndarray  # uint8 [N, n_blocks, block_size * bits / 8]
    scales: np.ndarray  # float32 [N * n_blocks]
    zero_points: np.ndarray | None  # uint8 [N * ceil(n_blocks * bits / 8)]; None: symmetric
    attributes: dict[str, int]


def matmul_nbits_arrays(q: BlockQuant) -> MatMulNBitsArrays:
    """``MatMulNBits``' inputs for ``q`` (without ``accuracy_level``, a run-time choice)."""
    spec = q.spec
    zero_points = None
    if not spec.symmetric:
        zero_points = pack_codes(q.zero_points, spec.bits).reshape(-1)
    return MatMulNBitsArrays(
        b=pack_codes(q.codes, spec.bits),
        scales=np.ascontiguousarray(q.scales.reshape(-1)),
        zero_points=zero_points,
        attributes={"K": q.k, "N": q.n, "bits": spec.bits, "block_size": spec.block_size},
    )


@dataclasses.dataclass(frozen=True)
class GatherArrays:
    """The initializers of one ``GatherBlockQuantized`` over a ``[V, H]`` table.

    ``shared``: the data is ``MatMulNBits``' ``B`` (``[V, n_blocks, blob]``, blocks on
    axis 2), gathered as ``[..., n_blocks, block_size]`` and reshaped to ``H`` by the
    caller; otherwise the data is ``[V, ceil(H * bits / 8)]`` with blocks on axis 1.
    """

    data: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    attributes: dict[str, int]
    shared: bool


def gather_arrays(q: BlockQuant, *, shared: bool) -> GatherArrays:
    """``GatherBlockQuantized``' inputs for a table ``[V, H]`` quantized as ``q`` (the
    quantization of ``table.T``); see :class:`GatherArrays` for ``shared``."""
    spec = q.spec
    if shared:
        data = pack_codes(q.codes, spec.bits)
        scales = q.scales[..., None]
        zero = q.zero_points[..., None]
    else:
        data = pack_codes(q.codes.reshape(q.n, -1)[:, : q.k], spec.bits)
        scales, zero = q.scales, q.zero_points
    attributes = {
        "bits": spec.bits,
        "block_size": spec.block_size,
        "gather_axis": 0,
        "quantize_axis": data.ndim - 1,
    }
    zero_points = None if spec.symmetric else pack_codes(zero, spec.bits)
    return GatherArrays(data, np.ascontiguousarray(scales), zero_points, attributes, shared)
