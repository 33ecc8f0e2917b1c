"""ONNX Runtime sessions that expose a model's inner tensors, for calibration.

* :class:`ProbeSession`: the model with ``ReduceMin``/``ReduceMax``/``Shape`` probes
  after each measured tensor, built once and run once per sample.
* :class:`VariantRunner`: copies of the model whose graph outputs are swapped for the
  tensors to fetch (the fallback, and the path of observers that need the data).
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mixprec._errors import MixprecError
from mixprec._external import DATA_FOLDER
from mixprec._ort import PROTO_LIMIT, check_external, external_skeleton, make_session, run_session
from mixprec._protos import weightless_proto

__all__ = ["ProbeSession", "VariantRunner"]

logger = logging.getLogger(__name__)


class ProbeSession:
    """The model plus per-tensor ``ReduceMin``, ``ReduceMax`` and ``Shape`` outputs.

    ONNX Runtime computes the reductions itself, so no full-size intermediate leaves the
    session, and with the probes placed right after each producer (run in the given
    order) every activation can be freed as soon as it is measured: peak memory stays
    near a plain inference run.
    """

    def __init__(self, session: ort.InferenceSession, probes: list[tuple[str, str, str, str]]):
        self._session = session
        self._probes = probes  # (tensor, min output, max output, shape output)

    @classmethod
    def create(
        cls,
        model: ir.Model,
        candidates: Sequence[tuple[str, ir.DataType]],
        threads: int,
        external: Mapping[str, np.ndarray] | None = None,
    ) -> ProbeSession | None:
        """The probe session, or None when ONNX Runtime cannot build it.

        The probes are inserted into ``model`` only while it is serialized (without its
        large weights, which ORT gets in memory) and removed again: ``model`` is left as
        it was.
        """
        by_name = {v.name: v for n in model.graph for v in n.outputs if v.name}
        probes: list[tuple[str, str, str, str]] = []
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
        return cls(session, probes)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float, list[int]]]:
        """``(min, max, shape)`` by tensor name for one sample.

        Raises:
            MixprecError: ONNX Runtime fails on this sample.
        """
        wanted = [o for _, lo, hi, shape in self._probes for o in (lo, hi, shape)]
        outs = run_session(self._session, feeds, wanted)
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


class VariantRunner:
    """Runs copies of one model that differ only in their graph outputs.

    ``model`` is not modified: outputs are swapped for the run and restored, or, over
    the protobuf limit, swapped on a skeleton whose initializers live in a temporary
    file. The session of the last output set is kept for the next sample.
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
        self._cached: tuple[tuple[str, ...], ort.InferenceSession] | None = None
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
        self._cached = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _session(self, outputs: Sequence[onnx.ValueInfoProto]) -> ort.InferenceSession:
        key = tuple(vi.name for vi in outputs)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        self._cached = None  # one session at a time
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
        )
        self._cached = (key, session)
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
