"""Learned rounding of INT8 weights (``QuantizeConfig.rounding="learned"``).

:class:`LearnedRoundingPass` runs before :class:`~mixprec.int8.qdq.QuantizeQDQPass`, on
the FP32 graph whose nodes carry their INT8 decisions. For each Conv/Gemm/MatMul planned
INT8 it captures input rows from a few calibration samples
(:func:`~mixprec.calibrate.capture.capture_inputs`), computes the weight scale as the
QDQ pass will (:func:`~mixprec.int8.params.quantize_weight`), and learns the rounding
of every weight with AdaRound (:mod:`mixprec.int8.adaround`): each code up or down so
that the layer's output on the captured FP32 rows changes least (optionally against the
input a round-to-nearest INT8 copy of the model feeds the layer: ``inputs``). The codes
go to ``node.meta[ROUNDING]``; the QDQ pass writes them instead of
round-to-nearest where the weight and its scale are still the ones they were learned
for. The graph itself is not changed (``modified`` is False). The pass result says, per
layer, the output error on held-out rows before and after, and where the time went.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from mixprec.calibrate.capture import LayerInput, capture_inputs, layer_input
from mixprec.core.config import check_choice
from mixprec.core.constants import const_tensor
from mixprec.core.ops import weight_out_axis
from mixprec.int8.adaround import (
    ROUNDING,
    LearnedCodes,
    RoundingBudget,
    backend_name,
    learn_rounding,
)
from mixprec.int8.params import quantize_weight
from mixprec.int8.plan import INT8, runs_int8, weight_spec
from mixprec.int8.qdq import QuantizeQDQPass

__all__ = [
    "INPUTS",
    "ROUNDINGS",
    "SAMPLES",
    "LearnedRoundingPass",
    "LearnedRoundingResult",
]

#: What the fit takes as the INT8 layer's input (see :class:`LearnedRoundingPass`).
INPUTS = ("fp32", "quantized")
#: ``QuantizeConfig.rounding`` values.
ROUNDINGS = ("nearest", "learned")
#: Most calibration samples the layer inputs are captured from.
SAMPLES = 16


@dataclasses.dataclass
class LearnedRoundingResult(ir.passes.PassResult):
    """What learned rounding did.

    ``layers``: node -> (nearest, learned) relative output error on held-out rows
    (squared error over the FP32 output's energy), for the layers that learned;
    ``kept_nearest``: node -> why it kept round-to-nearest.
    """

    backend: str = ""
    samples: int = 0
    layers: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    kept_nearest: dict[str, str] = dataclasses.field(default_factory=dict)
    changed: int = 0
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The report's ``quantization["rounding"]`` (plain JSON values)."""
        before = [b for b, _ in self.layers.values()]
        after = [a for _, a in self.layers.values()]
        return {
            "method": "adaround",
            "backend": self.backend,
            "samples": self.samples,
            "layers_learned": len(self.layers),
            "layers_nearest": len(self.kept_nearest),
            "codes_changed": self.changed,
            "median_rel_error_nearest": statistics.median(before) if before else None,
            "median_rel_error_learned": statistics.median(after) if after else None,
            "mean_rel_error_nearest": statistics.fmean(before) if before else None,
            "mean_rel_error_learned": statistics.fmean(after) if after else None,
            "layers": {k: {"nearest": b, "learned": a} for k, (b, a) in self.layers.items()},
            "kept_nearest": dict(self.kept_nearest),
            "seconds": dict(self.seconds),
        }

    def note(self) -> str:
        """One line for the report's notes."""
        total = sum(self.seconds.values())
        if not self.layers:
            why = next(iter(self.kept_nearest.values()), "no INT8 layer with a constant weight")
            return f"learned rounding: no layer learned ({why}); round-to-nearest kept"
        before = statistics.fmean(b for b, _ in self.layers.values())
        after = statistics.fmean(a for _, a in self.layers.values())
        return (
            f"learned rounding (AdaRound, {self.backend}): {len(self.layers)} layer(s) on "
            f"{self.samples} sample(s), {len(self.kept_nearest)} kept nearest; mean layer "
            f"output error {before:.3g} -> {after:.3g} on held-out rows; {total:.1f} s"
        )


def _as_groups(node: ir.Node, weight: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The weight as ``[G, O/G, D]`` (rows: output channels) and the group count."""
    if node.op_type == "Conv":
        attr = node.attributes.get("group")
        group = attr.as_int() if attr is not None else 1
        if group < 1 or weight.shape[0] % group:
            return None
        return weight.reshape(group, weight.shape[0] // group, -1), group
    axis = weight_out_axis(node, weight.ndim)
    if weight.ndim != 2 or axis is None:
        return None
    return (weight if axis == 0 else weight.T)[None], 1


def _from_groups(node: ir.Node, codes: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Conv" or weight_out_axis(node, len(shape)) == 0:
        return codes.reshape(shape)
    return np.ascontiguousarray(codes[0].T)


def _group_rows(layer: LayerInput, rows: np.ndarray, group: int, width: int) -> np.ndarray | None:
    """Captured rows as ``[G, n, D]`` (None when they do not fit the weight)."""
    flat = rows.reshape(len(rows), -1)
    if flat.shape[1] != group * width:
        return None
    if layer.kind == "patches":
        return np.ascontiguousarray(flat.reshape(len(rows), group, width).transpose(1, 0, 2))
    return flat[None]


class LearnedRoundingPass(ir.passes.InPlacePass):
    """AdaRound codes for the INT8 Conv/Gemm/MatMul weights (analysis only).

    Args:
        samples: calibration feed dicts the layer inputs are captured from (the first
            :data:`SAMPLES` of the calibration data; read once per group of layers).
            Each weight is quantized as its node's spec says (per channel, code bound),
            as the QDQ pass will.
        inputs: what the fit takes as the INT8 layer's input: "fp32", the FP32 rows
            (the output error of the weights alone), or "quantized", the layer's input in
            a copy of the model quantized with round-to-nearest, captured at the same
            positions (AdaRound's asymmetric reconstruction). At 8 bits the latter
            hurts: that input's own error (10-20% deep in PP-OCR cls) dominates, and the
            best up/down choices against a noisy input shrink the weights (least
            squares' attenuation), a loss of gain that compounds through the network:
            all-INT8 cls rel L2 0.124 -> 0.210, det 0.167 -> 0.199.
        budget: AdaRound's per-layer budget.
        backend: "auto" (torch when importable), "torch" or "numpy".
        seed: the row sampling seed.
    """

    def __init__(
        self,
        samples: Sequence[Any],
        *,
        inputs: str = "fp32",
        budget: RoundingBudget | None = None,
        backend: str = "auto",
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_choice("inputs", inputs, INPUTS)
        self.samples = list(samples)
        self.inputs = inputs
        self.budget = budget or RoundingBudget()
        self.backend = backend_name(backend)
        self.seed = seed

    def call(self, model: ir.Model) -> LearnedRoundingResult:
        result = LearnedRoundingResult(model, modified=False, backend=self.backend)
        result.samples = len(self.samples)
        nodes: dict[str, ir.Node] = {}
        layers: list[LayerInput] = []
        for node in model.graph:
            layer = layer_input(node) if runs_int8(node) else None
            if layer is not None and layer.node and layer.node not in nodes:
                node.meta.pop(ROUNDING, None)
                nodes[layer.node] = node
                layers.append(layer)
        if not self.samples or not layers:
            result.kept_nearest = dict.fromkeys(nodes, "no calibration samples")
            return result
        start = time.perf_counter()
        fitting = 0.0
        paired = self._quantized_inputs(model, layers) if self.inputs == "quantized" else None
        for layer, rows in capture_inputs(model, self.samples, layers, seed=self.seed):
            read = next(paired)[1] if paired is not None else None
            clock = time.perf_counter()
            self._learn(nodes[layer.node], layer, (rows, read), result)
            fitting += time.perf_counter() - clock
        result.seconds = {"capture": time.perf_counter() - start - fitting, "fit": fitting}
        return result

    def _quantized_inputs(
        self, model: ir.Model, layers: list[LayerInput]
    ) -> Iterator[tuple[LayerInput, np.ndarray]]:
        """Each layer's input in a round-to-nearest INT8 copy of ``model``, captured with
        the same seed, so at the same positions as the FP32 rows."""
        copy = ir.from_proto(ir.to_proto(model))
        copy.meta.update(model.meta)
        decided = {n.name: n.meta[INT8] for n in model.graph if INT8 in n.meta}
        for node in copy.graph:
            if node.name in decided:
                node.meta[INT8] = decided[node.name]
        QuantizeQDQPass()(copy)
        common.RemoveUnusedNodesPass()(copy)  # the FP32 weights the int8 ones replaced
        reads = {n.name: n.inputs[0] for n in copy.graph if n.name and n.inputs}
        paired = []
        for layer in layers:
            value = reads.get(layer.node)
            name = value.name if value is not None and value.name else layer.value
            paired.append(dataclasses.replace(layer, value=name))
        return capture_inputs(copy, self.samples, paired, seed=self.seed)

    def _learn(
        self,
        node: ir.Node,
        layer: LayerInput,
        rows: tuple[np.ndarray, np.ndarray | None],
        result: LearnedRoundingResult,
    ) -> None:
        name = layer.node
        tensor = const_tensor(node.inputs[1]) if node.inputs[1] is not None else None
        weight = np.asarray(tensor.numpy(), np.float32) if tensor is not None else None
        grouped = _as_groups(node, weight) if weight is not None else None
        if weight is None or grouped is None:
            result.kept_nearest[name] = "weight layout not handled"
            return
        spec = weight_spec(node)
        axis = weight_out_axis(node, weight.ndim) if spec.per_channel else None
        quantized = quantize_weight(weight, axis, qmax=spec.qmax)
        matrix, group = grouped
        x = _group_rows(layer, rows[0], group, matrix.shape[2])
        read = _group_rows(layer, rows[1], group, matrix.shape[2]) if rows[1] is not None else x
        if isinstance(quantized, str) or x is None or x.shape[1] == 0:
            result.kept_nearest[name] = quantized if isinstance(quantized, str) else "no input rows"
            return
        if read is None or read.shape != x.shape:
            result.kept_nearest[name] = "the INT8 model's input rows do not pair with the FP32 ones"
            return
        data, params = quantized
        scale = params.scale.reshape(group, -1, 1) if params.scale.ndim else params.scale
        fit = learn_rounding(
            matrix, scale, x, read, qmax=spec.qmax, budget=self.budget, backend=self.backend
        )
        if fit.why or not fit.changed:
            result.kept_nearest[name] = fit.why or "round-to-nearest was already best"
            return
        codes = _from_groups(node, fit.codes, weight.shape)
        node.meta[ROUNDING] = LearnedCodes(codes, params.scale)
        energy = fit.energy if fit.energy > 0 and math.isfinite(fit.energy) else 1.0
        result.layers[name] = (fit.nearest / energy, fit.learned / energy)
        result.changed += int((codes != data).sum())
