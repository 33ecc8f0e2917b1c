"""The weight quantization methods, by name: the seam a data-aware method plugs into.

A method turns one float ``[K, N]`` weight into a :class:`~mixprec.weights.blocks.BlockQuant`
for a :class:`~mixprec.weights.blocks.BlockSpec`. It gets the statistics the calibrate
stage recorded for that node's input (``node.meta[LAYER_INPUTS]``; None when the method
needs no data or none was given), so GPTQ (a Hessian ``X^T X``) or an AWQ-style scale
search (per-channel activation magnitudes) registers here with :func:`register_method`
and its calibrate pass, and RTN stays the fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from mixprec.core.errors import MixprecError
from mixprec.weights.blocks import BlockQuant, BlockSpec, quantize_rtn
from mixprec.weights.gptq import gptq_quantize, inverse_factor

__all__ = [
    "AUTO",
    "LAYER_INPUTS",
    "METHODS",
    "LayerData",
    "WeightMethod",
    "register_method",
    "resolve_method",
]

#: ``node.meta`` key of what the calibrate stage measured of a MatMul's input, for the
#: methods that read data (absent for RTN).
LAYER_INPUTS = "mixprec.weights.layer_inputs"
#: The method name that picks the best available one (:func:`resolve_method`).
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class WeightMethod:
    """A quantization method.

    Attributes:
        name: as ``--weight-method`` spells it.
        quantize: ``(weight [K, N], spec, layer_inputs or None) -> BlockQuant``.
        needs_data: it reads calibration statistics (without data it is not chosen by
            "auto", and asking for it by name is an error).
        summary: one line for the report and ``--help``.
    """

    name: str
    quantize: Callable[[np.ndarray, BlockSpec, object | None], BlockQuant]
    needs_data: bool
    summary: str

    def used_for(self, inputs: object | None) -> str:
        """The method that runs on a layer with these statistics (its
        ``node.meta[LAYER_INPUTS]``): a data-aware method rounds to nearest ("rtn") on a
        layer that has none (a tied lm_head, an embedding table, or no statistics
        collected), as :func:`_gptq` does."""
        if self.needs_data and not isinstance(inputs, LayerData):
            return "rtn"
        return self.name


@dataclasses.dataclass
class LayerData:
    """What the calibrate step recorded for one MatMul (``node.meta[LAYER_INPUTS]``): its
    input's ``H = X^T X / n`` (float64 ``[K, K]``, shared by MatMuls reading one input),
    the rows it came from, and this weight's quantizations by (method, spec), made once
    for the sensitivity ranking and the rewrite alike."""

    hessian: np.ndarray
    rows: int
    cache: dict[tuple[str, BlockSpec], BlockQuant] = dataclasses.field(default_factory=dict)
    #: what the MatMuls of one input share (GPTQ's factor of ``H^-1``), by name
    shared: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _cached(
    name: str, inputs: object | None, spec: BlockSpec, make: Callable[[], BlockQuant]
) -> BlockQuant:
    if not isinstance(inputs, LayerData):
        return make()
    key = (name, spec)
    if key not in inputs.cache:
        inputs.cache[key] = make()
    return inputs.cache[key]


def _rtn(weight: np.ndarray, spec: BlockSpec, inputs: object | None) -> BlockQuant:
    return _cached("rtn", inputs, spec, lambda: quantize_rtn(weight, spec))


def _gptq(weight: np.ndarray, spec: BlockSpec, inputs: object | None) -> BlockQuant:
    """GPTQ where the layer's input statistics were recorded; RTN where not (a tied
    lm_head, whose codes also serve the embedding)."""
    if not isinstance(inputs, LayerData):
        return quantize_rtn(weight, spec)

    def make() -> BlockQuant:
        if "gptq" not in inputs.shared:
            inputs.shared["gptq"] = inverse_factor(inputs.hessian)
        return gptq_quantize(weight, spec, inputs.hessian, factor=inputs.shared["gptq"])

    return _cached("gptq", inputs, spec, make)


#: Every method by name, in order of preference for "auto" (the first usable wins). RTN
#: comes first: on SmolLM2-135M (int4, block 32, 8 windows of 256 tokens) GPTQ lowered
#: the next-token KL by 20% (0.370 -> 0.296) but perplexity only from +31.2% to +29.7%
#: of FP32's, at 2.2x the time; mixed 4/8 bits and the guard's repair are what hold the
#: accuracy, so GPTQ is there on request (``--weight-method gptq``).
METHODS: dict[str, WeightMethod] = {
    "rtn": WeightMethod("rtn", _rtn, False, "round to nearest: each block's range sets its scale"),
    "gptq": WeightMethod(
        "gptq",
        _gptq,
        True,
        "GPTQ: rows rounded in order, each one's error spread over the rest by the "
        "inverse of the input's X^T X (calibration data)",
    ),
}


def register_method(method: WeightMethod, *, preferred: bool = False) -> None:
    """Add a method (``preferred``: "auto" tries it before the others)."""
    if preferred:
        others = dict(METHODS)
        METHODS.clear()
        METHODS[method.name] = method
        METHODS.update({k: v for k, v in others.items() if k != method.name})
    else:
        METHODS[method.name] = method


def resolve_method(name: str, *, has_data: bool) -> tuple[WeightMethod, str]:
    """The method to run and why: a name as given, or "auto": the first method in
    :data:`METHODS` whose data needs are met (RTN when no calibration data was given)."""
    if name != AUTO:
        method = METHODS[name]
        if method.needs_data and not has_data:
            raise MixprecError(
                f"weight method {name} reads calibration data: give --calibration-data "
                "(calibration_data=), or use rtn"
            )
        return method, f"weight method {name}: {method.summary} (as asked)"
    skipped = []
    for method in METHODS.values():
        if method.needs_data and not has_data:
            skipped.append(method.name)
            continue
        why = f" ({', '.join(skipped)}: no calibration data)" if skipped else ""
        return method, f"weight method auto -> {method.name}: {method.summary}{why}"
    raise AssertionError("the rtn method is always registered")
