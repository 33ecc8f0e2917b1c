"""How a value is quantized, per value: pt2e's quantization spec, filled by a backend
quantizer.

The annotate pass (:class:`~mixprec.int8.plan.AnnotateInt8Pass`) asks a
:class:`BackendQuantizer` for the spec of each INT8 node's activations and of its weight,
and records both in the node's :class:`~mixprec.int8.plan.Int8Decision`. The apply passes
(QDQ, dynamic INT8, learned rounding) and the tuner's fake quantization read the spec; none
holds a flag of its own. A quantizer for another engine or CPU is a different
:class:`BackendQuantizer`: the passes do not change.

The calibration's observer is not in the spec yet: the ranges are measured before annotate
runs (:class:`~mixprec.calibrate.measure.CalibratePass`, one observer for the model, chosen
from the range method by :meth:`~mixprec.int8.config.QuantizeConfig.base`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.layers import is_layer

__all__ = ["DYNAMIC_ACTIVATION", "FULL_RANGE", "REDUCED_RANGE", "BackendQuantizer", "QuantSpec"]

#: The largest code magnitude of an int8 weight.
FULL_RANGE = 127
#: 7-bit weights: AVX2 kernels without VNNI add pairs of u8 x s8 products into int16
#: (VPMADDUBSW), which saturates with full-range weights.
REDUCED_RANGE = 63

_DTYPES = ("uint8", "int8")


@dataclass(frozen=True)
class QuantSpec:
    """How one value is quantized (pt2e's ``QuantizationSpec``).

    Attributes:
        dtype: "uint8" (asymmetric, a zero point) or "int8" (symmetric, zero point 0).
        qmax: a weight's largest code magnitude (127, or 63 in reduced range); an
            activation's codes span its dtype (0..255, or -127..127 symmetric).
        per_channel: one scale per output channel, on the layer's own channel axis
            (:func:`~mixprec.core.ops.weight_out_axis`); else one per tensor.
        method: how the range is chosen from the calibration ("minmax", "entropy",
            "percentile" or "mse"; weights: always their min/max).
    """

    dtype: str
    qmax: int = FULL_RANGE
    per_channel: bool = False
    method: str = "minmax"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise MixprecError(f"a quantization spec's dtype is uint8 or int8, not {self.dtype!r}")
        if self.qmax not in (FULL_RANGE, REDUCED_RANGE):
            raise MixprecError(f"qmax must be {FULL_RANGE} or {REDUCED_RANGE}, not {self.qmax}")

    @property
    def unsigned(self) -> bool:
        return self.dtype == "uint8"


#: Dynamic INT8's activations: ONNX Runtime's DynamicQuantizeLinear quantizes them to
#: uint8 at run time, from each run's own min/max, whatever the static specs say.
DYNAMIC_ACTIVATION = QuantSpec("uint8")


@dataclass(frozen=True)
class BackendQuantizer:
    """What one engine's integer kernels take, as a spec per value.

    The default (:meth:`~mixprec.int8.config.QuantizeConfig.quantizer`) is ONNX Runtime's
    CPU QDQ kernels: uint8 activations (int8 on request), symmetric int8 weights per output
    channel, reduced range where the CPU's kernels saturate.

    Attributes:
        activation: the spec of every activation an INT8 node reads or writes.
        weight: the spec of a weighted layer's constant weight.
    """

    activation: QuantSpec
    weight: QuantSpec

    def specs(self, node: ir.Node) -> tuple[QuantSpec, QuantSpec | None]:
        """The specs of ``node``'s activations and of its weight (None: it has none)."""
        return self.activation, self.weight if is_layer(node) else None
