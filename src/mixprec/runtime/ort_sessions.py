"""ONNX Runtime sessions: made on its CPU, CUDA or TensorRT provider, with the >2 GB
path, bfloat16 arrays and I/O binding (:class:`OrtSession`); the engine around them is
:mod:`mixprec.runtime.ort`.

ONNX Runtime's CPU provider has float16 kernels for most ops but almost no bfloat16
kernels (Cast is supported, MatMul/Add/Mul/Relu are not), and its numpy bridge has no
bfloat16: :func:`run_session` routes bfloat16 arrays through ``OrtValue`` buffers.

Models larger than 2 GB cannot be serialized as one protobuf message. Functions that
take a :class:`onnx.ModelProto` handle that by writing the model's initializers to a
temporary external-data file (:mod:`mixprec.runtime.source`). Protobuf is used here only
because ONNX Runtime reads it. Callers outside :mod:`mixprec.runtime` reach all of this
through the engine (:func:`~mixprec.runtime.engines.engine_for`), never directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from mixprec.core.config import ort_log_severity
from mixprec.core.limits import INLINE_LIMIT
from mixprec.runtime.engine import (
    ORT_PROVIDERS,
    DeviceBuffer,
    LoadHints,
    RuntimeLoadError,
    RuntimeRunError,
)
from mixprec.runtime.source import (
    check_external,
    skeleton_file,
    thread_cap,
)

__all__ = [
    "PROVIDERS",
    "OrtLoadError",
    "OrtRunError",
    "OrtSession",
    "make_session",
    "open_session",
    "ort_first_line",
    "run_session",
    "session_for",
    "through_file",
]

logger = logging.getLogger(__name__)

_BF16 = np.dtype(ml_dtypes.bfloat16)
#: ``RuntimeOptions.provider`` -> ONNX Runtime's execution providers (their one home).
PROVIDERS = ORT_PROVIDERS
#: Where a provider's I/O binding puts its buffers.
_DEVICES = {"cpu": "cpu", "cuda": "cuda", "tensorrt": "cuda"}
_LEVELS = {
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
}


class OrtLoadError(RuntimeLoadError):
    """ONNX Runtime could not create a session for a model."""


class OrtRunError(RuntimeRunError):
    """ONNX Runtime created a session but could not run it."""


# ORT prefixes messages with a C++ source location and function signature; drop them.
_ORT_SOURCE_NOISE = re.compile(r"\s*/onnxruntime_src/\S+:\d+\s+[^\s(]+\([^()]*\)\s*")


def ort_first_line(error: BaseException) -> str:
    """The first line of an ORT error, without its C++ source location noise."""
    for line in str(error).splitlines():
        if line.strip():
            text = _ORT_SOURCE_NOISE.sub(" ", line).strip()
            return text if len(text) <= 400 else text[:397] + "..."
    return type(error).__name__


_IR_VERSION_ERROR = re.compile(
    r"Unsupported model IR version: (\d+), max supported IR version: (\d+)"
)


def make_session(
    source: str | bytes,
    threads: int,
    *,
    optimization: str = "basic",
    hints: LoadHints | None = None,
    provider: str = "cpu",
) -> ort.InferenceSession:
    """Creates a session on ``provider`` (``"cpu"``, ``"cuda"``, ``"tensorrt"``).

    ``optimization`` "all" is what a deployment gets by default (ORT_ENABLE_ALL:
    QuantizeLinear/DequantizeLinear pairs fused into integer kernels, layout transforms);
    the engine's sessions run so by default. "basic" (ORT_ENABLE_BASIC) runs an INT8 QDQ
    model as DequantizeLinear -> float op -> QuantizeLinear (PP-OCRv4 det: 1.7x FP32's
    time, 0.6x when fused); "off" keeps an emulated model's Cast round trips, which
    fusions (e.g. LayerNormFusion) would swallow.

    ``hints`` (:class:`~mixprec.runtime.engine.LoadHints`): ``external`` initializers
    are used in place (no copy). Without ``prepack`` ORT keeps no repacked copy of the
    weights either (MatMul/Conv run a little slower): the session then holds no second
    copy of a large model's weights. ``data_folder`` is where ORT resolves the
    external-data references of a model given as bytes (it maps those files itself).
    Without the ``arena`` a session frees its activations after each run (for sessions
    kept side by side); without ``spinning`` its pool threads sleep whenever they wait;
    with ``stop_spinning`` they spin within a run, as served, and stop when it ends,
    instead of taking the cores from the next session timed beside it.

    When ORT rejects only the model's IR version (models written by a newer onnx than
    this ORT knows), the session is retried with the IR version ORT names; that rewrites
    in-memory bytes, or a file when ``owned`` (mixprec's own temporary files), never a
    user's file.

    Raises:
        OrtLoadError: ORT cannot load the model, or the provider did not start.
    """
    so = _session_options(threads, optimization, hints or LoadHints())
    providers = list(PROVIDERS[provider])
    try:
        return _started(open_session(source, so, providers), providers[0])
    except OrtLoadError:
        raise
    except Exception as e:
        match = _IR_VERSION_ERROR.search(str(e))
        if match is None or not (isinstance(source, bytes) or (hints and hints.owned)):
            raise OrtLoadError(f"onnxruntime cannot load the model: {ort_first_line(e)}") from e
    supported = int(match.group(2))
    logger.info(
        "model IR version %s > %d, which onnxruntime supports: lowered it for the run",
        match.group(1),
        supported,
    )
    if isinstance(source, bytes):
        proto = onnx.ModelProto.FromString(source)
        proto.ir_version = supported
        source = proto.SerializeToString()
    else:
        proto = onnx.load_model(source, load_external_data=False)
        proto.ir_version = supported
        onnx.save_model(proto, source)
    try:
        return _started(open_session(source, so, providers), providers[0])
    except OrtLoadError:
        raise
    except Exception as e:
        raise OrtLoadError(f"onnxruntime cannot load the model: {ort_first_line(e)}") from e


def open_session(
    source: str | bytes, so: ort.SessionOptions, providers: list[str]
) -> ort.InferenceSession:
    """The one place mixprec opens an ONNX Runtime session (:func:`make_session`, the
    kernel probes and the optimized-graph reader all come here)."""
    return ort.InferenceSession(source, sess_options=so, providers=providers)


def _session_options(threads: int, optimization: str, hints: LoadHints) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = thread_cap(threads)
    so.inter_op_num_threads = 1
    so.graph_optimization_level = _LEVELS[optimization]
    if hints.in_order:
        # Run nodes in the given order: range probes placed after each producer then
        # free every activation right away (the default order keeps them all alive).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if not hints.prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if not hints.arena:
        so.enable_cpu_mem_arena = False
    if not hints.spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif hints.stop_spinning:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    if hints.profile_to is not None:  # each kernel's time, named as in the graph written
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(hints.profile_to, "profile")
        so.optimized_model_filepath = os.path.join(hints.profile_to, "optimized.onnx")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name", "optimized.data"
        )
    if hints.data_folder is not None:
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", hints.data_folder
        )
    if hints.external:
        names = list(hints.external)
        so.add_external_initializers(
            names, [ort.OrtValue.ortvalue_from_numpy(hints.external[n]) for n in names]
        )
    # errors come back as exceptions; ORT's own log only when MIXPREC_LOG_LEVEL asks
    so.log_severity_level = ort_log_severity()
    return so


def _started(session: ort.InferenceSession, wanted: str) -> ort.InferenceSession:
    """``session`` once it is known to run on ``wanted``: ORT falls back to the CPU, with
    only a log line, when a GPU provider cannot start (no device, no CUDA libraries)."""
    used = session.get_providers()
    if used and used[0] != wanted:
        raise OrtLoadError(
            f"onnxruntime's {wanted} could not start here (it ran on {used[0]}): "
            "no device, or its CUDA/TensorRT libraries are missing"
        )
    return _released(session)


def _released(session: ort.InferenceSession) -> ort.InferenceSession:
    """``session`` without the Python-side copy of the serialized model that
    ``InferenceSession`` keeps for the session's whole life when built from bytes (its
    only use is rebuilding the session for another execution provider; mixprec's are
    CPU-only and never switch). The speed plan keeps two sessions alive: MiniLM's 86 MB
    FP32 bytes and its candidate's 56 MB were held beside ORT's own copy of the weights."""
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None
    return session


#: In-memory models larger than this reach ONNX Runtime as a file with external data:
#: as serialized bytes, the bytes and ORT's own parsed copy are held beside its
#: initializers while the session is built. With the sensitivity pass's shared-weight
#: copy, the INT8 guard's repair on MiniLM-L6 (90 MB) peaked at 1.39 GB RSS, not 1.61.
_THROUGH_FILE = 32 << 20


def through_file(model: onnx.ModelProto, hints: LoadHints) -> bool:
    """Over the protobuf limit; or over :data:`_THROUGH_FILE` with every weight in the
    proto (none external, none handed over in memory, no data folder to resolve)."""
    size = model.ByteSize()
    if size > INLINE_LIMIT:
        return True
    if size <= _THROUGH_FILE or hints.data_folder is not None or hints.external:
        return False
    return all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


@contextlib.contextmanager
def session_for(
    model: onnx.ModelProto,
    threads: int,
    optimization: str = "basic",
    *,
    hints: LoadHints | None = None,
    provider: str = "cpu",
) -> Iterator[ort.InferenceSession]:
    """A session for an in-memory model; models over :data:`_THROUGH_FILE` bytes go
    through a temporary dir, their weights in an external-data file (ORT has read it when
    the session exists). See :func:`make_session`."""
    hints = hints or LoadHints()
    if not through_file(model, hints):
        if hints.data_folder is None:
            check_external(model)
        source: str | bytes = model.SerializeToString()
        session = make_session(
            source, threads, optimization=optimization, hints=hints, provider=provider
        )
        del source  # ORT has parsed it: not held while the session runs
        yield session
        return
    with tempfile.TemporaryDirectory(prefix="mixprec-") as tmp:
        path = skeleton_file(model, Path(tmp))
        owned = dataclasses.replace(hints, owned=True)
        yield make_session(path, threads, optimization=optimization, hints=owned, provider=provider)


def _bf16_from_ortvalue(value: ort.OrtValue) -> np.ndarray:
    """Copies a CPU bfloat16 OrtValue into a numpy array (``.numpy()`` cannot)."""
    nbytes = value.tensor_size_in_bytes()
    buffer = (ctypes.c_uint8 * nbytes).from_address(value.data_ptr())
    raw = np.frombuffer(bytes(buffer), dtype=np.uint16)
    return raw.view(_BF16).reshape(value.shape())


def run_session(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    output_names: Sequence[str] | None,
) -> dict[str, np.ndarray]:
    names = list(output_names) if output_names else [o.name for o in session.get_outputs()]
    out_types = {o.name: o.type for o in session.get_outputs()}
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    # ORT's numpy bridge has no bfloat16: route through OrtValues when one is involved.
    use_values = any(a.dtype == _BF16 for a in arrays.values()) or any(
        out_types.get(n) == "tensor(bfloat16)" for n in names
    )
    try:
        if not use_values:
            results = session.run(names, arrays)
            return dict(zip(names, results, strict=True))
        values = {
            k: (
                ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    np.ascontiguousarray(a).view(np.uint16), TensorProto.BFLOAT16
                )
                if a.dtype == _BF16
                else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
            )
            for k, a in arrays.items()
        }
        outs = session.run_with_ort_values(names, values)
        return {
            n: _bf16_from_ortvalue(v) if v.element_type() == TensorProto.BFLOAT16 else v.numpy()
            for n, v in zip(names, outs, strict=True)
        }
    except Exception as e:
        raise OrtRunError(f"onnxruntime failed to run the model: {ort_first_line(e)}") from e


class _OrtBound:
    """A :class:`~mixprec.runtime.engine.BoundRun` over ORT's ``io_binding``: the feeds
    copied once to the provider's device, the outputs allocated there."""

    def __init__(
        self, session: ort.InferenceSession, feeds: Mapping[str, np.ndarray], device: str
    ) -> None:
        self.session = session
        self.binding = session.io_binding()
        self.names = [o.name for o in session.get_outputs()]
        try:
            for name, array in feeds.items():
                array = np.ascontiguousarray(array)
                if array.dtype == _BF16:
                    value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        array.view(np.uint16), TensorProto.BFLOAT16
                    )
                    self.binding.bind_ortvalue_input(name, value)
                else:
                    self.binding.bind_cpu_input(name, array)
            for name in self.names:
                self.binding.bind_output(name, device)
        except Exception as e:
            raise OrtRunError(f"onnxruntime cannot bind the feeds: {ort_first_line(e)}") from e

    def run(self) -> None:
        try:
            self.session.run_with_iobinding(self.binding)
        except Exception as e:
            raise OrtRunError(f"onnxruntime failed to run the model: {ort_first_line(e)}") from e

    def outputs(self) -> dict[str, np.ndarray]:
        values = self.binding.get_outputs()
        if any(v.element_type() == TensorProto.BFLOAT16 for v in values):
            return {
                n: _bf16_from_ortvalue(v) if v.element_type() == TensorProto.BFLOAT16 else v.numpy()
                for n, v in zip(self.names, values, strict=True)
            }
        return dict(zip(self.names, self.binding.copy_outputs_to_cpu(), strict=True))


