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
from mixprec.weights.inputs import LayerData
from mixprec.weights.scale_search import quantize_search

__all__ = [
    "AUTO",
    "METHODS",
    "WeightMethod",
    "register_method",
    "resolve_method",
]

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
        scales: activation-aware scaling (:mod:`mixprec.weights.awq`) runs on the graph
            before the weights are rounded (the statistics it reads are then those of the
            scaled inputs).
        fallback: what a data-aware method runs on a layer without statistics.
    """

    name: str
    quantize: Callable[[np.ndarray, BlockSpec, object | None], BlockQuant]
    needs_data: bool
    summary: str
    scales: bool = False
    fallback: str = "search"

    def used_for(self, inputs: object | None) -> str:
        """The method that runs on a layer with these statistics (its
        ``node.meta[LAYER_INPUTS]``): a data-aware method runs its ``fallback`` on a
        layer that has none (a tied lm_head, an embedding table, or no statistics
        collected)."""
        if self.needs_data and not isinstance(inputs, LayerData):
            return self.fallback
        return self.name


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
    """GPTQ where the layer's input statistics were recorded; the data-free search where
    not (a tied lm_head, whose codes also serve the embedding)."""
    if not isinstance(inputs, LayerData):
        return quantize_search(weight, spec)

    def make() -> BlockQuant:
        if "gptq" not in inputs.shared:
            inputs.shared["gptq"] = inverse_factor(inputs.hessian)
        return gptq_quantize(weight, spec, inputs.hessian, factor=inputs.shared["gptq"])

    return _cached("gptq", inputs, spec, make)


def _search(weight: np.ndarray, spec: BlockSpec, inputs: object | None) -> BlockQuant:
    """The searched scales (:mod:`mixprec.weights.scale_search`), each input channel's error
    weighted by its mean square where the layer's statistics were recorded."""
    if not isinstance(inputs, LayerData):
        return quantize_search(weight, spec)
    return _cached(
        "search", inputs, spec, lambda: quantize_search(weight, spec, inputs.importance())
    )


#: Every method by name, in order of preference for "auto" (the first usable wins).
METHODS: dict[str, WeightMethod] = {
    "awq": WeightMethod(
        "awq",
        _search,
        True,
        "activation-aware scaling folded into the op before each layer, then searched "
        "scales weighted by the input channels' mean square (calibration data)",
        scales=True,
    ),
    "search": WeightMethod(
        "search",
        _search,
        False,
        "searched scales: each block tries 11 scales around its range's and keeps the "
        "least weighted squared error (data-free, k-quant style)",
    ),
    "rtn": WeightMethod("rtn", _rtn, False, "round to nearest: each block's range sets its scale"),
    "gptq": WeightMethod(
        "gptq",
        _gptq,
        True,
        "GPTQ: rows rounded in order, each one's error spread over the rest by the "
        "inverse of the input's X^T X (calibration data)",
    ),
    "awq-gptq": WeightMethod(
        "awq-gptq",
        _gptq,
        True,
        "activation-aware scaling, then GPTQ on the scaled inputs (calibration data)",
        scales=True,
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
