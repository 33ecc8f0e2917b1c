"""OpenVINO's CPU plugin as an :class:`~mixprec.runtime.engine.Engine` (extra ``[openvino]``).

OpenVINO reads ONNX through its ONNX front end and runs bfloat16 layers with real bf16
kernels on CPUs that have them (AVX-512 BF16, AMX). Its inference precision hint decides
what it does with FP32 layers: ``bf16`` (its default on such CPUs) lowers them by its own
rules, ``f32`` keeps them FP32. A mixed-precision model is therefore run with the hint
``f32`` unless the user asks otherwise: its bf16 layers run in bf16 and its FP32 layers,
the ones mixprec kept FP32 for a reason, stay FP32 (the runtime model shows it).

On a CPU without bf16 instructions OpenVINO computes bf16 layers in FP32, so it cannot
check a bf16 model's accuracy there (:meth:`OpenVinoEngine.computes_bf16` is False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.models import current_umask
from mixprec.io.runtime_fields import fp32_nodes, props_of
from mixprec.runtime.cpu import CpuFeatures, cpu_features, saturates_u8s8
from mixprec.runtime.engine import (
    FAKE_QUANTIZE,
    HostBound,
    LayerProfile,
    LoadHints,
    ModelSource,
    RuntimeLoadError,
    RuntimeOptions,
    RuntimeRunError,
    free_dropped_graphs,
)
from mixprec.runtime.ov_marks import MarkedIr, mark_fp32_ops, marked_names, runtime_model_path
from mixprec.runtime.source import model_file, probe_model, thread_cap

__all__ = ["KEPT_COMPILED", "MARKS_CONFIG", "MISSING_EXTRA", "OpenVinoEngine", "write_marked_ir"]

logger = logging.getLogger(__name__)

#: What a user without the extra is told.
MISSING_EXTRA = "--runtime openvino needs the openvino package: pip install 'mixprec[openvino]'"
_BF16 = np.dtype(ml_dtypes.bfloat16)
#: Compiled models an OpenVINO session keeps, one per set of input shapes; the least
#: recently run goes first (text windows of many lengths would otherwise pile up).
KEPT_COMPILED = 4
#: Runs of a profiled session (each layer's time: the median over them).
_PROFILED_RUNS = 12
_HINTS = {"f32": "f32", "bf16": "bf16", "f16": "f16"}
#: Set for a model whose ops carry FP32 marks under a lowered hint. The CPU plugin's
#: Snippets tokenization fuses chains of ops (an MLP: MatMul, Relu, MatMul) into one
#: subgraph that runs in the hint's precision and drops the marks of the ops inside:
#: on an avx512_bf16 EPYC (OpenVINO 2026.4.1) a marked MatMul between two unmarked ones
#: gave the unmarked model's bf16 output bit for bit; with Snippets off it ran in f32.
MARKS_CONFIG = {"SNIPPETS_MODE": "DISABLE"}


@functools.cache
def _openvino() -> Any:
    """The ``openvino`` module, or None when the extra is not installed."""
    try:
        import openvino
    except ImportError:
        return None
    return openvino


#: The process that made the Core (OpenVINO is not fork-safe: see :func:`_forked`).
_CORE: dict[str, Any] = {}
FORKED = (
    "openvino cannot run in a process forked after it ran there (its thread pools stay "
    "behind in the parent and compile_model hangs): use a fresh process"
)


def _forked() -> bool:
    """Whether this process is a fork of one that used OpenVINO: a Core, new or
    inherited, then hangs in ``compile_model`` or in its destructor."""
    return "pid" in _CORE and _CORE["pid"] != os.getpid()


def _core() -> Any:
    ov = _openvino()
    if ov is None:
        raise MixprecError(MISSING_EXTRA)
    if _forked():
        raise MixprecError(FORKED)
    if "core" not in _CORE:
        _CORE.update(core=ov.Core(), pid=os.getpid())
    return _CORE["core"]


# Lines of OpenVINO's messages that say where in its sources, not why.
_OV_NOISE = re.compile(
    r"^(Exception from |Check '.*' failed at |FrontEnd API failed with|Summary:$)"
)


def _ov_first_line(error: BaseException) -> str:
    """OpenVINO's reason on one line: its message without the source-location lines."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    useful = [line.lstrip("- ") for line in lines if not _OV_NOISE.match(line)]
    text = " ".join(useful or lines[:1]) or type(error).__name__
    return text if len(text) <= 400 else text[:397] + "..."


