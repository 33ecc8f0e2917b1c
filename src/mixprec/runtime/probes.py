"""ONNX Runtime sessions that expose a model's inner tensors, for calibration.

* :class:`ProbeSession`: the model with ``ReduceMin``/``ReduceMax``/``Shape`` probes
  after each measured tensor, built once and run once per sample.
* :class:`VariantRunner`: copies of the model whose graph outputs are swapped for the
  tensors to fetch (the fallback, and the path of observers that need the data).
"""

from __future__ import annotations

import logging
import tempfile
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mixprec.core.errors import MixprecError
from mixprec.core.ops import onnx_opset
from mixprec.io.external import DATA_FOLDER
from mixprec.io.protos import weightless_proto
from mixprec.runtime.ort import (
    PROTO_LIMIT,
    check_external,
    external_skeleton,
    make_session,
    run_session,
)

__all__ = ["ProbeSession", "VariantRunner"]

logger = logging.getLogger(__name__)


class ProbeSession:
    """The model plus per-tensor ``ReduceMin``, ``ReduceMax`` and ``Shape`` outputs.

    ONNX Runtime computes the reductions itself, so no full-size intermediate leaves the
    session, and with the probes placed right after each producer (run in the given
    order) every activation can be freed as soon as it is measured: peak memory stays
    near a plain inference run.
    """

    def __init__(
        self,
        session: ort.InferenceSession,
        probes: list[tuple[str, str, str, str]],
        means: dict[str, str] | None = None,
        absmax: dict[str, str] | None = None,
        fetched: Sequence[str] = (),
    ):
        self._session = session
        self._probes = probes  # (tensor, min output, max output, shape output)
        self._means = means or {}  # tensor -> its per-channel mean output
        self._absmax = absmax or {}  # tensor -> its per-channel max |x| output
        self._fetched = list(fetched)  # tensors that are outputs themselves
        #: Per-channel means of the last :meth:`run`, by tensor name.
        self.last_means: dict[str, np.ndarray] = {}
        #: Per-channel ``max |x|`` of the last :meth:`run`, by tensor name.
        self.last_absmax: dict[str, np.ndarray] = {}
        #: The whole tensors asked for (``fetch=``) of the last :meth:`run`, by name.
        self.last_fetched: dict[str, np.ndarray] = {}

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
    ) -> ProbeSession | None:
        """The probe session, or None when ONNX Runtime cannot build it.

        ``means`` (tensor -> channel axis) adds a per-channel ``ReduceMean`` of those
        tensors whose rank is known, ``absmax`` a per-channel ``ReduceMax(Abs(x))``;
        the tensors in ``fetch`` become outputs themselves (keep them few and small).

        The probes are inserted into ``model`` only while it is serialized (without its
        large weights, which ORT gets in memory) and removed again: ``model`` is left as
        it was.
        """
        by_name = {v.name: v for n in model.graph for v in n.outputs if v.name}
        probes: list[tuple[str, str, str, str]] = []
        channel_outputs: dict[str, dict[str, str]] = {"mean": {}, "absmax": {}}
        fetched: list[str] = []
        added: list[ir.Node] = []
        outputs_before = len(model.graph.outputs)
        try:
            for k, (name, dtype) in enumerate(candidates):
                value = by_name.get(name)
                producer = value.producer() if value is not None else None
                if value is None or producer is None:
                    continue
                nodes = _probe_nodes(value, dtype, k)
                model.graph.insert_after(producer, nodes)
                added.extend(nodes)
                model.graph.outputs.extend(n.outputs[0] for n in nodes)
                probes.append((name, *(n.outputs[0].name or "" for n in nodes)))  # type: ignore[arg-type]
                for kind, axes in (("mean", means), ("absmax", absmax)):
                    if not axes or name not in axes or value.shape is None:
                        continue
                    opset = onnx_opset(model.opset_imports, 13)
                    rank = len(value.shape)
                    reduce = _channel_nodes(kind, value, axes[name], rank, k, opset)
                    model.graph.insert_after(nodes[-1], reduce)
                    added.extend(reduce)
                    model.graph.outputs.append(reduce[-1].outputs[0])
                    channel_outputs[kind][name] = reduce[-1].outputs[0].name or ""
                if name in fetch:
                    fetched.append(name)
                    if not value.is_graph_output():
                        model.graph.outputs.append(value)
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
        detached.update(external or {})
        try:
            session = make_session(
                augmented.SerializeToString(),
                threads,
                in_order=True,
                external=detached,
                prepack=False,  # calibration runs a few samples: no second weight copy
                data_folder=folder,
            )
        except MixprecError as e:
            logger.debug("range analysis: probe session failed (%s); fetching tensors", e)
            return None
        return cls(session, probes, channel_outputs["mean"], channel_outputs["absmax"], fetched)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float, list[int]]]:
        """``(min, max, shape)`` by tensor name for one sample.

        Raises:
            MixprecError: ONNX Runtime fails on this sample.
        """
        wanted = [o for _, lo, hi, shape in self._probes for o in (lo, hi, shape)]
        channels = [*self._means.values(), *self._absmax.values()]
        outs = run_session(self._session, feeds, [*wanted, *channels, *self._fetched])
        self.last_means = {name: np.asarray(outs[out]) for name, out in self._means.items()}
        self.last_absmax = {name: np.asarray(outs[out]) for name, out in self._absmax.items()}
        self.last_fetched = {name: np.asarray(outs[name]) for name in self._fetched}
        return {
            name: (
                float(np.asarray(outs[lo], dtype=np.float64)),
                float(np.asarray(outs[hi], dtype=np.float64)),
                [int(d) for d in np.asarray(outs[shape]).reshape(-1)],
            )
            for name, lo, hi, shape in self._probes
        }


