"""ONNX Runtime sessions: CPU sessions, the >2 GB path, bfloat16 arrays, :func:`run_model`.

ONNX Runtime's CPU provider has float16 kernels for most ops but almost no bfloat16
kernels (Cast is supported, MatMul/Add/Mul/Relu are not), and its numpy bridge has no
bfloat16: :func:`run_model` routes bfloat16 arrays through ``OrtValue`` buffers.

Models larger than 2 GB cannot be serialized as one protobuf message. Functions that
take a :class:`onnx.ModelProto` handle that by writing the model's initializers to a
temporary external-data file; :func:`run_model` also accepts a path, which is the
cheaper way to run such a model. Protobuf is used here only because ONNX Runtime reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

from mixprec.core.config import THREADS_ENV, ort_log_severity
from mixprec.core.errors import MixprecError
from mixprec.io.protos import IN_MEMORY, copy_fields, element_count
from mixprec.runtime.cpu import cpu_features
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError

__all__ = [
    "PROTO_LIMIT",
    "OrtEngine",
    "OrtLoadError",
    "OrtRunError",
    "check_external",
    "external_skeleton",
    "make_session",
    "missing_kernels",
    "ort_first_line",
    "run_model",
    "run_session",
    "thread_cap",
]

logger = logging.getLogger(__name__)

_BF16 = np.dtype(ml_dtypes.bfloat16)
# Largest serialized protobuf message; larger models go through external data.
PROTO_LIMIT = 2_000_000_000
# Packed sub-byte types: numpy holds them one element per byte, so raw bytes differ.
_PACKED_TYPES = frozenset(
    getattr(TensorProto, n)
    for n in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(TensorProto, n)
)


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


def external_skeleton(model: onnx.ModelProto, directory: Path) -> onnx.ModelProto:
    """Writes the main graph's initializers to ``directory/model.onnx.data``.

    Returns a copy of ``model`` whose initializers refer to that file. ``model`` itself
    is left untouched, and only one tensor's bytes are duplicated at a time.
    """
    data_name = "model.onnx.data"
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, frozenset({"graph"}))
    copy_fields(model.graph, skeleton.graph, frozenset({"initializer"}))
    data_fields = frozenset(
        {
            "raw_data",
            "float_data",
            "int32_data",
            "string_data",
            "int64_data",
            "double_data",
            "uint64_data",
            "external_data",
            "data_location",
        }
    )
    offset = 0
    with open(directory / data_name, "wb") as f:
        for t in model.graph.initializer:
            keep_inline = (
                t.data_location == TensorProto.EXTERNAL
                or t.data_type in (TensorProto.STRING, *_PACKED_TYPES)
                or element_count(t.dims) < 1024
            )
            if keep_inline:
                skeleton.graph.initializer.add().CopyFrom(t)
                continue
            raw = t.raw_data if t.raw_data else numpy_helper.to_array(t).tobytes()
            nt = skeleton.graph.initializer.add()
            copy_fields(t, nt, data_fields)
            for key, value in (("location", data_name), ("offset", offset), ("length", len(raw))):
                entry = nt.external_data.add()
                entry.key = key
                entry.value = str(value)
            nt.data_location = TensorProto.EXTERNAL
            f.write(raw)
            offset += len(raw)
    if skeleton.ByteSize() > PROTO_LIMIT:
        raise MixprecError(
            "the model is over 2 GB even without its initializers (large Constant nodes?); "
            "save it with external data and pass its path"
        )
    return skeleton


def _is_in_memory(t: TensorProto) -> bool:
    return any(e.key == "location" and e.value == IN_MEMORY for e in t.external_data)


def check_external(model: onnx.ModelProto) -> None:
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL and not _is_in_memory(t):
            raise MixprecError(
                f"initializer {t.name!r} has external data that is not loaded; load the model "
                "with onnx.load(path) or pass its path"
            )


def thread_cap(threads: int) -> int:
    """``threads`` (0: ORT's choice, all cores) capped by :data:`THREADS_ENV` when set."""
    text = os.environ.get(THREADS_ENV, "")
    cap = int(text) if text.isdigit() and int(text) > 0 else 0
    if cap == 0:
        return threads
    return cap if threads <= 0 else min(threads, cap)


_IR_VERSION_ERROR = re.compile(
    r"Unsupported model IR version: (\d+), max supported IR version: (\d+)"
)


def make_session(
    source: str | bytes,
    threads: int,
    *,
    owned: bool = False,
    optimize: bool = True,
    in_order: bool = False,
    external: Mapping[str, np.ndarray] | None = None,
    prepack: bool = True,
    data_folder: str | None = None,
    arena: bool = True,
    spinning: bool = True,
    deployed: bool = False,
) -> ort.InferenceSession:
    """Creates a CPU session.

    ``deployed``: the graph optimizations a deployment gets by default (ORT_ENABLE_ALL:
    QuantizeLinear/DequantizeLinear pairs fused into integer kernels, layout transforms);
    the engine's sessions (the INT8 speed plan, the guards, validation) run so. Otherwise
    ``optimize`` gives ORT_ENABLE_BASIC, where an INT8 QDQ model runs DequantizeLinear ->
    float op -> QuantizeLinear (PP-OCRv4 det: 1.7x FP32's time, 0.6x when fused).

    ``external`` initializers are used in place (no copy). With ``prepack=False`` ORT
    keeps no repacked copy of the weights either (MatMul/Conv run a little slower): the
    session then holds no second copy of a large model's weights. ``data_folder`` is where
    ORT resolves the external-data references of a model given as bytes (it maps those
    files itself). Without the ``arena`` a session frees its activations after each run
    (for sessions kept side by side); without ``spinning`` its pool threads sleep after a
    run instead of taking the cores from the next session timed beside it.

    When ORT rejects only the model's IR version (models written by a newer onnx than
    this ORT knows), the session is retried with the IR version ORT names; that rewrites
    in-memory bytes, or a file when ``owned`` (mixprec's own temporary files), never a
    user's file.
    """
    so = ort.SessionOptions()
    so.intra_op_num_threads = thread_cap(threads)
    so.inter_op_num_threads = 1
    # Emulated models run unoptimized: ORT's fusions (e.g. LayerNormFusion) would
    # swallow the Cast round trips that carry the emulation.
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if deployed
        else ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    if in_order:
        # Run nodes in the given order: range probes placed after each producer then
        # free every activation right away (the default order keeps them all alive).
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    if not prepack:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if not arena:
        so.enable_cpu_mem_arena = False
    if not spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if data_folder is not None:
        so.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", data_folder
        )
    if external:
        names = list(external)
        so.add_external_initializers(
            names, [ort.OrtValue.ortvalue_from_numpy(external[n]) for n in names]
        )
    # errors come back as exceptions; ORT's own log only when MIXPREC_LOG_LEVEL asks
    so.log_severity_level = ort_log_severity()
    providers = ["CPUExecutionProvider"]
    try:
        return _released(ort.InferenceSession(source, sess_options=so, providers=providers))
    except Exception as e:
        match = _IR_VERSION_ERROR.search(str(e))
        if match is None or not (isinstance(source, bytes) or owned):
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
        return _released(ort.InferenceSession(source, sess_options=so, providers=providers))
    except Exception as e:
        raise OrtLoadError(f"onnxruntime cannot load the model: {ort_first_line(e)}") from e


