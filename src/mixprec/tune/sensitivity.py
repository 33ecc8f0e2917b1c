"""Per-node sensitivity from one instrumented ONNX Runtime run.

The instrumented model carries the FP32 stream of the prepared model and, beside it:

* for each candidate node, a *local* copy fed from the FP32 stream with its float inputs
  rounded to the target (``Cast`` to the low dtype and back, or ``QuantizeLinear`` ->
  ``DequantizeLinear`` at the calibrated scale for INT8) and its float outputs rounded
  the same way: the error the node makes alone, on exact inputs;
* for each edge from a candidate node to a consumer, a copy of the consumer fed the
  rounded tensor and every other input exact: the harm the candidate's low-precision
  output does one step downstream (an ``Add`` of a large constant whose ``Sub``
  consumer cancels it shows up here, not in the ``Add``'s own error);
* a whole low-precision stream (every candidate rounded, the rest as is), compared with
  the FP32 stream at each candidate's output: the *accumulated* error.

Each comparison leaves two scalars, ``sum((approx - exact)^2)`` and ``sum(exact^2)``
(the latter once per exact tensor), so one run per sample (two samples by default)
measures every node at once without fetching any activation. Rounding happens in FP32
arithmetic (as :mod:`mixprec.passes.emulate` does), so bfloat16 is measured on a CPU without
bf16 kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from mixprec.core.graphs import UniqueNames
from mixprec.core.jsonio import json_ready
from mixprec.inputs.feeds import feeds_for
from mixprec.runtime.engine import LoadHints, RuntimeOptions, RuntimeRunError, Session
from mixprec.runtime.engines import engine_for
from mixprec.tune.moves import Move

__all__ = ["NodeSensitivity", "Rounder", "measure_sensitivity", "rank"]

logger = logging.getLogger(__name__)

#: Ops whose copies would not reproduce their FP32 output (fresh random numbers).
_NONDETERMINISTIC = frozenset(
    {
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
        "Dropout",
    }
)


@dataclasses.dataclass(frozen=True)
class NodeSensitivity:
    """How much one candidate node's low-precision run disturbs the computation.

    Attributes:
        name: the node's name.
        op_type: its op type.
        local: relative L2 error of its outputs when it alone runs low on exact inputs.
        downstream: the worst relative L2 error its rounded output causes in one consumer
            fed exact values otherwise.
        accumulated: relative L2 error of its outputs when every candidate runs low.
        macs: its multiply-accumulates.
        measured: False for nodes the instrumented run cannot copy (inside a subgraph,
            or holding one); they rank after every measured node.
    """

    name: str
    op_type: str
    local: float
    downstream: float
    accumulated: float
    macs: int
    measured: bool = True

    @property
    def score(self) -> float:
        """The ranking key: the larger of the local and downstream errors."""
        return max(self.local, self.downstream)

    def move(self) -> Move:
        """The repair move of this node: back to float, costing its MACs."""
        return Move(self.name, "float", self.score, self.macs)

    def to_dict(self) -> dict[str, object]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json_ready({**fields, "score": self.score})


class Rounder:
    """Rounds tensors of the instrumented graph to the target; one subclass per target.

    ``activation`` and ``weight`` return the rounded value, or the value itself when it
    cannot be rounded (no calibrated range). Rounded values are cached per source value.
    """

    def __init__(self, graph: ir.Graph, names: UniqueNames) -> None:
        self.graph = graph
        self.names = names
        self._done: dict[ir.Value, ir.Value] = {}
        self._count = 0

    def fresh(self, base: str) -> str:
        """A new name from ``base`` and a counter (so ``UniqueNames`` rarely probes)."""
        self._count += 1
        return self.names.fresh(f"{base}__t{self._count}")

    def _append(self, op: str, inputs: Sequence[ir.Value], base: str, **attrs: Any) -> ir.Value:
        node = ir.node(op, inputs, attrs or None, name=self.fresh(f"tune/{op}"))
        out = node.outputs[0]
        out.name = self.fresh(base)
        self.graph.append(node)
        return out

    def round(self, value: ir.Value, *, weight_of: ir.Node | None = None) -> ir.Value:
        if value not in self._done:
            self._done[value] = self._round(value, weight_of)
        return self._done[value]

    def _round(self, value: ir.Value, weight_of: ir.Node | None) -> ir.Value:
        raise NotImplementedError


class CastRounder(Rounder):
    """float32 -> float16/bfloat16 -> float32 (round to nearest even, like the Cast pass)."""

    def __init__(self, graph: ir.Graph, names: UniqueNames, low: ir.DataType) -> None:
        super().__init__(graph, names)
        self.low = low

    def _round(self, value: ir.Value, weight_of: ir.Node | None) -> ir.Value:
        base = f"{value.name}__tune_low"
        down = self._append("Cast", [value], base, to=self.low)
        return self._append("Cast", [down], base, to=ir.DataType.FLOAT)


@dataclasses.dataclass
class _Comparison:
    key: tuple[str, str]  # (node name, "local" | "downstream" | "accumulated")
    num: str
    den: str


class _Builder:
    """Adds the copies and comparisons to ``model`` (a private copy) in place."""

    def __init__(
        self,
        model: ir.Model,
        candidates: Iterable[str],
        make_rounder: Callable[[ir.Graph, UniqueNames], Rounder],
        *,
        accumulated: bool = True,
    ) -> None:
        self.model = model
        self.graph = model.graph
        self.names = UniqueNames(model)
        self.rounder = make_rounder(self.graph, self.names)
        self.wanted = set(candidates)
        self.accumulated = accumulated
        self.comparisons: list[_Comparison] = []
        self.measured: set[str] = set()
        self.outputs: list[ir.Value] = []
        self._dens: dict[ir.Value, ir.Value] = {}

    @staticmethod
    def copyable(node: ir.Node) -> bool:
        has_graph = any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
        )
        return not has_graph and node.op_type not in _NONDETERMINISTIC

    def _copy(self, node: ir.Node, inputs: Sequence[ir.Value | None]) -> ir.Node:
        attrs = list(node.attributes.values())
        twin = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attrs,
            num_outputs=len(node.outputs),
            name=self.rounder.fresh(f"tune/{node.name}"),
            version=node.version,
        )
        for out, orig in zip(twin.outputs, node.outputs, strict=True):
            out.name = self.rounder.fresh(f"{orig.name}__tune")
            out.type = orig.type
        self.graph.append(twin)
        return twin

    def _compare(self, approx: ir.Value, exact: ir.Value, key: tuple[str, str]) -> None:
        """Add ``sum((approx - exact)^2)`` and (once per exact value) ``sum(exact^2)``."""
        r = self.rounder
        diff = r._append("Sub", [approx, exact], "tune_diff")
        num = r._append("ReduceSumSquare", [diff], "tune_num", keepdims=0)
        den = self._dens.get(exact)
        if den is None:
            den = self._dens[exact] = r._append("ReduceSumSquare", [exact], "tune_den", keepdims=0)
            self._output(den)
        self._output(num)
        self.comparisons.append(_Comparison(key, num.name or "", den.name or ""))

    def _output(self, value: ir.Value) -> None:
        value.type = ir.TensorType(ir.DataType.FLOAT)
        value.shape = ir.Shape([])
        self.outputs.append(value)

    def _is_weight(self, value: ir.Value) -> bool:
        return value.is_initializer() or (
            (p := value.producer()) is not None and p.op_type == "Constant"
        )

    def _rounded_inputs(self, node: ir.Node, inputs: Sequence[ir.Value | None]) -> list:
        out: list[ir.Value | None] = []
        for v in inputs:
            if v is None or v.dtype != ir.DataType.FLOAT:
                out.append(v)
            else:
                out.append(self.rounder.round(v, weight_of=node if self._is_weight(v) else None))
        return out

    def build(self) -> None:
        nodes = list(self.graph)  # the FP32 stream, in topological order
        low: dict[ir.Value, ir.Value] = {}  # FP32-stream value -> low-stream value
        for node in nodes:
            candidate = node.name in self.wanted and self.copyable(node)
            if candidate:
                self.measured.add(node.name or "")
                self._local(node)
                self._downstream(node)
            if self.accumulated:
                self._low_stream(node, candidate, low)

    def _local(self, node: ir.Node) -> None:
        twin = self._copy(node, self._rounded_inputs(node, list(node.inputs)))
        for out, orig in zip(twin.outputs, node.outputs, strict=True):
            if orig.dtype == ir.DataType.FLOAT and orig.name:
                rounded = self.rounder.round(out)
                self._compare(rounded, orig, (node.name or "", "local"))

    def _downstream(self, node: ir.Node) -> None:
        for out in node.outputs:
            if out.dtype != ir.DataType.FLOAT:
                continue
            for user in {u for u, _ in out.uses()}:
                if user.graph is not self.graph or not self.copyable(user):
                    continue
                rounded = self.rounder.round(out)
                inputs = [rounded if v is out else v for v in user.inputs]
                twin = self._copy(user, inputs)
                for t_out, orig in zip(twin.outputs, user.outputs, strict=True):
                    if orig.dtype == ir.DataType.FLOAT and orig.name:
                        self._compare(t_out, orig, (node.name or "", "downstream"))

    def _low_stream(self, node: ir.Node, candidate: bool, low: dict[ir.Value, ir.Value]) -> None:
        if not self.copyable(node) or node.op_type == "Constant":
            return  # its outputs are shared by both streams
        inputs = [low.get(v, v) if v is not None else None for v in node.inputs]
        if candidate:
            inputs = self._rounded_inputs(node, inputs)
        if all(a is b for a, b in zip(inputs, node.inputs, strict=True)):
            return  # nothing upstream differs: the FP32 values are the low stream's
        twin = self._copy(node, inputs)
        for out, orig in zip(twin.outputs, node.outputs, strict=True):
            value = out
            if candidate and orig.dtype == ir.DataType.FLOAT:
                value = self.rounder.round(out)
            low[orig] = value
            if candidate and orig.dtype == ir.DataType.FLOAT and orig.name:
                self._compare(value, orig, (node.name or "", "accumulated"))


def instrument(
    model: ir.Model,
    candidates: Iterable[str],
    make_rounder: Callable[[ir.Graph, UniqueNames], Rounder],
    *,
    accumulated: bool = True,
) -> tuple[ir.Model, list[_Comparison], set[str]]:
    """The instrumented copy of ``model``, its comparisons, and the measured node names."""
    copy = model.clone()  # weights shared with ``model``: the builder adds, never changes
    builder = _Builder(copy, candidates, make_rounder, accumulated=accumulated)
    builder.build()
    copy.graph.outputs[:] = builder.outputs
    return copy, builder.comparisons, builder.measured


def measure_sensitivity(
    model: ir.Model,
    candidates: Mapping[str, tuple[str, int]],
    make_rounder: Callable[[ir.Graph, UniqueNames], Rounder],
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    threads: int = 2,
    accumulated: bool = True,
    runtime: RuntimeOptions | None = None,
) -> list[NodeSensitivity]:
    """Run the instrumented model once per sample and return every candidate's errors.

    A rounded value can change a length that depends on values (a predicted duration,
    the count of scores above a threshold), and ONNX Runtime then refuses the
    instrumented run (operands that no longer broadcast). The run is then repeated
    without the low-precision stream (its ``accumulated`` errors become NaN), and if that
    fails too, on halves of the candidates: a candidate whose copies alone cannot run is
    the one whose rounding changes a length, and scores ``inf`` (it ranks first).

    Args:
        model: the prepared FP32 model (not changed).
        candidates: ``{node name: (op type, MACs)}`` of the nodes that may go low.
        make_rounder: builds the target's :class:`Rounder` for the instrumented graph.
        samples: feed dicts (a few suffice: errors are pooled over them).
        threads: intra-op threads (when ``runtime`` is None).
        accumulated: also carry the whole low-precision stream.
        runtime: the engine of the instrumented run (default ONNX Runtime's CPU
            provider); it runs without graph optimizations, which would fold the
            rounding Casts.

    Returns:
        One :class:`NodeSensitivity` per candidate, in ``candidates`` order.
    """
    options = dataclasses.replace(runtime or RuntimeOptions(threads=threads), optimization="off")
    measure = functools.partial(_measure, model, make_rounder=make_rounder, samples=samples,
                                options=options)  # fmt: skip
    try:
        return measure(candidates, accumulated=accumulated)
    except RuntimeRunError as exc:
        logger.info("tune: the instrumented run failed (%s); measuring piecewise", exc)
    found = {s.name: s for s in _measure_apart(measure, list(candidates.items()))}
    return [dataclasses.replace(found[name], accumulated=math.nan) for name in candidates]


def _measure_apart(
    measure: Callable[..., list[NodeSensitivity]], items: list[tuple[str, tuple[str, int]]]
) -> list[NodeSensitivity]:
    """Local and downstream errors of ``items``, in halves where a run fails; a single
    candidate that cannot run scores ``inf``."""
    try:
        return measure(dict(items), accumulated=False)
    except RuntimeRunError as exc:
        if len(items) == 1:
            name, (op_type, macs) = items[0]
            logger.info("tune: %s %r rounded cannot run (%s): scored inf", op_type, name, exc)
            return [NodeSensitivity(name, op_type, math.inf, math.inf, math.nan, macs)]
    half = len(items) // 2
    return _measure_apart(measure, items[:half]) + _measure_apart(measure, items[half:])


def _measure(
    model: ir.Model,
    candidates: Mapping[str, tuple[str, int]],
    *,
    make_rounder: Callable[[ir.Graph, UniqueNames], Rounder],
    samples: Sequence[Mapping[str, np.ndarray]],
    options: RuntimeOptions,
    accumulated: bool,
) -> list[NodeSensitivity]:
    """One instrumented run per sample (:func:`measure_sensitivity`, without the
    fallback)."""
    instrumented, comparisons, measured = instrument(
        model, candidates, make_rounder, accumulated=accumulated
    )
    sums: dict[str, float] = {}
    if comparisons:  # none when every candidate sits in a subgraph
        session = _session(instrumented, options)
        for feeds in samples:
            out = session.run(feeds_for(instrumented, feeds))
            for name, array in out.items():
                sums[name] = sums.get(name, 0.0) + float(np.asarray(array, np.float64))
    errors: dict[tuple[str, str], float] = {}
    for c in comparisons:
        err = _rel(sums.get(c.num, 0.0), sums.get(c.den, 0.0))
        errors[c.key] = max(errors.get(c.key, 0.0), err)
    found = []
    for name, (op_type, macs) in candidates.items():
        found.append(
            NodeSensitivity(
                name,
                op_type,
                errors.get((name, "local"), 0.0),
                errors.get((name, "downstream"), 0.0),
                errors.get((name, "accumulated"), math.nan if accumulated else 0.0),
                macs,
                measured=name in measured,
            )
        )
    return found


def _session(model: ir.Model, options: RuntimeOptions) -> Session:
    """The instrumented model's session, loaded from a temporary file whose weights live
    in an external-data file: no protobuf copy of the weights is held beside the engine's
    own (MiniLM-L6, 90 MB: this pass peaked at 0.92 GB RSS, 1.31 GB through a protobuf
    copy of a protobuf copy)."""
    with tempfile.TemporaryDirectory(prefix="mixprec-sens-") as tmp:
        path = Path(tmp) / "instrumented.onnx"
        ir.save(model, path, external_data="instrumented.onnx.data")
        hints = LoadHints(owned=True, arena=False)
        return engine_for(options).session(str(path), options, hints=hints)


def _rel(num: float, den: float) -> float:
    """sqrt(num / den); inf where the low run is not finite but the FP32 run is; 0 when
    the FP32 values themselves are not finite (nothing to measure against)."""
    if not math.isfinite(den):
        return 0.0
    if not math.isfinite(num):
        return math.inf
    if num == 0.0:
        return 0.0
    return math.sqrt(num) / max(math.sqrt(den), 1e-30)


def rank(found: Iterable[NodeSensitivity]) -> list[NodeSensitivity]:
    """Candidates in the order the search moves them back to float.

    Measured nodes come first, by error removed per MAC given up: ``score / (macs + m0)``
    where ``m0`` is a tenth of the mean candidate's MACs (at least 1), so a node without
    MACs is cheap to move but still needs an error to rank high, and a heavy Conv goes
    early only when its error is large. Ties: fewer MACs, then name. Unmeasured nodes
    follow, by name.
    """
    items = list(found)
    measured = [s for s in items if s.measured]
    m0 = max(sum(s.macs for s in measured) / (10 * max(len(measured), 1)), 1.0)

    def key(s: NodeSensitivity) -> tuple[float, int, str]:
        gain = s.score / (s.macs + m0) if math.isfinite(s.score) else math.inf
        return (-gain, s.macs, s.name)

    ranked = sorted(measured, key=key)
    return ranked + sorted((s for s in items if not s.measured), key=lambda s: s.name)