def _read_onnx(path: str) -> Any:
    """The ONNX front end only: OpenVINO's ``read_model`` tries every front end on a file
    it cannot read, and TensorFlow's prints parse errors on stderr."""
    ov = _openvino()
    frontend = ov.frontend.FrontEndManager().load_by_framework("onnx")
    return frontend.convert(frontend.load(path))


def _skeleton(model: ModelSource) -> onnx.ModelProto | None:
    """The model's proto without its external data (for its ``metadata_props``); None
    where it is no ONNX model (the front end then says why)."""
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        if isinstance(model, bytes | bytearray):
            return onnx.load_model_from_string(bytes(model))
        return onnx.load(os.fspath(model), load_external_data=False)
    except Exception:
        return None


def _read_model(model: ModelSource, tmp: Path) -> Any:
    """OpenVINO's model of ``model``: the IR its metadata names (beside the file), else
    the ONNX model read by the front end, with the FP32 marks its metadata lists (written
    to an IR in ``tmp`` and read back: only an IR's marks are the typed ones the CPU
    plugin honours)."""
    proto = _skeleton(model)
    if proto is None:
        return _read_onnx(model_file(model, tmp))
    props = props_of(proto)
    folder = None
    if isinstance(model, str | os.PathLike):
        folder = Path(os.fspath(model)).resolve().parent
    xml = runtime_model_path(props, folder)
    if xml is not None:
        return _core().read_model(str(xml))
    read = _read_onnx(model_file(model, tmp))
    names = fp32_nodes(proto)
    if names is None:
        return read
    return _write_marked(read, proto.graph, names, tmp / "marked.xml")[1]


def _write_marked(
    ov_model: Any, graph: onnx.GraphProto, names: Sequence[str], xml: Path
) -> tuple[MarkedIr, Any]:
    """Writes ``ov_model`` with the ops of the nodes ``names`` marked to the IR ``xml``
    (weights FP32; temporary files beside it, renamed, the ``.bin`` first) and reads it
    back: (what was marked, the model read back).

    Raises:
        MixprecError: the IR read back does not carry the marks on exactly the ops marked
            (an OpenVINO that writes them otherwise), or it cannot be written.
    """
    ov = _openvino()
    result = mark_fp32_ops(ov_model, graph, names)
    if result.unmapped:  # an Identity, a node OpenVINO folded: nothing of its own to mark
        logger.info("no OpenVINO op to mark for: %s", ", ".join(result.unmapped[:20]))
    fd, tmp = tempfile.mkstemp(prefix=f".{xml.stem}.", suffix=".xml", dir=xml.resolve().parent)
    os.close(fd)
    tmp_xml = Path(tmp)
    tmp_bin = tmp_xml.with_suffix(".bin")
    try:
        try:
            ov.save_model(ov_model, str(tmp_xml), compress_to_fp16=False)
            back = _core().read_model(str(tmp_xml))
        except Exception as e:
            raise MixprecError(f"openvino cannot write {xml.name}: {_ov_first_line(e)}") from e
        if marked_names(back) != result.marked:
            raise MixprecError(
                f"openvino {ov.get_version()} did not keep the FP32 marks in the IR it wrote "
                f"({len(marked_names(back))} of {len(result.marked)} ops): cannot write "
                f"{xml.name}"
            )
        for made in (tmp_xml, tmp_bin):  # mkstemp makes 0600; written files follow the umask
            os.chmod(made, 0o666 & ~current_umask())
        os.replace(tmp_bin, xml.with_suffix(".bin"))
        os.replace(tmp_xml, xml)
    finally:
        for left in (tmp_xml, tmp_bin):
            with contextlib.suppress(OSError):
                left.unlink()
    return dataclasses.replace(result, xml=str(xml)), back