class OrtSession:
    """An :class:`~mixprec.runtime.engine.Session` over an ``ort.InferenceSession``."""

    def __init__(self, session: ort.InferenceSession, provider: str = "cpu") -> None:
        self.session = session
        self.output_names = tuple(o.name for o in session.get_outputs())
        self.notes: list[str] = []
        self.device = _DEVICES[provider]
        self.binds_on_device = self.device != "cpu"

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        return run_session(self.session, feeds, output_names)

    def bind(self, feeds: Mapping[str, np.ndarray]) -> _OrtBound:
        return _OrtBound(self.session, feeds, self.device)

    def run_buffers(
        self, inputs: Mapping[str, np.ndarray | DeviceBuffer], device: str
    ) -> list[ort.OrtValue]:
        """Runs on ``inputs`` (a :class:`DeviceBuffer` is bound in place, an array copied);
        the outputs as OrtValues on ``device`` ("cpu" or "cuda"), in graph order."""
        binding = self.session.io_binding()
        try:
            for name, x in inputs.items():
                if isinstance(x, DeviceBuffer):
                    shape = list(x.shape)
                    binding.bind_input(name, x.device, x.device_id, x.dtype.type, shape, x.pointer)
                else:
                    binding.bind_cpu_input(name, x)
            for name in self.output_names:
                binding.bind_output(name, device)
            self.session.run_with_iobinding(binding)
        except Exception as e:
            raise OrtRunError(f"onnxruntime failed to run the model: {ort_first_line(e)}") from e
        return list(binding.get_outputs())
