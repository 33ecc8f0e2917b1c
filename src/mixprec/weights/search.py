"""A search of each block's scale and zero point (k-quant style), with or without data.

Round to nearest (:func:`~mixprec.weights.blocks.quantize_rtn`) takes a block's scale from
its range, so one outlier sets the step of the other 31 weights. Here each block tries
:data:`STEPS` scales around that one (the code range stretched by up to one code either
way, llama.cpp's ``make_qkx2_quants`` grid), rounds the block with each, then refits the
scale (and, asymmetric, the offset) by weighted least squares to the codes it got; the
fitted zero point is rounded to an integer code (``MatMulNBits`` stores uint zero points)
and the scale refitted once more. The candidate with the least weighted squared error
wins. Every block searches at once (numpy over ``[N, n_blocks, block_size]``), a slice of
columns at a time.

**Weights of the error.** With calibration data, weight ``W[k, n]``'s error counts
``H[k, k]`` (the input channel's mean square, :mod:`mixprec.weights.stats`): the
diagonal of the layer's output error ``tr(D^T H D)``. Without data it counts
``rms(block) + |W[k, n]|`` (llama.cpp's data-free weighting: large weights matter more).
"""

from __future__ import annotations

import numpy as np

from mixprec.weights.blocks import BlockQuant, BlockSpec, to_blocks

__all__ = ["COLUMNS", "STEPS", "quantize_search"]

#: Scale candidates per block: the code range stretched by -1 .. +1 code in this many steps.
STEPS = 11
#: Columns of ``W`` searched at a time (bounds the temporaries to a few times this slice).
COLUMNS = 2048


def quantize_search(
    weight: np.ndarray, spec: BlockSpec, importance: np.ndarray | None = None
) -> BlockQuant:
    """The searched block quantization of a ``[K, N]`` weight (module doc).
    ``importance``: ``[K]`` non-negative weights of the input channels (``diag(H)``), or
    None for the data-free weighting."""
    if weight.ndim != 2:
        raise ValueError(f"a weight to quantize in blocks is 2-D, not {list(weight.shape)}")
    k, n = weight.shape
    n_blocks = -(-k // spec.block_size)
    rows = None
    if importance is not None:
        padded = np.zeros(n_blocks * spec.block_size, np.float32)
        padded[:k] = np.maximum(np.asarray(importance, np.float32), 0.0)
        rows = padded.reshape(1, n_blocks, spec.block_size)
    codes = np.empty((n, n_blocks, spec.block_size), np.uint8)
    scales = np.empty((n, n_blocks), np.float32)
    zeros = np.empty((n, n_blocks), np.uint8)
    for start in range(0, n, COLUMNS):
        end = min(start + COLUMNS, n)
        blocks = to_blocks(weight[:, start:end], spec.block_size)
        w = _error_weights(blocks, rows, k)
        found = _search(blocks, w, spec)
        codes[start:end], scales[start:end], zeros[start:end] = found
    return BlockQuant(codes=codes, scales=scales, zero_points=zeros, k=k, spec=spec)


def _error_weights(blocks: np.ndarray, rows: np.ndarray | None, k: int) -> np.ndarray:
    """Each weight's share of the error (module doc); the padding past ``K`` weighs 0."""
    if rows is not None:
        w = np.broadcast_to(rows, blocks.shape).copy()
    else:
        rms = np.sqrt(np.mean(blocks * blocks, axis=-1, keepdims=True))
        w = rms + np.abs(blocks)
    flat = w.reshape(w.shape[0], -1)
    flat[:, k:] = 0.0
    # a block whose weights all weigh 0 (inputs never seen) falls back to equal weights
    empty = np.sum(w, axis=-1, keepdims=True) <= 0
    return np.where(empty, np.float32(1), w).astype(np.float32)


def _search(
    x: np.ndarray, w: np.ndarray, spec: BlockSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, zero points) of the best candidate per block."""
    levels = float(spec.levels)
    high, low = x.max(axis=-1), x.min(axis=-1)
    sign = np.ones(high.shape, np.float32)
    if spec.symmetric:  # the peak goes to the lowest code, as RTN puts it (module doc)
        peak = np.where(np.abs(high) >= np.abs(low), high, low)
        sign = np.where(peak > 0, np.float32(-1), np.float32(1))
        x = x * sign[..., None]
        span = np.abs(peak)
        low, nominal = -span, float(spec.mid)
    else:
        low, high = np.minimum(low, 0.0), np.maximum(high, 0.0)
        span, nominal = high - low, levels
    safe_span = np.where(span > 0, span, np.float32(1))
    best_err = np.full(span.shape, np.inf, np.float32)
    best = (np.zeros(x.shape, np.uint8), np.zeros(span.shape, np.float32), span * 0)
    for step in np.linspace(-1.0, 1.0, STEPS, dtype=np.float32):
        inverse = (np.float32(nominal) + step) / safe_span
        scale, zero, codes, err = _candidate(x, w, low, inverse, spec)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = (
            np.where(better[..., None], codes, best[0]),
            np.where(better, scale, best[1]),
            np.where(better, zero, best[2]),
        )
    codes, scale, zero = best
    scale = np.where(span > 0, scale * sign, np.float32(0))
    return codes, scale.astype(np.float32), zero.astype(np.uint8)


def _candidate(
    x: np.ndarray, w: np.ndarray, low: np.ndarray, inverse: np.ndarray, spec: BlockSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One candidate scale per block: round, refit, round the zero point, refit."""
    levels = spec.levels
    if spec.symmetric:
        zero = np.full(low.shape, float(spec.mid), np.float32)
    else:
        codes = np.clip(np.round((x - low[..., None]) * inverse[..., None]), 0, levels)
        scale, offset = _fit_affine(x, w, codes)
        safe = np.where(scale > 0, scale, np.float32(1))
        zero = np.clip(np.round(-offset / safe), 0, levels)
        inverse = np.where(scale > 0, 1.0 / safe, inverse)
    codes = np.clip(np.round(x * inverse[..., None]) + zero[..., None], 0, levels)
    q = codes - zero[..., None]
    scale = _fit_scale(x, w, q)
    d = x - scale[..., None] * q
    err = np.sum(w * d * d, axis=-1)
    return scale, zero, codes.astype(np.uint8), err


def _fit_affine(x: np.ndarray, w: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares ``x ~ scale * codes + offset`` per block, the offset kept
    <= 0 (the zero point must be a code)."""
    sw = np.sum(w, axis=-1)
    swl = np.sum(w * codes, axis=-1)
    swl2 = np.sum(w * codes * codes, axis=-1)
    swx = np.sum(w * x, axis=-1)
    swlx = np.sum(w * codes * x, axis=-1)
    det = sw * swl2 - swl * swl
    safe = np.where(det > 0, det, np.float32(1))
    scale = np.where(det > 0, (sw * swlx - swl * swx) / safe, 0.0)
    offset = np.where(det > 0, (swl2 * swx - swl * swlx) / safe, 0.0)
    positive = offset > 0
    only = np.where(swl2 > 0, swlx / np.where(swl2 > 0, swl2, 1), 0.0)
    return np.where(positive, only, scale), np.where(positive, 0.0, offset)


def _fit_scale(x: np.ndarray, w: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Weighted least squares ``x ~ scale * q`` per block."""
    num = np.sum(w * q * x, axis=-1)
    den = np.sum(w * q * q, axis=-1)
    return np.where(den > 0, num / np.where(den > 0, den, 1), 0.0).astype(np.float32)