def write_marked_ir(model: onnx.ModelProto, xml: str | os.PathLike[str]) -> MarkedIr:
    """Writes the OpenVINO IR ``xml`` (and its ``.bin``) of ``model`` (FP32), with the
    nodes its :data:`~mixprec.io.runtime_fields.FP32_NODES_KEY` lists marked to stay FP32
    under OpenVINO's bf16 hint. Atomic (temporary files, renamed); read back and checked.

    Example:
        >>> write_marked_ir(proto, "model_bf16.xml").marked  # doctest: +SKIP
        frozenset({'softmax_0', ...})

    Raises:
        MixprecError: openvino is missing, the model lists no FP32 nodes, OpenVINO
            cannot read it, or the marks do not survive the IR (one line).
    """
    _core()
    names = fp32_nodes(model)
    if names is None:
        raise MixprecError("the model lists no FP32 nodes: nothing to mark")
    target = Path(xml)
    try:
        with tempfile.TemporaryDirectory(prefix="mixprec-ov-") as tmp:
            read = _read_onnx(model_file(model, Path(tmp)))
            return _write_marked(read, model.graph, names, target)[0]
    except MixprecError:
        raise
    except Exception as e:
        raise MixprecError(f"openvino cannot load the model: {_ov_first_line(e)}") from e


class _OvSession:
    """A model read by OpenVINO, compiled for the input shapes it is run with.

    Each new set of input shapes compiles the model again with those shapes fixed
    (``Model.reshape``), as OpenVINO advises for its CPU plugin: with dynamic shapes it
    fuses less, and on PP-OCR's orientation classifier a bf16 model ran 2x slower and
    its FP32 islands no longer took the Convolution's output before rounding it (rel L2
    0.078 instead of 0.038). A model that cannot be reshaped runs with dynamic shapes,
    with a warning logged and a note in :attr:`notes`. The last :data:`KEPT_COMPILED`
    compiled models are kept (least recently run dropped first).
    """

    #: OpenVINO's tensors are host memory here: timing runs :meth:`run`.
    binds_on_device = False

    def __init__(self, model: Any, config: Mapping[str, str], device: str = "CPU") -> None:
        self.model = model
        self.config = dict(config)
        #: What ran otherwise than asked (a model that kept dynamic shapes), for reports.
        self.notes: list[str] = []
        self.device = device
        self._compiled: OrderedDict[tuple[Any, ...], tuple[Any, Any]] = OrderedDict()
        self._last: tuple[Any, ...] | None = None
        self.output_names = tuple(port.get_any_name() for port in model.outputs)
        self._inputs = {name for port in model.inputs for name in port.get_names()}

    def _compile(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        error: type[MixprecError] = RuntimeLoadError,
    ) -> tuple[Any, Any]:
        """(compiled model, infer request) for ``shapes`` (empty: as the model says).

        A failure raises ``error``: :meth:`run` passes :class:`RuntimeRunError`, since the
        model loaded and only these shapes failed (OpenVINO's CPU plugin allocates its
        buffers when it compiles, so a shape can be too large for it while others run).
        """
        key = tuple(sorted(shapes.items()))
        shown = ", ".join(f"{k} {list(v)}" for k, v in key)
        if key not in self._compiled:
            model = self._reshaped(shapes, shown) if shapes else self.model
            try:
                compiled = _core().compile_model(model, self.device, self.config)
            except Exception as e:
                where = f" for input shapes {shown}" if shapes else ""
                raise error(f"openvino cannot compile the model{where}: {_ov_first_line(e)}") from e
            self._compiled[key] = (compiled, compiled.create_infer_request())
            while len(self._compiled) > KEPT_COMPILED:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        self._last = key
        return self._compiled[key]

    @property
    def compiled_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """The input shapes of the compiled models kept, least recently run first."""
        return [dict(key) for key in self._compiled]

    def _reshaped(self, shapes: Mapping[str, tuple[int, ...]], shown: str) -> Any:
        """A copy of the model with ``shapes`` fixed; the model as it is (dynamic shapes)
        where OpenVINO refuses them (a graph whose shapes it cannot infer statically, as
        an If branch that only runs on other inputs), said once in :attr:`notes`."""
        ov = _openvino()
        model = self.model.clone()
        try:
            model.reshape({k: ov.PartialShape(list(v)) for k, v in shapes.items()})
        except Exception as e:
            if not self.notes:
                note = (
                    f"openvino cannot fix the input shapes ({shown}: {_ov_first_line(e)}): "
                    "the model runs with dynamic shapes (it fuses less: slower, and bf16 "
                    "layers may round otherwise)"
                )
                logger.warning("%s", note)
                self.notes.append(note)
            return self.model
        return model

    @property
    def request(self) -> Any:
        """The infer request of the model compiled for the last shapes it ran with."""
        return self._compile({})[1] if self._last is None else self._compiled[self._last][1]

    @property
    def compiled(self) -> Any:
        """The model compiled for the last shapes it ran with (else as it is)."""
        if self._last is None:
            return self._compile({})[0]
        return self._compiled[self._last][0]

    def _tensor(self, name: str, array: np.ndarray) -> Any:
        """What ``infer`` takes for ``array``: the array itself, as a plain user of
        OpenVINO passes it (its Python API wraps arrays at about 0.1 ms a call on this
        project's EPYC: on Silero VAD, a 0.16 ms model, optimize timed OpenVINO at 0.9x
        ONNX Runtime with tensors made here, and a plain call ran 1.35x); a bf16 array as
        a tensor of OpenVINO's bf16 type."""
        array = np.asarray(array, order="C")  # ascontiguousarray would make a 0-d input 1-d
        if array.dtype == _BF16:
            ov = _openvino()
            return ov.Tensor(array.view(np.uint16), list(array.shape), ov.Type.bf16)
        return array

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        names = list(output_names) if output_names else list(self.output_names)
        arrays = {k: np.asarray(v) for k, v in feeds.items() if k in self._inputs}
        shapes = {k: tuple(a.shape) for k, a in arrays.items()}
        compiled, request = self._compile(shapes, RuntimeRunError)
        ov = _openvino()
        try:
            request.infer({k: self._tensor(k, a) for k, a in arrays.items()}, share_inputs=True)
            out = {}
            for name in names:
                port = next((p for p in compiled.outputs if name in p.get_names()), None)
                if port is None:
                    raise RuntimeRunError(f"openvino has no output {name!r}")
                tensor = request.get_tensor(port)
                data = np.array(tensor.data, copy=True)
                if tensor.element_type == ov.Type.bf16:
                    data = data.view(np.uint16).view(_BF16)  # OpenVINO shows the bits as fp16
                out[name] = data
            return out
        except RuntimeRunError:
            raise
        except Exception as e:
            raise RuntimeRunError(f"openvino failed to run the model: {_ov_first_line(e)}") from e

    def bind(self, feeds: Mapping[str, np.ndarray]) -> HostBound:
        return HostBound(self, feeds)


