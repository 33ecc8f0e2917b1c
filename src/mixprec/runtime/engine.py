"""The runtime door: what mixprec needs of an inference engine, and the options a user sets.

An engine loads a model into a :class:`Session` (run feeds by input name, get outputs by
name, or bind them once on the engine's device for timing), tells its version, and
answers capability questions (:class:`Engine`: computes bf16, refuses bf16, runs contrib
ops, fuses QDQ, has a kernel for a node) so that callers never test an engine's name.
ONNX Runtime (:mod:`mixprec.runtime.ort`: CPU, CUDA and TensorRT providers) and OpenVINO
(:mod:`mixprec.runtime.openvino`) implement it; :mod:`mixprec.runtime.engines` fills
:data:`REGISTRY`, the one table ``--runtime NAME`` reads, and lets a caller register
another engine. Every place that runs or times a model takes a :class:`RuntimeOptions`.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.runtime.cpu import CpuFeatures

__all__ = [
    "FAKE_QUANTIZE",
    "GRAPH_OPTIMIZATIONS",
    "ORT_PROVIDERS",
    "PERFORMANCE_HINTS",
    "PRECISIONS",
    "QDQ_LAYOUTS",
    "REGISTRY",
    "RUNTIME_NAMES",
    "SELECTORS",
    "TIMING_HINTS",
    "BoundRun",
    "DeviceBuffer",
    "Engine",
    "HostBound",
    "LayerProfile",
    "LoadHints",
    "ModelSource",
    "RuntimeLoadError",
    "RuntimeOptions",
    "RuntimeRunError",
    "Session",
    "free_dropped_graphs",
    "provider_named",
    "runtime_names",
]

#: ``RuntimeOptions.provider`` -> ONNX Runtime's execution providers, in priority order.
ORT_PROVIDERS: Mapping[str, tuple[str, ...]] = {
    "cpu": ("CPUExecutionProvider",),
    "cuda": ("CUDAExecutionProvider", "CPUExecutionProvider"),
    "tensorrt": (
        "TensorrtExecutionProvider",
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ),
}


def provider_named(execution_provider: str) -> str | None:
    """The ``RuntimeOptions.provider`` whose first execution provider is
    ``execution_provider`` (``"CUDAExecutionProvider"`` -> ``"cuda"``), or None."""
    found = [k for k, names in ORT_PROVIDERS.items() if names[0] == execution_provider]
    return found[0] if found else None


#: The built-in engines, the default first (:func:`runtime_names` lists the registered ones).
RUNTIME_NAMES = ("ort", "openvino")
#: Inference precisions a user may ask an engine for. ``None`` (the default) runs every
#: tensor in the dtype the model gives it, which is what a mixed-precision model needs;
#: "bf16"/"f16" let an engine lower FP32 layers by its own rules (OpenVINO's hint).
PRECISIONS = ("f32", "bf16", "f16")
#: Performance hints: one request at a time (``latency``) or many (``throughput``).
PERFORMANCE_HINTS = ("latency", "throughput")
#: Graph optimizations an engine may apply before running: ``all`` (what a deployment
#: gets: ONNX Runtime fuses QuantizeLinear/DequantizeLinear pairs into integer kernels),
#: ``basic`` (constant folding, redundant nodes), ``off`` (none: an emulated model's Cast
#: round trips must survive). Engines that cannot choose (OpenVINO) run their own.
GRAPH_OPTIMIZATIONS = ("all", "basic", "off")

#: The engines by ``--runtime`` name (filled by :mod:`mixprec.runtime.engines`, which
#: registers the built-in ones and :func:`~mixprec.runtime.engines.register_engine`'s).
REGISTRY: dict[str, Engine] = {}


def runtime_names() -> tuple[str, ...]:
    """The ``--runtime`` names registered now (the built-in ones first)."""
    return tuple(REGISTRY) or RUNTIME_NAMES


class RuntimeLoadError(MixprecError):
    """An engine could not load (read or compile) a model."""


class RuntimeRunError(MixprecError):
    """An engine loaded a model but could not run it."""


@dataclass(frozen=True)
class RuntimeOptions:
    """Which engine runs a model, and how (frozen; validated on creation).

    Attributes:
        name: A registered engine: ``"ort"`` (ONNX Runtime) or ``"openvino"``.
        threads: Intra-op threads (0: the engine's choice; ``MIXPREC_THREADS`` caps it).
        precision: ``None`` runs the model's own dtypes; ``"f32"``, ``"bf16"`` or ``"f16"``
            is OpenVINO's inference precision hint (ONNX Runtime takes only ``None``/f32).
        performance: ``"latency"`` or ``"throughput"`` (OpenVINO's performance hint).
        provider: Where the engine computes; ``None`` is its default. ONNX Runtime:
            ``"cpu"``, ``"cuda"`` or ``"tensorrt"`` (the latter two from onnxruntime-gpu);
            OpenVINO: its device (``"CPU"``, ``"GPU"``...). Each engine checks the value
            (:meth:`Engine.check_options`); whether it is installed here is asked when a
            session is made (one error line naming what is missing).
        optimization: One of :data:`GRAPH_OPTIMIZATIONS` (default ``"all"``).

    Example:
        >>> RuntimeOptions("ort", threads=4, provider="cpu").provider
        'cpu'
    """

    name: str = "ort"
    threads: int = 2
    precision: str | None = None
    performance: str = "latency"
    provider: str | None = None
    optimization: str = "all"

    def __post_init__(self) -> None:
        engine = REGISTRY.get(self.name)
        if engine is None and (REGISTRY or self.name not in RUNTIME_NAMES):
            raise MixprecError(
                f"unknown runtime {self.name!r}: use one of {', '.join(runtime_names())}"
            )
        if isinstance(self.threads, bool) or not isinstance(self.threads, int):
            raise MixprecError(f"threads must be an int, not {type(self.threads).__name__}")
        if self.threads < 0:
            raise MixprecError(
                f"threads must be >= 0 (0: the runtime's choice), got {self.threads}"
            )
        if self.precision is not None and self.precision not in PRECISIONS:
            raise MixprecError(
                f"unknown inference precision {self.precision!r}: use {', '.join(PRECISIONS)}"
            )
        if self.performance not in PERFORMANCE_HINTS:
            raise MixprecError(
                f"unknown performance hint {self.performance!r}: use {', '.join(PERFORMANCE_HINTS)}"
            )
        if self.optimization not in GRAPH_OPTIMIZATIONS:
            raise MixprecError(
                f"unknown graph optimization {self.optimization!r}: "
                f"use {', '.join(GRAPH_OPTIMIZATIONS)}"
            )
        if self.provider is not None and not isinstance(self.provider, str):
            raise MixprecError(f"provider must be a str, not {type(self.provider).__name__}")
        if engine is not None:
            engine.check_options(self)


@dataclass(frozen=True, eq=False)
class LoadHints:
    """How a session holds its memory (hints: an engine may ignore what it cannot do).

    Attributes:
        external: Large initializers handed over in memory, used in place (the model
            refers to them by name without their bytes).
        data_folder: Where the external-data references of a model given as bytes live.
        owned: The model's file is mixprec's own temporary file (may be rewritten, e.g.
            to lower an IR version the engine does not know).
        prepack: Keep a repacked copy of the weights (faster MatMul/Conv, twice the memory).
        in_order: Run nodes in the given order (probes after each producer then free
            every activation right away).
        arena: Keep activations allocated between runs (off for sessions kept side by side).
        spinning: Let pool threads spin while they wait for work (ONNX Runtime's default:
            a run's parallel sections then start without waking threads).
        stop_spinning: The threads stop spinning when a run ends (for sessions timed side
            by side: they spin within their own run, as served, and leave the cores to the
            next session in the round).
        profile_to: A folder the engine writes its per-kernel profile and its optimized
            graph into (:meth:`Engine.layer_profile`); None: no profile.
    """

    external: Mapping[str, np.ndarray] | None = None
    data_folder: str | None = None
    owned: bool = False
    prepack: bool = True
    in_order: bool = False
    arena: bool = True
    spinning: bool = True
    stop_spinning: bool = False
    profile_to: str | None = None


@dataclass(frozen=True)
class LayerProfile:
    """Each kernel's time as the engine's own profiler records it (:meth:`Engine.
    layer_profile`): ``graph``, the optimized graph it ran (no weights), and ``seconds``,
    each of its kernels' median time per run, by node name."""

    graph: onnx.GraphProto
    seconds: dict[str, float]


#: The hints of a session timed beside others: as served (arena, spinning threads within
#: a run), but its threads stop spinning when a run ends. With spinning off, ONNX Runtime
#: ran PP-OCR cls 1.4-1.9x and MNIST 1.4-1.6x slower than its defaults on an EPYC with 2
#: cores, and every other runtime looked faster than it is where the model is served.
TIMING_HINTS = LoadHints(stop_spinning=True)


@dataclass(frozen=True)
class DeviceBuffer:
    """An input the caller holds in memory of its own (a torch tensor's storage, on the
    CPU or a GPU), bound without a copy by sessions that offer ``run_buffers``.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        device_id: The device's index.
        dtype: The element type.
        shape: The dims.
        pointer: The address of the first element (contiguous, kept alive by the caller
            until the run returns).
    """

    device: str
    device_id: int
    dtype: np.dtype
    shape: tuple[int, ...]
    pointer: int


class BoundRun(Protocol):
    """Feeds bound once where a session computes (its device's memory), for repeated runs."""

    def run(self) -> None:
        """Runs the model once on the bound feeds; the outputs stay where they were made."""
        ...

    def outputs(self) -> dict[str, np.ndarray]:
        """The last run's outputs by name, copied to host memory."""
        ...


class Session(Protocol):
    """A model loaded by an engine."""

    @property
    def output_names(self) -> tuple[str, ...]: ...

    @property
    def notes(self) -> list[str]:
        """What the engine ran otherwise than asked (OpenVINO keeping dynamic shapes),
        one line each, for reports."""
        ...

    #: Whether :meth:`bind` puts the feeds in a device's own memory (a GPU): timing then
    #: runs the bound feeds, so that host-device copies are not timed. False on a CPU,
    #: where timing runs :meth:`run` as it always did.
    binds_on_device: bool

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Runs the model once; the outputs by name (all when ``output_names`` is None).

        Raises:
            RuntimeRunError: the engine failed to run the model.
        """
        ...

    def bind(self, feeds: Mapping[str, np.ndarray]) -> BoundRun:
        """``feeds`` copied once to where the session computes, its outputs bound there
        (ONNX Runtime's ``io_binding``; :class:`HostBound` where an engine has no device
        memory of its own). Its outputs equal :meth:`run`'s.

        Raises:
            RuntimeRunError: the engine failed to bind or run the model.
        """
        ...


# Optional, beside the protocol: ``run_buffers(inputs, device) -> list`` (ONNX Runtime's
# sessions) runs on inputs given as arrays or :class:`DeviceBuffer` and returns the
# outputs, in ``output_names`` order, where ``device`` holds them, as objects torch reads
# through DLPack. Callers fall back to :meth:`Session.run` where a session has none.


class HostBound:
    """A :class:`BoundRun` for a session without device memory: each run is ``run(feeds)``."""

    def __init__(self, session: Session, feeds: Mapping[str, np.ndarray]) -> None:
        self.session = session
        self.feeds = dict(feeds)
        self.last: dict[str, np.ndarray] = {}

    def run(self) -> None:
        self.last = self.session.run(self.feeds)

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(self.last)


#: What an engine loads: a proto, serialized bytes, or a path.
ModelSource = onnx.ModelProto | bytes | str | os.PathLike[str]

#: Models from this size on have dropped graphs collected before their session is built
#: (:func:`free_dropped_graphs`).
_COLLECT_FROM = 16 << 20


def _source_bytes(model: ModelSource) -> int:
    """The size of ``model`` as given: its protobuf's, its bytes', or its file's."""
    if isinstance(model, onnx.ModelProto):
        return model.ByteSize()
    if isinstance(model, bytes | bytearray):
        return len(model)
    return os.path.getsize(model) if os.path.isfile(model) else 0


def free_dropped_graphs(model: ModelSource) -> None:
    """Runs the cycle collector before a session of a large ``model`` is built.

    mixprec's graphs (onnx_ir models: nodes and values refer to each other) are freed only
    by the cycle collector, and the candidates a loop drops (the tuner's, the speed
    plan's, the guard's) held their weights until its next full pass: the INT8 guard's
    repair on MiniLM-L6 (90 MB) grew 170 MB a candidate, to 1.58 GB; with a collection
    before each session it stayed near 1.03 GB.
    """
    if _source_bytes(model) >= _COLLECT_FROM:
        gc.collect()


#: How an engine reads INT8's Q/DQ pairs: "selectors" (ONNX Runtime: a pattern of DQs,
#: an op and a Q becomes one integer kernel, so a layer's output is quantized too) or
#: "fake-quantize" (OpenVINO: each pair is a FakeQuantize fused into the op before it;
#: pairs belong on the inputs of layers only, see :mod:`mixprec.int8.layout`).
SELECTORS, FAKE_QUANTIZE = "selectors", "fake-quantize"
QDQ_LAYOUTS = (SELECTORS, FAKE_QUANTIZE)


class Engine(Protocol):
    """An inference engine mixprec can validate and time models in.

    Callers ask an engine what it can do (the capability questions below); they never
    test its name.
    """

    #: The ``--runtime`` name.
    name: str
    #: The engine's name for people ("ONNX Runtime", "OpenVINO").
    label: str
    #: Where INT8's Q/DQ pairs serve its integer kernels (:data:`QDQ_LAYOUTS`).
    qdq_layout: str

    def missing(self, options: RuntimeOptions | None = None) -> str | None:
        """``None`` when the engine (with ``options``' provider/device) can be used here,
        else one line saying what is missing and what to install."""
        ...

    def version(self) -> str: ...

    def check_options(self, options: RuntimeOptions) -> None:
        """Raises :class:`MixprecError` (one line) for options this engine does not take:
        an unknown provider or device, an inference precision hint it has not."""
        ...

    def computes_bf16(self) -> bool:
        """Whether this engine runs a model's bfloat16 layers in bfloat16 on this CPU."""
        ...

    def refuses_bf16(self) -> bool:
        """Where it does not compute bf16: whether it refuses a bf16 model (a load or run
        error: ONNX Runtime's CPU provider has no bf16 kernels for most ops; the caller
        then runs an FP32 emulation) rather than silently computing its bf16 layers in
        f32 (OpenVINO on a CPU without bf16, whose results would look like bf16's)."""
        ...

    def runs_contrib_ops(self) -> bool:
        """Whether it runs ``com.microsoft`` contrib ops (MatMulNBits,
        GatherBlockQuantized): what a weight-only model is made of."""
        ...

    def saturates_int8(self) -> bool:
        """Whether its integer kernels on this CPU saturate u8 x s8 products (x86 without
        VNNI: pairs of them summed in 16 bits), so that INT8 weights need 7 bits
        (``reduce_range``)."""
        ...

    def nbits_accuracy_level(self, bits: int, cpu: CpuFeatures | None = None) -> tuple[int, str]:
        """The ``MatMulNBits`` ``accuracy_level`` that runs ``bits``-bit weights fastest
        on this CPU (or ``cpu``), and why (0: float compute; 4: int8 compute)."""
        ...

    def has_kernel(self, node: ir.Node, opsets: Mapping[str, int]) -> bool:
        """Whether it has a kernel for ``node`` as it stands (op, domain, attributes,
        input and output dtypes) at ``opsets`` (domain -> version). A node that cannot be
        tried alone (subgraph attributes, unknown dtypes) counts as having one."""
        ...

    def kernel_graph(self, model: onnx.ModelProto) -> onnx.ModelProto | None:
        """The graph the engine really runs after its optimizations (which kernels it
        chose), or None where it cannot show it."""
        ...

    def layer_profile(
        self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], options: RuntimeOptions
    ) -> LayerProfile | None:
        """``model`` run a few times on ``feeds`` with the engine's profiler on: each
        kernel's time, named as in the optimized graph it returns; None where the engine
        cannot show one (its kernels are then not attributed to layers)."""
        ...

    def session(
        self,
        model: ModelSource,
        options: RuntimeOptions,
        *,
        timing: bool = False,
        hints: LoadHints | None = None,
    ) -> Session:
        """Loads ``model`` (a proto, serialized bytes, or a path whose external data sits
        beside it).

        ``timing`` sets the session up for being timed beside others
        (:data:`TIMING_HINTS`); ``hints`` say how to hold memory (:class:`LoadHints`).

        Raises:
            RuntimeLoadError: the engine cannot read or compile the model, or the
                provider asked for cannot start here.
        """
        ...

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        """What ran, for reports and ``--json``: runtime, version, precision, threads."""
        ...
