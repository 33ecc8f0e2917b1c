"""Analysis passes that measure the FP32 model: ranges (calibration) and MACs.

Both leave the model's content as it is (``modified`` is False) and attach what they
measured to the model: the calibration to ``model.meta[CALIBRATION]``, each node's
multiply-accumulates to ``node.meta[MACS]``. Painting, reports and tuning read them there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from mixprec._errors import MixprecError
from mixprec._graphs import iter_nodes
from mixprec._protos import weightless_proto
from mixprec._report import concrete_shapes, count_macs

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

#: Symbolic dims without a user shape: the first dim (batch) gets 1, others this value.
DEFAULT_SYMBOLIC_DIM = 64


@dataclasses.dataclass
class Calibration:
    """What the FP32 model's reference run measured.

    Attributes:
        absmax: ``max |x|`` of activations by value name (empty without a run).
        shapes: tensor shapes seen in the run, by value name.
        input_shapes: the concrete shapes of the graph inputs used.
        samples: how many samples (feed dicts) were run; 0 without a run.
        notes: what the report should say about inputs and shapes.
    """

    absmax: dict[str, float] = dataclasses.field(default_factory=dict)
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    input_shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    samples: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def input_shapes(
    proto: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None
) -> tuple[dict[str, list[int]], list[str]]:
    """Concrete shapes of the graph inputs: declared dims, the user's shapes, else the
    documented defaults (1 for a symbolic first dim, :data:`DEFAULT_SYMBOLIC_DIM` others).
    """
    shapes = dict(shapes or {})
    init_names = {t.name for t in proto.graph.initializer}
    known = {i.name for i in proto.graph.input}
    for name in shapes:
        if name not in known:
            raise MixprecError(
                f"--shape names {name!r}, which is not a model input "
                f"(inputs: {', '.join(sorted(known - init_names))})"
            )
    out: dict[str, list[int]] = {}
    notes: list[str] = []
    for graph_input in proto.graph.input:
        if graph_input.name in init_names or not graph_input.type.HasField("tensor_type"):
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if graph_input.name in shapes:
            given = [int(d) for d in shapes[graph_input.name]]
            if graph_input.type.tensor_type.HasField("shape") and len(given) != len(dims):
                raise MixprecError(
                    f"--shape {graph_input.name}: rank {len(given)} but the model declares "
                    f"rank {len(dims)}"
                )
            out[graph_input.name] = given
            continue
        concrete = []
        for k, d in enumerate(dims):
            if d.HasField("dim_value") and d.dim_value > 0:
                concrete.append(int(d.dim_value))
            else:
                value = 1 if k == 0 else DEFAULT_SYMBOLIC_DIM
                label = d.dim_param or "?"
                notes.append(
                    f"input {graph_input.name!r} dim {k} ({label}) is symbolic: used {value} "
                    "(give --shape to choose)"
                )
                concrete.append(value)
        out[graph_input.name] = concrete
    return out, notes


class CalibratePass(ir.passes.InPlacePass):
    """Run the FP32 model in ONNX Runtime and record activation ranges (analysis only).

    Args:
        shapes: concrete shapes for symbolic input dims, by input name.
        data: the inputs to run: one feed dict, or an iterable of them; None generates
            one seeded sample from the signature.
        run: False records only the input shapes (``--no-calibrate``).
    """

    def __init__(
        self,
        shapes: Mapping[str, Sequence[int]] | None = None,
        data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
        *,
        run: bool = True,
    ) -> None:
        super().__init__()
        self.shapes = shapes
        self.data = data
        self.run = run

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        # Weights stay in ``model``: the run reads placeholders, ORT gets arrays in memory.
        proto, external = weightless_proto(model, with_arrays=self.run)
        concrete, notes = input_shapes(proto, self.shapes)
        result = Calibration(input_shapes=concrete)
        if not self.run:
            result.notes.extend(notes)
            model.meta[CALIBRATION] = result
            return ir.passes.PassResult(model, modified=False)

        from mixprec import _runtime  # onnxruntime is imported only when calibrating

        if self.data is not None:
            if not isinstance(self.data, Mapping):
                raise MixprecError("calibration_data must be a dict of input arrays")
            feeds = {k: np.asarray(v) for k, v in self.data.items()}
            result.input_shapes = {k: list(v.shape) for k, v in feeds.items()}
            result.notes.append(f"calibrated on the given inputs ({', '.join(sorted(feeds))})")
        else:
            feeds, more = _runtime.make_inputs(proto, shapes=concrete, seed=0)
            result.notes.extend(notes + more)
            result.notes.append("calibrated on generated inputs (images-like floats in [0,1))")
        for name, array in feeds.items():
            result.shapes[name] = list(np.shape(array))
        result.absmax = _runtime.collect_absmax(
            proto, feeds, shapes_out=result.shapes, external=external
        )
        result.samples = 1
        model.meta[CALIBRATION] = result
        return ir.passes.PassResult(model, modified=False)


def calibration_of(model: ir.Model) -> Calibration:
    """The calibration attached by :class:`CalibratePass` (empty when none ran)."""
    found = model.meta.get(CALIBRATION)
    return found if isinstance(found, Calibration) else Calibration()


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