class OpenVinoEngine:
    """OpenVINO (``--runtime openvino``) on its CPU plugin, or the device
    ``RuntimeOptions.provider`` names."""

    name = "openvino"
    label = "OpenVINO"
    qdq_layout = FAKE_QUANTIZE

    def missing(self, options: RuntimeOptions | None = None) -> str | None:
        if _openvino() is None:
            return MISSING_EXTRA
        if _forked():
            return FORKED
        device = _device(options)
        if device == "CPU":
            return None
        devices = list(_core().available_devices)
        if device.split(".")[0] in {d.split(".")[0] for d in devices} or device in _VIRTUAL:
            return None
        return f"openvino has no {device} device here (available: {', '.join(devices)})"

    def version(self) -> str:
        ov = _openvino()
        return "not installed" if ov is None else str(ov.get_version()).split("-")[0]

    def check_options(self, options: RuntimeOptions) -> None:
        device = options.provider
        if device is not None and (not device or device != device.upper()):
            raise MixprecError(
                f"openvino devices are upper-case names (CPU, GPU, NPU, AUTO), not {device!r}"
            )

    def computes_bf16(self) -> bool:
        if _openvino() is None or not cpu_features().bf16:
            return False
        return "BF16" in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")

    def refuses_bf16(self) -> bool:
        return False  # it computes bf16 layers in f32 where the CPU has no bf16

    def runs_contrib_ops(self) -> bool:
        return False

    def saturates_int8(self) -> bool:
        return saturates_u8s8()  # its AVX2 int8 kernels pair u8 x s8 products too

    def nbits_accuracy_level(self, bits: int, cpu: CpuFeatures | None = None) -> tuple[int, str]:
        return 0, "0: OpenVINO runs no MatMulNBits (weight-only models run in ONNX Runtime)"

    def has_kernel(self, node: ir.Node, opsets: Mapping[str, int]) -> bool:
        probe = probe_model(node, opsets)
        if probe is None:
            return True
        try:
            with tempfile.TemporaryDirectory(prefix="mixprec-ov-") as tmp:
                _core().compile_model(_read_onnx(model_file(probe, Path(tmp))), "CPU")
        except MixprecError:
            raise
        except Exception:
            return False
        return True

    def kernel_graph(self, model: onnx.ModelProto) -> onnx.ModelProto | None:
        return None  # its runtime model is not ONNX

    def layer_profile(
        self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], options: RuntimeOptions
    ) -> LayerProfile | None:
        """The CPU plugin's performance counts (``PERF_COUNT``): each executed layer's
        real time, named as in its runtime model (returned as a graph of those layers,
        each under its layer type)."""
        try:
            session = self.session(model, options)
            session.config["PERF_COUNT"] = "YES"
            times: dict[str, list[float]] = {}
            for _ in range(_PROFILED_RUNS):
                session.run(feeds)
                for info in session.request.get_profiling_info():
                    seconds = info.real_time.total_seconds()
                    times.setdefault(info.node_name, []).append(seconds)
            graph = _runtime_graph(session.compiled.get_runtime_model())
        except Exception as e:  # a profile is a hint: without one, nothing is read from it
            logger.info("no per-layer counts: %s", _ov_first_line(e))
            return None
        ran = {n.name for n in graph.node}  # the counts also list layers fused away
        return LayerProfile(graph, {k: float(np.median(v)) for k, v in times.items() if k in ran})

    def config(self, options: RuntimeOptions, ov_model: Any = None) -> dict[str, str]:
        """The CPU plugin's properties for ``options``: the model's own dtypes (hint f32)
        unless a precision is asked for; with :data:`MARKS_CONFIG` where ``ov_model``
        (read by OpenVINO) carries FP32 marks and the hint lowers FP32 layers."""
        config = {
            "INFERENCE_PRECISION_HINT": _HINTS[options.precision or "f32"],
            "INFERENCE_NUM_THREADS": str(thread_cap(options.threads)),
            "PERFORMANCE_HINT": options.performance.upper(),
        }
        lowered = options.precision not in (None, "f32")
        if lowered and ov_model is not None and marked_names(ov_model):
            config.update(MARKS_CONFIG)
        return config

    def session(
        self,
        model: ModelSource,
        options: RuntimeOptions,
        *,
        timing: bool = False,
        hints: LoadHints | None = None,
    ) -> _OvSession:
        """Reads ``model`` (``hints`` are ONNX Runtime's memory knobs: not used here)."""
        _core()  # the extra is installed, and this process may use OpenVINO
        missing = self.missing(options)
        if missing is not None:
            raise RuntimeLoadError(missing)
        free_dropped_graphs(model)
        try:
            with tempfile.TemporaryDirectory(prefix="mixprec-ov-") as tmp:
                read = _read_model(model, Path(tmp))
        except MixprecError:
            raise
        except Exception as e:
            raise RuntimeLoadError(f"openvino cannot load the model: {_ov_first_line(e)}") from e
        return _OvSession(read, self.config(options, read), _device(options))

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        precision = options.precision or "f32"
        if precision == "f32":
            how = "the model's own dtypes (hint f32)"
            if not self.computes_bf16():
                how += "; bf16 layers compute in f32 on this CPU"
        else:
            how = f"OpenVINO lowers FP32 layers by its own rules (hint {precision})"
        return {
            "runtime": self.name,
            "label": self.label,
            "version": self.version(),
            "precision": how,
            "threads": thread_cap(options.threads),
            "cpu": cpu_features().describe(),
        } | ({"device": options.provider} if options.provider not in (None, "CPU") else {})


