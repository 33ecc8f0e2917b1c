"""What the calibrate step recorded of a quantized MatMul's input (``node.meta`` key
:data:`LAYER_INPUTS`), which the data-aware methods read: its second moment ``H``."""

from __future__ import annotations

import dataclasses

import numpy as np

from mixprec.weights.blocks import BlockQuant, BlockSpec

__all__ = ["LAYER_INPUTS", "LayerData"]

#: ``node.meta`` key of what the calibrate stage measured of a MatMul's input, for the
#: methods that read data (absent for a data-free run).
LAYER_INPUTS = "mixprec.weights.layer_inputs"


@dataclasses.dataclass
class LayerData:
    """What the calibrate step recorded for one MatMul (``node.meta[LAYER_INPUTS]``): its
    input's ``H = X^T X / n`` (float32 ``[K, K]``, shared by MatMuls reading one input),
    the rows it came from, and this weight's quantizations by (method, spec), made once
    for the sensitivity ranking and the rewrite alike."""

    hessian: np.ndarray
    rows: int
    cache: dict[tuple[str, BlockSpec], BlockQuant] = dataclasses.field(default_factory=dict)
    #: what the MatMuls of one input share (GPTQ's factor of ``H^-1``), by name
    shared: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def importance(self) -> np.ndarray:
        """``diag(H)``: each input channel's mean square (``[K]``, float32)."""
        return np.diag(self.hessian).astype(np.float32)