def _released(session: ort.InferenceSession) -> ort.InferenceSession:
    """``session`` without the Python-side copy of the serialized model that
    ``InferenceSession`` keeps for the session's whole life when built from bytes (its
    only use is rebuilding the session for another execution provider; mixprec's are
    CPU-only and never switch). The speed plan keeps two sessions alive: MiniLM's 86 MB
    FP32 bytes and its candidate's 56 MB were held beside ORT's own copy of the weights."""
    if getattr(session, "_model_bytes", None) is not None:
        session._model_bytes = None
    return session


@contextlib.contextmanager
def session_for(
    model: onnx.ModelProto,
    threads: int,
    optimize: bool = True,
    *,
    arena: bool = True,
    spinning: bool = True,
    deployed: bool = False,
) -> Iterator[ort.InferenceSession]:
    """A session for an in-memory model; models over 2 GB go through a temporary dir
    (ORT has read it when the session exists). ``arena``/``spinning``/``deployed``: see
    make_session."""
    if model.ByteSize() <= PROTO_LIMIT:
        check_external(model)
        source: str | bytes = model.SerializeToString()
        session = make_session(
            source, threads, optimize=optimize, arena=arena, spinning=spinning, deployed=deployed
        )
        del source  # ORT has parsed it: not held while the session runs
        yield session
        return
    with tempfile.TemporaryDirectory(prefix="mixprec-") as tmp:
        skeleton = external_skeleton(model, Path(tmp))
        path = Path(tmp) / "model.onnx"
        onnx.save_model(skeleton, path)
        yield make_session(
            str(path),
            threads,
            owned=True,
            optimize=optimize,
            arena=arena,
            spinning=spinning,
            deployed=deployed,
        )


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


