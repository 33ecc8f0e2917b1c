"""Sessions that expose a model's inner tensors, for calibration (in ONNX Runtime by
default; any engine through :func:`~mixprec.runtime.engines.engine_for`).

* :class:`ProbeSession`: the model with ``ReduceMin``/``ReduceMax``/``Shape`` probes
  after each measured tensor (and, for histograms, a :class:`Subsample` of its values:
  nodes in :mod:`mixprec.calibrate.probe_nodes`), built once and run once per sample.
* :class:`VariantRunner`: copies of the model whose graph outputs are swapped for the
  tensors to fetch (the fallback, and the path of observers that need the data).
"""

from __future__ import annotations

import logging
import tempfile
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.probe_nodes import (
    POSITIONS,
    SampleConstants,
    channel_nodes,
    draw_positions,
    range_nodes,
    sample_nodes,
)
from mixprec.core.errors import MixprecError
from mixprec.core.limits import INLINE_LIMIT
from mixprec.core.ops import onnx_opset
from mixprec.io.external import DATA_FOLDER
from mixprec.io.protos import weightless_proto
from mixprec.runtime.engine import LoadHints, RuntimeOptions, Session
from mixprec.runtime.engines import engine_for
from mixprec.runtime.source import check_external, external_skeleton

__all__ = ["ProbeSession", "Subsample", "VariantRunner"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subsample:
    """What the histogram probes take of each tensor per run, beside its exact min and max.

    Attributes:
        size: Values at stratified random positions, new ones every run (every value of
            a tensor of at most ``size / 2``).
        top: The tensor's largest ``|x|``, exactly (the histogram's tail).
        seed: Seed of the positions.

    On PP-OCRv4 det (13 samples, 601 activations up to 3.3 M values) the defaults give
    the full-fetch histogram's MSE clips and 99.999% percentiles, and entropy clips
    within 3% at p90; 32768 and 65536 values cost 0.9 s and 2.1 s more of a 4.9 s
    calibration, change neither of the first two, and bring that p90 to 3% and 1%; 64 or
    128 largest |x| let an MSE clip's error grow by 48% or 8%.
    """

    size: int = 16384
    top: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or self.top < 1:
            raise MixprecError(f"subsample sizes must be positive, got {self.size}, {self.top}")


@dataclass
class _Outputs:
    """The probe outputs by measured tensor."""

    probes: list[tuple[str, str, str, str]] = field(default_factory=list)  # min, max, shape
    means: dict[str, str] = field(default_factory=dict)  # per-channel mean
    absmax: dict[str, str] = field(default_factory=dict)  # per-channel max |x|
    fetched: list[str] = field(default_factory=list)  # tensors that are outputs themselves
    samples: dict[str, tuple[str, str]] = field(default_factory=dict)  # sample, top |x|


class ProbeSession:
    """The model plus per-tensor ``ReduceMin``, ``ReduceMax`` and ``Shape`` outputs.

    ONNX Runtime computes the reductions itself, so no full-size intermediate leaves the
    session, and with the probes placed right after each producer (run in the given
    order) every activation can be freed as soon as it is measured: peak memory stays
    near a plain inference run. With a :class:`Subsample`, each tensor also gives a
    uniform sample of its values and its largest ``|x|`` (what a histogram needs), in the
    same run.
    """

    def __init__(
        self,
        session: Session,
        outputs: _Outputs,
        subsample: Subsample | None = None,
    ):
        self._session = session
        self._outputs = outputs
        self._subsample = subsample
        self._rng = np.random.default_rng(subsample.seed if subsample else 0)
        #: Per-channel means of the last :meth:`run`, by tensor name.
        self.last_means: dict[str, np.ndarray] = {}
        #: Per-channel ``max |x|`` of the last :meth:`run`, by tensor name.
        self.last_absmax: dict[str, np.ndarray] = {}
        #: The whole tensors asked for (``fetch=``) of the last :meth:`run`, by name.
        self.last_fetched: dict[str, np.ndarray] = {}
        #: (sample, largest ``|x|``) of the last :meth:`run` by tensor name (``subsample=``).
        self.last_samples: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        #: The positions the last :meth:`run` sampled at (see
        #: :func:`~mixprec.calibrate.probe_nodes.sample_indices`).
        self.last_positions = np.zeros(0)

    @classmethod
    def create(
        cls,
        model: ir.Model,
        candidates: Sequence[tuple[str, ir.DataType]],
        threads: int,
        external: Mapping[str, np.ndarray] | None = None,
        means: Mapping[str, int] | None = None,
        absmax: Mapping[str, int] | None = None,
        fetch: Collection[str] = (),
        subsample: Subsample | None = None,
    ) -> ProbeSession | None:
        """The probe session, or None when ONNX Runtime cannot build it.

        ``means`` (tensor -> channel axis) adds a per-channel ``ReduceMean`` of those
        tensors whose rank is known, ``absmax`` a per-channel ``ReduceMax(Abs(x))``;
        the tensors in ``fetch`` become outputs themselves (keep them few and small);
        ``subsample`` adds every tensor's sample and largest ``|x|`` (ai.onnx opset 10 on).

        The probes are inserted into ``model`` only while it is serialized (without its
        large weights, which ORT gets in memory) and removed again: ``model`` is left as
        it was.
        """
        added: list[ir.Node] = []
        outputs_before = len(model.graph.outputs)
        inputs_before = len(model.graph.inputs)
        try:
            outputs = _add_probes(model, candidates, added, means, absmax, fetch, subsample)
            folder = model.meta.get(DATA_FOLDER)
            # ORT parses no weight bytes: it maps the model's own data files (no copy) and
            # takes other large weights from memory.
            augmented, detached = weightless_proto(model, data_folder=folder)
        finally:
            # One by one: onnx_ir 1.1 leaves values deleted by a slice marked as outputs.
            while len(model.graph.outputs) > outputs_before:
                model.graph.outputs.pop()
            for node in reversed(added):
                model.graph.remove(node, safe=True)
            while len(model.graph.inputs) > inputs_before:
                model.graph.inputs.pop()
        detached.update(external or {})
        hints = LoadHints(
            external=detached,
            data_folder=folder,
            prepack=False,  # calibration runs a few samples: no second weight copy
            in_order=True,
        )
        options = _options(threads)
        try:
            session = engine_for(options).session(
                augmented.SerializeToString(), options, hints=hints
            )
        except MixprecError as e:
            logger.debug("range analysis: probe session failed (%s); fetching tensors", e)
            return None
        return cls(session, outputs, subsample if outputs.samples else None)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float, list[int]]]:
        """``(min, max, shape)`` by tensor name for one sample.

        Raises:
            MixprecError: ONNX Runtime fails on this sample.
        """
        o = self._outputs
        wanted = [name for _, lo, hi, shape in o.probes for name in (lo, hi, shape)]
        wanted += [*o.means.values(), *o.absmax.values(), *o.fetched]
        wanted += [name for pair in o.samples.values() for name in pair]
        if self._subsample is not None:
            self.last_positions = draw_positions(self._rng, self._subsample.size)
            feeds = {**feeds, POSITIONS: self.last_positions}
        outs = self._session.run(feeds, wanted)
        self.last_means = {name: np.asarray(outs[out]) for name, out in o.means.items()}
        self.last_absmax = {name: np.asarray(outs[out]) for name, out in o.absmax.items()}
        self.last_fetched = {name: np.asarray(outs[name]) for name in o.fetched}
        self.last_samples = {
            name: (np.asarray(outs[sample]), np.asarray(outs[top]))
            for name, (sample, top) in o.samples.items()
        }
        return {
            name: (
                float(np.asarray(outs[lo], dtype=np.float64)),
                float(np.asarray(outs[hi], dtype=np.float64)),
                [int(d) for d in np.asarray(outs[shape]).reshape(-1)],
            )
            for name, lo, hi, shape in o.probes
        }


