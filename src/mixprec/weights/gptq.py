"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers") for block-quantized ``[K, N]`` weights, in numpy or torch.

GPTQ minimizes the layer's output error ``||X W - X Q(W)||^2`` one input row of ``W`` at a
time: with ``H = X^T X`` (the input's second moment, :mod:`mixprec.weights.stats`), damped by
1% of its mean diagonal, and ``U`` the upper Cholesky factor of ``H^-1``, row ``k`` is
rounded, and its error, divided by ``U[k, k]``, is spread over the rows not yet rounded
through ``U[k, k+1:]``. Rows go in order, so each block of ``block_size`` rows takes its
scale and zero point (as round-to-nearest would choose them) from the weights as updated
when the block is reached; the updates of later rows are applied in lazy batches of
:data:`BATCH` rows (one matrix product per batch). Inputs never seen (a zero diagonal)
get zero weights, as in the paper. No reordering of rows (act-order): the blocks must
stay contiguous for ``MatMulNBits``.

Cost: ``K N`` row updates in ``K`` Python steps plus ``K^2 N`` in matrix products and a
``K^3`` Cholesky; memory two float64 ``[K, N]`` and one ``[K, K]``, in numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mixprec.weights.blocks import BlockQuant, BlockSpec, quantize_rtn

__all__ = ["BATCH", "DAMP", "gptq_quantize", "inverse_factor"]

#: Damping added to ``H``'s diagonal, as a share of its mean diagonal.
DAMP = 0.01
#: Rows whose updates are applied together (rounded to whole blocks).
BATCH = 128


class _Numpy:
    def array(self, a: np.ndarray) -> Any:
        return a

    def numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def round_clip(self, a: Any, high: int) -> Any:
        return np.clip(np.round(a), 0, high)

    def inverse_upper(self, h: np.ndarray) -> np.ndarray:
        lower = np.linalg.cholesky(h)
        inverse = np.linalg.inv(lower)  # H^-1 = L^-T L^-1
        return np.linalg.cholesky(inverse.T @ inverse).T


def _inverse_upper(h: np.ndarray, xp: _Numpy) -> Any:
    """``U`` with ``U^T U = (H + damping)^-1``; the damping grows tenfold (up to 3 times)
    while ``H`` is not positive definite."""
    base = float(np.mean(np.diag(h))) or 1.0
    for damp in (DAMP, DAMP * 10, DAMP * 100, 1.0):
        damped = h + np.eye(len(h)) * damp * base
        try:
            return xp.inverse_upper(damped)
        except np.linalg.LinAlgError:
            continue
    raise np.linalg.LinAlgError("the input's second moment is not positive definite")


def _dead(hessian: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    h = np.array(hessian, np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    return h, dead


def inverse_factor(hessian: np.ndarray) -> np.ndarray:
    """``U`` (upper triangular, ``U^T U`` the damped ``H^-1``) in numpy: computed once and
    given to :func:`gptq_quantize` for every weight reading the same input."""
    return np.asarray(_inverse_upper(_dead(hessian)[0], _Numpy()))


def gptq_quantize(
    weight: np.ndarray,
    spec: BlockSpec,
    hessian: np.ndarray,
    *,
    factor: np.ndarray | None = None,
) -> BlockQuant:
    """GPTQ of a ``[K, N]`` weight (module doc) for ``H = X^T X / n`` (``[K, K]``);
    ``factor``: :func:`inverse_factor` of the same ``H``, when already computed.

    Example:
        >>> q = gptq_quantize(w, BlockSpec(4, 32, False), x.T @ x / len(x))  # doctest: +SKIP
    """
    xp = _Numpy()
    k, n = weight.shape
    size = spec.block_size
    n_blocks = -(-k // size)
    h, dead = _dead(hessian)
    w = np.array(weight, np.float64)
    w[dead] = 0.0
    u = _inverse_upper(h, xp) if factor is None else xp.array(factor)
    w = xp.array(w)
    scales = np.zeros((n, n_blocks), np.float32)
    zeros = np.zeros((n, n_blocks), np.uint8)
    codes = np.zeros((n_blocks * size, n), np.uint8)
    batch = max(size, BATCH // size * size)
    for start in range(0, k, batch):
        end = min(start + batch, k)
        errors = xp.array(np.zeros((end - start, n)))
        for row in range(start, end):
            if row % size == 0:
                block = xp.numpy(w[row : min(row + size, k)]).astype(np.float32)
                first = quantize_rtn(block, spec)
                b = row // size
                scales[:, b], zeros[:, b] = first.scales[:, 0], first.zero_points[:, 0]
                scale = xp.array(scales[:, b].astype(np.float64))
                safe = xp.array(np.where(scales[:, b] == 0, 1.0, scales[:, b]))
                zero = xp.array(zeros[:, b].astype(np.float64))
                codes[b * size : (b + 1) * size] = zeros[:, b]  # the padding's code
            code = xp.round_clip(w[row] / safe + zero, spec.levels)
            codes[row] = xp.numpy(code)
            error = (w[row] - (code - zero) * scale) / u[row, row]
            errors[row - start] = error
            w[row + 1 : end] -= u[row, row + 1 : end][:, None] * error[None, :]
        w[end:] -= u[start:end, end:].T @ errors
    return BlockQuant(
        codes=np.ascontiguousarray(codes.T).reshape(n, n_blocks, size),
        scales=scales,
        zero_points=zeros,
        k=k,
        spec=spec,
    )
