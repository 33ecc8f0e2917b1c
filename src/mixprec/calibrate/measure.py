"""Analysis passes that measure the FP32 model: ranges (calibration) and MACs.

Both leave the model's content as it is (``modified`` is False) and attach what they
measured to the model: the calibration to ``model.meta[CALIBRATION]``, each node's
multiply-accumulates to ``node.meta[MACS]``. Painting, reports and tuning read them there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import onnx_ir as ir

from mixprec.calibrate.runner import CalibrationResult, calibrate
from mixprec.core.constants import const_tensor
from mixprec.core.graphs import iter_nodes
from mixprec.core.layers import takes_bias
from mixprec.core.registry import node_info
from mixprec.inputs.feeds import guessed_dims, make_inputs, resolve_input_shapes
from mixprec.io.protos import weightless_proto
from mixprec.passes.macs import concrete_shapes, count_macs
from mixprec.runtime.fit import fit_shapes

__all__ = [
    "CALIBRATION",
    "MACS",
    "SHAPES",
    "CalibratePass",
    "Calibration",
    "CountMacsPass",
    "calibration_of",
]

#: ``model.meta`` keys: the calibration, and the best known shapes by value name.
CALIBRATION = "mixprec.calibration"
SHAPES = "mixprec.shapes"
#: ``node.meta`` key: the node's multiply-accumulates.
MACS = "mixprec.macs"


@dataclasses.dataclass
class Calibration:
    """What the FP32 model's reference run measured.

    Attributes:
        absmax: ``max |x|`` of activations by value name (empty without a run).
        shapes: tensor shapes seen in the run, by value name.
        input_shapes: the concrete shapes of the graph inputs used.
        samples: how many samples (feed dicts) were run; 0 without a run.
        notes: what the report should say about inputs and shapes.
        observer: what was recorded per tensor ("absmax", "minmax" or "histogram").
        stats: the observers' statistics by value name (min/max, histograms).
        channel_means: per-channel means of Conv/Gemm inputs, when asked for.
    """

    absmax: dict[str, float] = dataclasses.field(default_factory=dict)
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    input_shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    samples: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    observer: str = "absmax"
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    channel_means: dict[str, Any] = dataclasses.field(default_factory=dict)


def _weighted_inputs(model: ir.Model) -> dict[str, int]:
    """Activation input -> channel axis of the main graph's Conv/Gemm with a constant
    weight (what bias correction needs the per-channel mean of)."""
    found: dict[str, int] = {}
    for node in model.graph:
        # the INT8 layers with a bias to correct (Conv, Gemm; a MatMul has none)
        if not takes_bias(node) or node_info(node).int8 != "weighted" or len(node.inputs) < 2:
            continue
        x, w = node.inputs[0], node.inputs[1]
        if x is None or w is None or not x.name or const_tensor(w) is None:
            continue
        if x.dtype != ir.DataType.FLOAT:
            continue
        if node.op_type == "Gemm":
            trans_a = node.attributes.get("transA")
            found[x.name] = 0 if trans_a is not None and trans_a.as_int() else 1
        else:
            found[x.name] = 1
    return found


class CalibratePass(ir.passes.InPlacePass):
    """Run the FP32 model in ONNX Runtime and record activation ranges (analysis only).

    Args:
        shapes: concrete shapes for symbolic input dims, by input name.
        data: the inputs to run: one feed dict, or an iterable of them (streamed);
            None generates one seeded sample from the signature.
        observer: "absmax", "minmax" or "histogram" (see ``mixprec.calibrate.observers``).
        run: False records only the input shapes (``--no-calibrate``).
        channel_means: also average the per-channel means of the activation inputs of
            Conv/Gemm with constant weights (for INT8 bias correction).
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]] | None = None,
        data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
        *,
        observer: str = "absmax",
        run: bool = True,
        channel_means: bool = False,
    ) -> None:
        super().__init__()
        self.channel_means = channel_means
        self.shapes = shapes
        self.data = data
        self.observer = observer
        self.run = run

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        concrete, notes = resolve_input_shapes(model, self.shapes)
        result = Calibration(input_shapes=concrete, observer=self.observer)
        if not self.run:
            result.notes.extend(notes)
            model.meta[CALIBRATION] = result
            return ir.passes.PassResult(model, modified=False)

        # The model itself is read (weights are handed to ORT in memory), not copied.
        means = _weighted_inputs(model) if self.channel_means else None

        def run_on(data: Any, shapes_out: dict[str, Any]) -> CalibrationResult:
            return calibrate(
                model, data, observer=self.observer, shapes_out=shapes_out, channel_means=means
            )

        if self.data is None:
            run, fitted, more = self._run_generated(model, concrete, run_on, result.shapes)
            result.input_shapes = fitted
            result.notes.extend(notes + more)
            source = "generated inputs (images-like floats in [0,1))"
        else:
            run = run_on(self.data, result.shapes)
            source = "the given inputs"
        given = [v.name for v in model.graph.inputs if v.name in run.shapes]
        if self.data is not None:
            result.input_shapes = {k: list(run.shapes[k]) for k in given}
            source += f" ({', '.join(given)})"
        result.notes.append(f"calibrated on {run.samples} sample(s) of {source}")
        result.absmax = run.absmax()
        result.stats = run.stats
        result.samples = run.samples
        result.channel_means = run.channel_means
        model.meta[CALIBRATION] = result
        return ir.passes.PassResult(model, modified=False)

    def _run_generated(
        self,
        model: ir.Model,
        shapes: dict[str, list[int]],
        run_on: Callable[[Any, dict[str, Any]], CalibrationResult],
        observed: dict[str, Any],
    ) -> tuple[CalibrationResult, dict[str, list[int]], list[str]]:
        """Calibrate on generated inputs, learning from ONNX Runtime's refusals
        (:func:`~mixprec.runtime.fit.fit_shapes`): the run, the shapes used, the notes;
        ``observed`` gets the shapes the accepted run saw."""

        def attempt(tried: dict[str, list[int]]) -> tuple[CalibrationResult, list[str]]:
            feeds, more = make_inputs(model, shapes=tried, seed=0)
            observed.clear()
            return run_on(feeds, observed), more

        (run, more), fitted, fit_notes = fit_shapes(
            shapes, guessed_dims(model, self.shapes), attempt
        )
        return run, fitted, more + fit_notes


