"""Bias correction: undo the mean output shift that weight rounding causes.

Quantizing a weight ``W`` to ``W + dW`` shifts a node's output by ``dW @ E[x]`` on
average, a systematic error that per-tensor and depthwise weights (few weights per
output channel, whose rounding errors do not average out) make large. With the
per-channel mean ``E[x]`` of the node's activation input, measured during calibration,
the bias absorbs it: ``b' = b - dW @ E[x]`` (weight-only bias correction; the shift that
activation rounding causes would need a run of the quantized model).
"""

from __future__ import annotations

import numpy as np

__all__ = ["output_shift"]


def output_shift(
    op_type: str,
    weight: np.ndarray,
    dequantized: np.ndarray,
    mean: np.ndarray,
    *,
    group: int = 1,
    trans_b: bool = False,
) -> np.ndarray | None:
    """Per-output-channel mean shift ``dW @ E[x]`` of a Conv or Gemm, or None when the
    shapes do not fit (the mean of another layout, a spatial-only mean)."""
    delta = np.asarray(dequantized, np.float64) - np.asarray(weight, np.float64)
    mean = np.asarray(mean, np.float64).reshape(-1)
    if op_type == "Conv":
        if delta.ndim < 2 or group < 1 or delta.shape[0] % group:
            return None
        per_group = delta.shape[1]
        if mean.size != per_group * group:
            return None
        summed = delta.reshape(delta.shape[0], per_group, -1).sum(axis=2)  # [O, C/g]
        groups = np.arange(delta.shape[0]) // (delta.shape[0] // group)
        return (summed * mean.reshape(group, per_group)[groups]).sum(axis=1)
    if op_type == "Gemm" and delta.ndim == 2:
        matrix = delta if trans_b else delta.T  # [N, K]
        if mean.size != matrix.shape[1]:
            return None
        return matrix @ mean
    return None
