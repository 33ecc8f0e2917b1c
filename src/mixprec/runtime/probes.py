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
from collections.abc import Mapping, Sequence
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
    ):
        self._session = session
        self._probes = probes  # (tensor, min output, max output, shape output)
        self._means = means or {}  # tensor -> its per-channel mean output
        #: Per-channel means of the last :meth:`run`, by tensor name.
        self.last_means: dict[str, np.ndarray] = {}

    @classmethod
    def create(
        cls,
        model: ir.Model,
        candidates: Sequence[tuple[str, ir.DataType]],
        threads: int,
        external: Mapping[str, np.ndarray] | None = None,
        means: Mapping[str, int] | None = None,
    ) -> ProbeSession | None:
        """The probe session, or None when ONNX Runtime cannot build it.

        ``means`` (tensor -> channel axis) adds a per-channel ``ReduceMean`` of those
        tensors whose rank is known.

        The probes are inserted into ``model`` only while it is serialized (without its
        large weights, which ORT gets in memory) and removed again: ``model`` is left as
        it was.
        """
        by_name = {v.name: v for n in model.graph for v in n.outputs if v.name}
        probes: list[tuple[str, str, str, str]] = []
        mean_outputs: dict[str, str] = {}
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
                if means and name in means and value.shape is not None:
                    opset = onnx_opset(model.opset_imports, 13)
                    mean = _mean_node(value, means[name], len(value.shape), k, opset)
                    model.graph.insert_after(nodes[-1], mean)
                    added.extend(mean)
                    model.graph.outputs.append(mean[-1].outputs[0])
                    mean_outputs[name] = mean[-1].outputs[0].name or ""
            folder = model.meta.get(DATA_FOLDER)
            # ORT parses no weight bytes: it maps the model's own data files (no copy) and
            # takes other large weights from memory.
            augmented, detached = weightless_proto(model, data_folder=folder)
        finally:
            del model.graph.outputs[outputs_before:]
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
        return cls(session, probes, mean_outputs)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float, list[int]]]:
        """``(min, max, shape)`` by tensor name for one sample.

        Raises:
            MixprecError: ONNX Runtime fails on this sample.
        """
        wanted = [o for _, lo, hi, shape in self._probes for o in (lo, hi, shape)]
        outs = run_session(self._session, feeds, [*wanted, *self._means.values()])
        self.last_means = {name: np.asarray(outs[out]) for name, out in self._means.items()}
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


def _mean_node(value: ir.Value, axis: int, rank: int, k: int, opset: int) -> list[ir.Node]:
    """``ReduceMean`` of ``value`` over every axis but ``axis`` (output ``__mp_mean_k``)."""
    axes = [i for i in range(rank) if i != axis % rank]
    out = ir.Value(name=f"__mp_mean_{k}", type=ir.TensorType(ir.DataType.FLOAT))
    if opset >= 18:  # axes became an input
        given = ir.Value(
            name=f"__mp_mean_axes_{k}",
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
            "ReduceMean",
            [value, given],
            attributes=[ir.AttrInt64("keepdims", 0)],
            outputs=[out],
            name=out.name,
        )
        return [const, node]
    attrs = [ir.AttrInt64s("axes", axes), ir.AttrInt64("keepdims", 0)]
    return [ir.Node("", "ReduceMean", [value], attributes=attrs, outputs=[out], name=out.name)]


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