def _add_probes(
    model: ir.Model,
    candidates: Sequence[tuple[str, ir.DataType]],
    added: list[ir.Node],
    means: Mapping[str, int] | None,
    absmax: Mapping[str, int] | None,
    fetch: Collection[str],
    subsample: Subsample | None,
) -> _Outputs:
    """Inserts the probes of every candidate after its producer (the nodes also go to
    ``added``, their outputs to the graph's outputs) and returns their output names."""
    by_name = {v.name: v for n in model.graph for v in n.outputs if v.name}
    opset = onnx_opset(model.opset_imports, 13)
    shared = None
    if subsample is not None and opset >= 10 and len(model.graph):  # TopK with a K input
        shared = SampleConstants.create(subsample.size, subsample.top, opset)
        model.graph.insert_before(model.graph.node(0), shared.nodes)
        added.extend(shared.nodes)
        model.graph.inputs.append(shared.positions)
    found = _Outputs()
    for k, (name, dtype) in enumerate(candidates):
        value = by_name.get(name)
        producer = value.producer() if value is not None else None
        if value is None or producer is None:
            continue
        if shared is not None:
            nodes, (lo, hi, shape), sample, top = sample_nodes(value, dtype, k, shared)
            outputs = [lo, hi, shape, sample, top]
            found.samples[name] = (sample.name or "", top.name or "")
        else:
            nodes, (lo, hi, shape) = range_nodes(value, dtype, k)
            outputs = [lo, hi, shape]
        found.probes.append((name, lo.name or "", hi.name or "", shape.name or ""))
        model.graph.insert_after(producer, nodes)
        added.extend(nodes)
        model.graph.outputs.extend(outputs)
        for kind, axes, names in (("mean", means, found.means), ("absmax", absmax, found.absmax)):
            if axes and name in axes and value.shape is not None:
                reduce = channel_nodes(kind, value, axes[name], len(value.shape), k, opset)
                model.graph.insert_after(nodes[-1], reduce)
                added.extend(reduce)
                model.graph.outputs.append(reduce[-1].outputs[0])
                names[name] = reduce[-1].outputs[0].name or ""
        if name in fetch:
            found.fetched.append(name)
            if not value.is_graph_output():
                model.graph.outputs.append(value)
    return found