def _runtime_graph(runtime_model: Any) -> onnx.GraphProto:
    """The layers of a compiled model's runtime model as ONNX nodes: name, layer type
    (``Convolution``, ``MaxPool``, ``Subgraph``: a fused group) and the edges between
    them, so that :mod:`mixprec.int8.profiled` reads it as it reads ONNX Runtime's."""
    nodes = []
    for op in runtime_model.get_ordered_ops():
        name = op.get_friendly_name()
        info, op_type = op.get_rt_info(), op.get_type_name()
        if "layerType" in info:  # an RTMap: no .get()
            op_type = str(info["layerType"].astype(str))
        sources = [i.get_source_output() for i in op.inputs()]
        nodes.append(
            onnx.helper.make_node(
                op_type,
                [f"{s.get_node().get_friendly_name()}:{s.get_index()}" for s in sources],
                [f"{name}:{k}" for k in range(op.get_output_size())],
                name=name,
            )
        )
    return onnx.helper.make_graph(nodes, "runtime", [], [])


#: Devices OpenVINO makes of others (not listed by ``available_devices``).
_VIRTUAL = ("AUTO", "MULTI", "HETERO", "BATCH")


def _device(options: RuntimeOptions | None) -> str:
    return (options.provider if options is not None else None) or "CPU"
