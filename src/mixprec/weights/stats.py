"""What a data-aware weight method reads of the calibration data: each quantized MatMul's
input second moment ``H = X^T X / n`` (``[K, K]``, float32), streamed.

:func:`collect_hessians` runs the FP32 model on the calibration samples in ONNX Runtime
(:func:`~mixprec.calibrate.runner.stream_tensors`) and adds each fetched activation's
``X^T X`` (rows of its last axis) into one accumulator per activation: MatMuls reading the
same input (q/k/v, gate/up) share one. The activations are never kept, only the sums.

A **streamed** model (over 2 GB, :mod:`mixprec.pipeline.streamed`) never gets one session:
its inputs are tapped as the model runs one piece at a time
(:func:`~mixprec.runtime.pieces.tap_in_pieces`), all of them in one pass that stops at the
last piece making one (the lm_head's logits are never computed).

Each sum becomes its mean in place once its pass is over, so one ``[K, K]`` array per
input is held. Memory: ``4 K^2`` bytes per distinct input (float32 sums: 1.3 MB at
K = 576, 9.4 MB at 1536, 268 MB at 8192). In one session the inputs are fetched a group
at a time under ``group_bytes`` (default 512 MB), one pass over the samples per group
(each pass runs the model once per sample with every input of the group fetched):
SmolLM2-135M's 120 inputs (400 MB) take one pass, a 4096-wide model's about 7 layers at a
time.

:func:`attach_hessians` records a :class:`~mixprec.weights.methods.LayerData` on each
MatMul the select pass marked for quantization (``node.meta[LAYER_INPUTS]``), which the
methods receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from mixprec.calibrate.runner import stream_tensors
from mixprec.core.batching import runs_within
from mixprec.inputs.feeds import Feeds
from mixprec.runtime.pieces import Taps, tap_in_pieces
from mixprec.weights.inputs import LAYER_INPUTS, LayerData
from mixprec.weights.select import matmul_weight, weight_decision

__all__ = [
    "DEFAULT_GROUP_BYTES",
    "Hessians",
    "WeightsData",
    "attach_hessians",
    "collect_hessians",
    "hessian_inputs",
]

#: Most bytes of ``X^T X`` sums collected in one pass over the samples (one pass per group).
DEFAULT_GROUP_BYTES = 512 << 20
_CANNOT_RUN = "ONNX Runtime cannot run the FP32 model for the layer statistics"


@dataclasses.dataclass
class Hessians:
    """``X^T X / n`` and row counts per activation name (float32 ``[K, K]``), and the
    number of samples they came from. Kept between quantizations of one run (a repair
    requantizes without running the model again)."""

    means: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    rows: dict[str, int] = dataclasses.field(default_factory=dict)
    samples: int = 0

    def mean(self, name: str) -> np.ndarray | None:
        """``X^T X / n`` of activation ``name`` (None: never seen)."""
        return self.means[name] if self.rows.get(name, 0) else None


def hessian_inputs(model: ir.Model) -> dict[str, int]:
    """Activation name -> K for every MatMul the select pass marked for quantization
    (a tied lm_head excluded: its codes serve the embedding too, where no ``H`` applies)."""
    found: dict[str, int] = {}
    for node in model.graph:
        d = weight_decision(node)
        x = node.inputs[0] if node.inputs else None
        if node.op_type != "MatMul" or d is None or not d.quantized or d.table is not None:
            continue
        source, _ = matmul_weight(node, set())
        if x is not None and x.name and source is not None:
            found[x.name] = source.shape[0]
    return found


def collect_hessians(
    model: ir.Model,
    samples: Sequence[Feeds],
    widths: dict[str, int],
    *,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    threads: int = 2,
    into: Hessians | None = None,
    streamed: bool = False,
) -> Hessians:
    """``X^T X / n`` of each activation in ``widths`` (name -> K) over ``samples`` (module
    doc); names already in ``into`` are not collected again. ``streamed``: tapped from
    the model run in pieces, in one pass.

    Raises:
        MixprecError: ONNX Runtime cannot run the model (or a piece of it).
    """
    found = into if into is not None else Hessians()
    todo = {name: k for name, k in widths.items() if name not in found.means}
    if not todo:
        return found

    def consume(_index: int, name: str, array: np.ndarray) -> None:
        k = todo[name]
        if array.ndim < 1 or array.shape[-1] != k:
            return
        rows = np.asarray(array, np.float32).reshape(-1, k)
        found.means[name] += rows.T @ rows
        found.rows[name] += len(rows)

    groups = (
        [list(todo)]
        if streamed
        else runs_within(todo, lambda name: 4 * todo[name] ** 2, group_bytes)
    )
    for group in groups:
        for name in group:
            found.means[name] = np.zeros((todo[name], todo[name]), np.float32)
            found.rows[name] = 0
        if streamed:
            taps = Taps(frozenset(group), consume)
            tap_in_pieces(model, samples, taps, threads=threads, what=_CANNOT_RUN)
            found.samples = len(samples)
        else:
            found.samples = stream_tensors(model, samples, group, consume, threads=threads)
        for name in group:  # the sums become means in place: one array per input
            found.means[name] /= max(found.rows[name], 1)
    return found


def attach_hessians(model: ir.Model, hessians: Hessians) -> int:
    """Record a ``LayerData`` on each marked MatMul whose input has sums (module
    doc); the number of MatMuls given one."""
    widths = hessian_inputs(model)
    shared: dict[str, LayerData] = {}
    count = 0
    for node in model.graph:
        x = node.inputs[0] if node.op_type == "MatMul" and node.inputs else None
        if x is None or x.name not in widths:
            continue
        mean = hessians.mean(x.name or "")
        if mean is None:
            continue
        if x.name not in shared:
            shared[x.name or ""] = LayerData(mean, hessians.rows[x.name or ""])
        base = shared[x.name or ""]
        node.meta[LAYER_INPUTS] = LayerData(base.measured, base.rows, shared=base.shared)
        count += 1
    return count


@dataclasses.dataclass
class WeightsData:
    """The calibration samples a run reads (a few, kept as a list: one pass per group of
    inputs) and the sums collected from them, kept across requantizations."""

    samples: Sequence[Feeds]
    hessians: Hessians = dataclasses.field(default_factory=Hessians)
    threads: int = 2
    #: the model runs in pieces (:mod:`mixprec.pipeline.streamed`): its inputs are tapped
    streamed: bool = False
    #: activation-aware scales by input name (:mod:`mixprec.weights.awq`), searched once
    scales: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