def _probe_nodes(value: ir.Value, dtype: ir.DataType, k: int) -> list[ir.Node]:
    """``ReduceMin``, ``ReduceMax`` and ``Shape`` of ``value`` (outputs named by ``k``)."""
    nodes = []
    for op in ("ReduceMin", "ReduceMax"):
        out = ir.Value(name=f"__mp_{op}_{k}", type=ir.TensorType(dtype), shape=ir.Shape([]))
        attrs = [ir.AttrInt64("keepdims", 0)]
        nodes.append(ir.Node("", op, [value], attributes=attrs, outputs=[out], name=out.name))
    shape = ir.Value(name=f"__mp_shape_{k}", type=ir.TensorType(ir.DataType.INT64))
    nodes.append(ir.Node("", "Shape", [value], outputs=[shape], name=shape.name))
    return nodes


#: Sessions a :class:`VariantRunner` keeps (one per chunk of fetched tensors).
_KEPT_SESSIONS = 8


def _channel_nodes(
    kind: str, value: ir.Value, axis: int, rank: int, k: int, opset: int
) -> list[ir.Node]:
    """Per-channel ``ReduceMean`` (kind "mean") or ``ReduceMax`` of ``Abs`` (kind "absmax")
    of ``value`` over every axis but ``axis`` (output ``__mp_{kind}_k``)."""
    axes = [i for i in range(rank) if i != axis % rank]
    out = ir.Value(name=f"__mp_{kind}_{k}", type=ir.TensorType(ir.DataType.FLOAT))
    first: list[ir.Node] = []
    op = "ReduceMean"
    if kind == "absmax":
        op = "ReduceMax"
        magnitude = ir.Value(name=f"__mp_abs_{k}", type=ir.TensorType(ir.DataType.FLOAT))
        first = [ir.Node("", "Abs", [value], outputs=[magnitude], name=magnitude.name)]
        value = magnitude
    if opset >= 18:  # axes became an input
        given = ir.Value(
            name=f"__mp_{kind}_axes_{k}",
            type=ir.TensorType(ir.DataType.INT64),
            shape=ir.Shape([len(axes)]),
        )
        const = ir.Node(
            "",
            "Constant",
            [],
            attributes=[ir.AttrTensor("value", ir.tensor(np.array(axes, np.int64)))],
            outputs=[given],
            name=f"{given.name}_node",
        )
        node = ir.Node(
            "",
            op,
            [value, given],
            attributes=[ir.AttrInt64("keepdims", 0)],
            outputs=[out],
            name=out.name,
        )
        return [*first, const, node]
    attrs = [ir.AttrInt64s("axes", axes), ir.AttrInt64("keepdims", 0)]
    return [*first, ir.Node("", op, [value], attributes=attrs, outputs=[out], name=out.name)]


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
        self._sessions: OrderedDict[tuple[str, ...], ort.InferenceSession] = OrderedDict()
        if model.ByteSize() > PROTO_LIMIT:
            self._dir = tempfile.TemporaryDirectory(prefix="mixprec-")
            try:
                self._model = external_skeleton(model, Path(self._dir.name))
            except BaseException:
                self.close()
                raise
        else:
            check_external(model)
            self._model = model

    def close(self) -> None:
        self._sessions.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _session(self, outputs: Sequence[onnx.ValueInfoProto]) -> ort.InferenceSession:
        key = tuple(vi.name for vi in outputs)
        if key in self._sessions:
            self._sessions.move_to_end(key)
            return self._sessions[key]
        while len(self._sessions) >= _KEPT_SESSIONS:
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
        session = make_session(
            source,
            self._threads,
            owned=self._dir is not None,
            external=self._external,
            prepack=False,
            data_folder=self._data_folder,
            arena=False,  # several sessions are kept: none holds its activations
        )
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
        return run_session(session, feeds, [vi.name for vi in outputs])


def _copy_vi(vi: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    return out