def calibration_of(model: ir.Model) -> Calibration:
    """The calibration attached by :class:`CalibratePass` (empty when none ran)."""
    found = model.meta.get(CALIBRATION)
    return found if isinstance(found, Calibration) else Calibration()


def node_macs(model: ir.Model) -> dict[str, int]:
    """Each node's multiply-accumulates by name (:class:`CountMacsPass` on ``model``, whose
    meta it fills; nothing else changes)."""
    CountMacsPass()(model)
    return {n.name or "": int(n.meta.get(MACS, 0)) for n in model.graph}


class CountMacsPass(ir.passes.InPlacePass):
    """Shapes of every value, inferred from the calibration's input shapes and overridden
    by the shapes the run observed, in ``model.meta[SHAPES]`` (for shape-dependent rules),
    and each Conv, MatMul and Gemm node's multiply-accumulates in ``node.meta[MACS]``.
    Analysis only.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        calibration = calibration_of(model)
        proto, _ = weightless_proto(model, with_arrays=False)
        shaped, inferred = concrete_shapes(proto, calibration.input_shapes)
        shapes: dict[str, Sequence[int | None]] = {**inferred, **calibration.shapes}
        model.meta[SHAPES] = shapes
        macs = count_macs(shaped, shapes)
        for node in iter_nodes(model.graph):
            node.meta[MACS] = macs.get(node.name or "", 0)
        return ir.passes.PassResult(model, modified=False)
