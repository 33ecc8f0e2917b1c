"""ONNX Runtime as an :class:`~mixprec.runtime.engine.Engine`: what it can do on this CPU
(bf16, contrib ops, saturating INT8 kernels, the 4/8-bit MatMul's accuracy level), its
kernel probes (a kernel for a node, the graph of kernels it runs, each kernel's time from
its profiler) and its sessions (:mod:`mixprec.runtime.ort_sessions`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mixprec.core.config import ort_log_severity
from mixprec.core.errors import MixprecError
from mixprec.core.limits import INLINE_LIMIT
from mixprec.runtime.cpu import CpuFeatures, cpu_features, saturates_u8s8
from mixprec.runtime.engine import (
    SELECTORS,
    TIMING_HINTS,
    LayerProfile,
    LoadHints,
    ModelSource,
    RuntimeOptions,
    free_dropped_graphs,
)
from mixprec.runtime.ort_sessions import (
    PROVIDERS,
    OrtLoadError,
    OrtSession,
    make_session,
    open_session,
    ort_first_line,
    session_for,
    through_file,
)
from mixprec.runtime.source import probe_model, skeleton_file, thread_cap

__all__ = ["OrtEngine"]

logger = logging.getLogger(__name__)

#: Runs of a profiled session (each kernel's time: the median over them).
_PROFILED_RUNS = 12


#: Measured on this project's CPUs (ONNX Runtime 1.31/1.32, 2 threads, one 4096x4096
#: MatMul at M=1, docs/guides/weights.md): int4 block 32 runs 1.7-2.3x faster at level 4
#: than at 0, and 8-bit weights have no float-compute kernel at all (level 0 is 12-20x
#: slower than the FP32 MatMul).
_LEVEL_WHY = "4: int8 compute ({what}; measured 1.7-2.3x faster than float compute for int4)"


def _accuracy_level(bits: int, cpu: CpuFeatures | None = None) -> tuple[int, str]:
    """``accuracy_level`` for this CPU, and why: 4 (int8 compute) wherever ONNX Runtime
    has int8 kernels for it (x86 with AVX2, AVX-VNNI or AVX-512; ARM64), and always for
    8-bit weights (their float-compute path is 12-20x slower than FP32); 0 otherwise."""
    cpu = cpu or cpu_features()
    machine = platform.machine().lower()
    if cpu.vnni:
        what = "this CPU has INT8 VNNI"
    elif cpu.avx512 or cpu.avx2:
        what = "this CPU has AVX2" if not cpu.avx512 else "this CPU has AVX-512"
    elif machine in ("arm64", "aarch64"):
        what = "an ARM64 CPU"
    elif bits == 8:
        return 4, "4: int8 compute (8-bit weights have no fast float-compute kernel)"
    else:
        return 0, "0: float compute (no int8 kernels on this CPU)"
    return 4, _LEVEL_WHY.format(what=what)


class OrtEngine:
    """ONNX Runtime as an :class:`~mixprec.runtime.engine.Engine` (``--runtime ort``), on
    its CPU provider or, with ``provider="cuda"``/``"tensorrt"``, onnxruntime-gpu's.

    Its CPU provider has no bfloat16 kernels for the ops that matter (Conv, MatMul, Add),
    so it refuses a bf16 model, which is then checked by emulation.
    """

    name = "ort"
    label = "ONNX Runtime"
    qdq_layout = SELECTORS

    def missing(self, options: RuntimeOptions | None = None) -> str | None:
        provider = (options.provider if options is not None else None) or "cpu"
        wanted = PROVIDERS[provider][0]
        available = ort.get_available_providers()
        if wanted in available:
            return None
        return (
            f"onnxruntime's {wanted} is not available here (onnxruntime {ort.__version__} has "
            f"{', '.join(available)}); install onnxruntime-gpu on a machine with a CUDA device"
        )

    def version(self) -> str:
        return str(ort.__version__)

    def check_options(self, options: RuntimeOptions) -> None:
        if options.precision not in (None, "f32"):
            raise MixprecError(
                f"onnxruntime has no inference precision hint ({options.precision!r}): it runs "
                "the model's own dtypes; use --runtime openvino for that"
            )
        if options.provider is not None and options.provider not in PROVIDERS:
            raise MixprecError(
                f"unknown onnxruntime provider {options.provider!r}: use {', '.join(PROVIDERS)}"
            )

    def computes_bf16(self) -> bool:
        return False

    def refuses_bf16(self) -> bool:
        return True

    def runs_contrib_ops(self) -> bool:
        return True

    def saturates_int8(self) -> bool:
        return saturates_u8s8()

    def nbits_accuracy_level(self, bits: int, cpu: CpuFeatures | None = None) -> tuple[int, str]:
        return _accuracy_level(bits, cpu)

    def has_kernel(self, node: ir.Node, opsets: Mapping[str, int]) -> bool:
        probe = probe_model(node, opsets)
        if probe is None:
            return True
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 4
        try:
            open_session(probe.SerializeToString(), so, list(PROVIDERS["cpu"]))
        except Exception as e:
            text = str(e)
            return "NOT_IMPLEMENTED" not in text and "is not a registered function/op" not in text
        return True

    def kernel_graph(self, model: onnx.ModelProto) -> onnx.ModelProto | None:
        """The graph ORT's CPU provider runs (ORT_ENABLE_EXTENDED: its fused kernels),
        without its weights (written to a data file that is not read back)."""
        free_dropped_graphs(model)
        with tempfile.TemporaryDirectory(prefix="mixprec-") as folder:
            path = os.path.join(folder, "optimized.onnx")
            so = ort.SessionOptions()
            so.intra_op_num_threads = thread_cap(0)
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            so.optimized_model_filepath = path
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", "optimized.data"
            )
            so.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
            )
            so.log_severity_level = ort_log_severity()
            try:
                source: str | bytes = (
                    skeleton_file(model, Path(folder))
                    if through_file(model, LoadHints())
                    else model.SerializeToString()
                )
                open_session(source, so, list(PROVIDERS["cpu"]))
            except Exception as e:
                raise OrtLoadError(f"onnxruntime cannot load the model: {ort_first_line(e)}") from e
            return onnx.load(path, load_external_data=False)

    def layer_profile(
        self, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], options: RuntimeOptions
    ) -> LayerProfile | None:
        if options.provider not in (None, "cpu") or model.ByteSize() > INLINE_LIMIT:
            return None  # a GPU provider's kernels, a large model's skeleton: not read here
        with tempfile.TemporaryDirectory(prefix="mixprec-profile-") as folder:
            hints = dataclasses.replace(TIMING_HINTS, profile_to=folder)
            session = None
            try:
                level, threads = options.optimization, options.threads
                session = make_session(
                    model.SerializeToString(), threads, optimization=level, hints=hints
                )
                for _ in range(_PROFILED_RUNS):
                    session.run(None, dict(feeds))
                events = json.loads(Path(session.end_profiling()).read_text())
                graph = onnx.load(os.path.join(folder, "optimized.onnx"), load_external_data=False)
            except Exception as e:  # a profile is a hint: without one, nothing is read from it
                logger.info("no per-kernel profile: %s", ort_first_line(e))
                return None
            finally:
                session = None  # closed before its folder goes
        times: dict[str, list[float]] = {}
        for event in events:
            name = str(event.get("name", ""))
            if event.get("cat") == "Node" and name.endswith("_kernel_time"):
                times.setdefault(name.removesuffix("_kernel_time"), []).append(event["dur"])
        seconds = {k: float(np.median(v)) * 1e-6 for k, v in times.items()}
        return LayerProfile(graph.graph, seconds)

    def session(
        self,
        model: ModelSource,
        options: RuntimeOptions,
        *,
        timing: bool = False,
        hints: LoadHints | None = None,
    ) -> OrtSession:
        hints = hints or LoadHints()
        if timing:  # timed beside others: threads spin within a run, not after it
            hints = dataclasses.replace(hints, stop_spinning=True)
        provider = options.provider or "cpu"
        missing = self.missing(options)
        if missing is not None:
            raise OrtLoadError(missing)
        level, threads = options.optimization, options.threads
        free_dropped_graphs(model)
        if isinstance(model, onnx.ModelProto):
            with session_for(model, threads, level, hints=hints, provider=provider) as session:
                return OrtSession(session, provider)
        source = bytes(model) if isinstance(model, bytes | bytearray) else os.fspath(model)
        session = make_session(source, threads, optimization=level, hints=hints, provider=provider)
        return OrtSession(session, provider)

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        return {
            "runtime": self.name,
            "label": self.label,
            "version": self.version(),
            "precision": "the model's own dtypes",
            "threads": thread_cap(options.threads),
            "cpu": cpu_features().describe(),
        } | ({"provider": options.provider} if options.provider not in (None, "cpu") else {})