#: Sessions a :class:`VariantRunner` keeps (one per chunk of fetched tensors).
_KEPT_SESSIONS = 8
#: ... and at most this many bytes of weights in them together: each session holds the
#: weights on its own (its own map of the data file, whose pages count once per map in
#: the process's resident set, or its own copy). A model over half of this keeps one
#: session: its output sets settle after the first sample (a chunk's sizes are known
#: then), so that one is reused. Measured on SmolLM2-135M (622 MB): 3 sessions of one
#: statistics pass held 2.6 GB, against 0.9 GB for one.
_KEPT_BYTES = 512 << 20


def _weight_bytes(model: onnx.ModelProto, external: Mapping[str, np.ndarray] | None) -> int:
    """The bytes of ``model``'s weights: inline, in external files, handed over in memory."""
    total = model.ByteSize() + sum(int(a.nbytes) for a in (external or {}).values())
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            entries = {e.key: e.value for e in t.external_data}
            total += int(entries.get("length", 0) or 0)
    return total


class VariantRunner:
    """Runs copies of one model that differ only in their graph outputs.

    ``model`` is not modified: outputs are swapped for the run and restored, or, over
    the protobuf limit, swapped on a skeleton whose initializers live in a temporary
    file. The sessions of the last few output sets are kept for the next samples.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        threads: int,
        external: Mapping[str, np.ndarray] | None = None,
        data_folder: str | None = None,
    ):
        self._external = external
        self._data_folder = data_folder
        self.original_outputs = [_copy_vi(vi) for vi in model.graph.output]
        self._threads = threads
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        # The sessions of the last few output sets (the chunks repeat for every sample).
        self._sessions: OrderedDict[tuple[str, ...], Session] = OrderedDict()
        weights = _weight_bytes(model, external)
        self._kept = max(1, min(_KEPT_SESSIONS, _KEPT_BYTES // max(weights, 1)))
        if model.ByteSize() > INLINE_LIMIT:
            self._dir = tempfile.TemporaryDirectory(prefix="mixprec-")
            try:
                self._model = external_skeleton(model, Path(self._dir.name))
            except BaseException:
                self.close()
                raise
        else:
            if data_folder is None:  # else the references are to that folder's files
                check_external(model)
            self._model = model

    def close(self) -> None:
        self._sessions.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _session(self, outputs: Sequence[onnx.ValueInfoProto]) -> Session:
        key = tuple(vi.name for vi in outputs)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return self._sessions[key]
        while len(self._sessions) >= self._kept:
            self._sessions.popitem(last=False)
        graph = self._model.graph
        del graph.output[:]
        graph.output.extend(outputs)
        try:
            if self._dir is None:
                source: str | bytes = self._model.SerializeToString()
            else:
                path = Path(self._dir.name) / "variant.onnx"
                onnx.save_model(self._model, path)
                source = str(path)
        finally:
            del graph.output[:]
            graph.output.extend(self.original_outputs)
        hints = LoadHints(
            external=self._external,
            data_folder=self._data_folder,
            owned=self._dir is not None,
            prepack=False,
            arena=False,  # several sessions are kept: none holds its activations
        )
        options = _options(self._threads)
        session = engine_for(options).session(source, options, hints=hints)
        self._sessions[key] = session
        return session

    def run(
        self, outputs: Sequence[onnx.ValueInfoProto], feeds: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The values of ``outputs`` for one sample.

        Raises:
            MixprecError: ONNX Runtime cannot build or run this variant.
        """
        session = self._session(outputs)
        return session.run(feeds, [vi.name for vi in outputs])


def _options(threads: int) -> RuntimeOptions:
    """Calibration's sessions: ONNX Runtime's CPU provider with its basic optimizations."""
    return RuntimeOptions(threads=threads, optimization="basic")


def _copy_vi(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    return out
