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
    for the sensitivity ranking and the rewrite alike.

    An input that activation-aware scaling divided by ``s`` keeps the measured ``H`` and
    ``s``: its :attr:`hessian`, ``H / (s s^T)``, is made when read and not kept, so a model
    holds one ``[K, K]`` array per input, scaled or not (a 0.5B decoder's down_proj inputs
    alone are 24 arrays of 95 MB)."""

    measured: np.ndarray
    rows: int
    cache: dict[tuple[str, BlockSpec], BlockQuant] = dataclasses.field(default_factory=dict)
    #: what the MatMuls of one input share (GPTQ's factor of ``H^-1``), by name
    shared: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    #: the activation-aware scale the input was divided by (None: not scaled)
    scale: np.ndarray | None = None

    @property
    def hessian(self) -> np.ndarray:
        """``H`` of the input as the MatMul now reads it (scaled: made anew each time)."""
        if self.scale is None:
            return self.measured
        return self.measured / np.outer(self.scale, self.scale)

    def for_slice(self) -> LayerData:
        """The same statistics for a slice of the weight's columns: ``H``, ``s`` and the
        shared factor kept, the cache of whole-weight codes left out (a slice's codes are
        not the weight's)."""
        return dataclasses.replace(self, cache={})

    def importance(self) -> np.ndarray:
        """``diag(H)``: each input channel's mean square (``[K]``, float32)."""
        diagonal = np.diag(self.measured)
        if self.scale is not None:
            diagonal = diagonal / self.scale**2
        return diagonal.astype(np.float32)