def run_model(
    model: onnx.ModelProto | bytes | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    output_names: Sequence[str] | None = None,
    threads: int = 2,
    optimize: bool = True,
) -> dict[str, np.ndarray]:
    """Runs a model once on ONNX Runtime's CPU execution provider.

    bfloat16 inputs (``ml_dtypes.bfloat16`` arrays) and outputs are supported even though
    ORT's numpy bridge is not. A model over 2 GB is best passed as a path to a file saved
    with external data; an in-memory :class:`onnx.ModelProto` that large is first written
    to a temporary directory.

    Args:
        model: A model proto, serialized model bytes, or a path to an ``.onnx`` file.
        feeds: Input arrays by name.
        output_names: Outputs to fetch; all graph outputs when ``None``.
        threads: ORT intra-op thread count.
        optimize: ORT basic graph optimizations (off for emulated models).

    Returns:
        The output arrays by name.

    Raises:
        MixprecError: ORT cannot load the model, or fails to run it.
    """
    if isinstance(model, onnx.ModelProto):
        with session_for(model, threads, optimize) as session:
            return run_session(session, feeds, output_names)
    source = bytes(model) if isinstance(model, bytes | bytearray) else os.fspath(model)
    session = make_session(source, threads, optimize=optimize)
    return run_session(session, feeds, output_names)


class _OrtSession:
    """An :class:`~mixprec.runtime.engine.Session` over an ``ort.InferenceSession``."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session
        self.output_names = tuple(o.name for o in session.get_outputs())
        self.notes: list[str] = []

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        return run_session(self.session, feeds, output_names)


class OrtEngine:
    """ONNX Runtime's CPU execution provider as an :class:`~mixprec.runtime.engine.Engine`.

    Its CPU provider has no bfloat16 kernels for the ops that matter (Conv, MatMul, Add),
    so a bf16 model is checked by emulation when it runs here.
    """

    name = "ort"
    label = "ONNX Runtime"

    def missing(self) -> str | None:
        return None

    def version(self) -> str:
        return str(ort.__version__)

    def computes_bf16(self) -> bool:
        return False

    def session(
        self,
        model: onnx.ModelProto | str | os.PathLike[str],
        options: RuntimeOptions,
        *,
        timing: bool = False,
    ) -> _OrtSession:
        quiet = not timing  # timed sessions: no arena between runs, no spinning threads
        if not isinstance(model, onnx.ModelProto):
            session = make_session(
                os.fspath(model), options.threads, arena=quiet, spinning=quiet, deployed=True
            )
            return _OrtSession(session)
        with session_for(
            model, options.threads, arena=quiet, spinning=quiet, deployed=True
        ) as session:
            return _OrtSession(session)

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        return {
            "runtime": self.name,
            "label": self.label,
            "version": self.version(),
            "precision": "the model's own dtypes",
            "threads": thread_cap(options.threads),
            "cpu": cpu_features().describe(),
        }


def _probe_model(node: ir.Node, opset: int) -> onnx.ModelProto | None:
    """A one-node model of ``node`` (its inputs as graph inputs, with their dtypes) at
    ``opset``: what ORT needs to look its kernel up. None when it cannot stand alone."""
    if any(
        a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
        for a in node.attributes.values()
    ):
        return None
    values = [v for v in node.inputs if v is not None]
    if any(v.dtype is None for v in values) or any(v.dtype is None for v in node.outputs):
        return None
    proto = ir.serde.serialize_node(node)
    inputs = {v.name or "": int(v.dtype or 0) for v in values}
    outputs = {v.name: int(v.dtype or 0) for v in node.outputs if v.name}
    graph = onnx.helper.make_graph(
        [proto],
        "probe",
        [onnx.helper.make_tensor_value_info(n, t, None) for n, t in inputs.items()],
        [onnx.helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
    )
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=10
    )


def missing_kernels(model: ir.Model, op_types: Sequence[str], opset: int) -> list[str]:
    """``op_type-opset`` of the main graph's nodes of ``op_types`` that ONNX Runtime's CPU
    provider has no kernel for at ``opset`` (with their input dtypes): e.g.
    ``RandomNormalLike-22``, which ORT 1.32 implements only up to opset 21."""
    wanted = set(op_types)
    missing: list[str] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for node in model.graph:
        if node.domain not in ("", "ai.onnx") or node.op_type not in wanted:
            continue
        key = (node.op_type, tuple(int(v.dtype or 0) for v in node.inputs if v is not None))
        if key in seen:
            continue
        seen.add(key)
        probe = _probe_model(node, opset)
        if probe is None:
            continue
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 4
        try:
            ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            if "NOT_IMPLEMENTED" in str(e):
                version = onnx.defs.get_schema(node.op_type, opset).since_version
                missing.append(f"{node.op_type}-{version}")
    return sorted(set(missing))
