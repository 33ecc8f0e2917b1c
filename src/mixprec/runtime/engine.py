"""The runtime seam: what mixprec needs of an inference engine, and the options a user sets.

An engine loads a model into a :class:`Session` (run feeds by input name, get outputs by
name), tells its version, and says whether it computes bfloat16 in hardware on this CPU.
ONNX Runtime (:mod:`mixprec.runtime.ort`) and OpenVINO (:mod:`mixprec.runtime.openvino`)
implement it; :mod:`mixprec.runtime.engines` holds the one registry ``--runtime NAME``
reads. Every place that runs or times a model (validate, the INT8 guard and speed plan,
tune, batch) takes a :class:`RuntimeOptions`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import onnx

from mixprec.core.errors import MixprecError

__all__ = [
    "PERFORMANCE_HINTS",
    "PRECISIONS",
    "RUNTIME_NAMES",
    "Engine",
    "RuntimeLoadError",
    "RuntimeOptions",
    "RuntimeRunError",
    "Session",
]

#: The engines ``--runtime`` accepts, the default first.
RUNTIME_NAMES = ("ort", "openvino")
#: Inference precisions a user may ask an engine for. ``None`` (the default) runs every
#: tensor in the dtype the model gives it, which is what a mixed-precision model needs;
#: "bf16"/"f16" let an engine lower FP32 layers by its own rules (OpenVINO's hint).
PRECISIONS = ("f32", "bf16", "f16")
#: Performance hints: one request at a time (``latency``) or many (``throughput``).
PERFORMANCE_HINTS = ("latency", "throughput")


class RuntimeLoadError(MixprecError):
    """An engine could not load (read or compile) a model."""


class RuntimeRunError(MixprecError):
    """An engine loaded a model but could not run it."""


@dataclass(frozen=True)
class RuntimeOptions:
    """Which engine runs a model, and how (frozen; validated on creation).

    Attributes:
        name: ``"ort"`` (ONNX Runtime's CPU provider) or ``"openvino"`` (its CPU plugin).
        threads: Intra-op threads (0: the engine's choice; ``MIXPREC_THREADS`` caps it).
        precision: ``None`` runs the model's own dtypes; ``"f32"``, ``"bf16"`` or ``"f16"``
            is OpenVINO's inference precision hint (ONNX Runtime takes only ``None``/f32).
        performance: ``"latency"`` or ``"throughput"`` (OpenVINO's performance hint).
    """

    name: str = "ort"
    threads: int = 2
    precision: str | None = None
    performance: str = "latency"

    def __post_init__(self) -> None:
        if self.name not in RUNTIME_NAMES:
            raise MixprecError(
                f"unknown runtime {self.name!r}: use one of {', '.join(RUNTIME_NAMES)}"
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
        if self.name == "ort" and self.precision not in (None, "f32"):
            raise MixprecError(
                f"onnxruntime has no inference precision hint ({self.precision!r}): it runs "
                "the model's own dtypes; use --runtime openvino for that"
            )
        if self.performance not in PERFORMANCE_HINTS:
            raise MixprecError(
                f"unknown performance hint {self.performance!r}: use {', '.join(PERFORMANCE_HINTS)}"
            )


class Session(Protocol):
    """A model loaded by an engine."""

    @property
    def output_names(self) -> tuple[str, ...]: ...

    @property
    def notes(self) -> list[str]:
        """What the engine ran otherwise than asked (OpenVINO keeping dynamic shapes),
        one line each, for reports."""
        ...

    def run(
        self, feeds: Mapping[str, np.ndarray], output_names: Sequence[str] | None = None
    ) -> dict[str, np.ndarray]:
        """Runs the model once; the outputs by name (all when ``output_names`` is None).

        Raises:
            RuntimeRunError: the engine failed to run the model.
        """
        ...


class Engine(Protocol):
    """An inference engine mixprec can validate and time models in."""

    #: The ``--runtime`` name.
    name: str
    #: The engine's name for people ("ONNX Runtime", "OpenVINO").
    label: str

    def missing(self) -> str | None:
        """``None`` when the engine can be used here, else one line saying what to install."""
        ...

    def version(self) -> str: ...

    def computes_bf16(self) -> bool:
        """Whether this engine runs a model's bfloat16 layers in bfloat16 on this CPU."""
        ...

    def session(
        self,
        model: onnx.ModelProto | str | os.PathLike[str],
        options: RuntimeOptions,
        *,
        timing: bool = False,
    ) -> Session:
        """Loads ``model`` (a proto, or a path whose external data sits beside it).

        ``timing`` sets the session up for being timed beside others (no thread
        spinning, no arena holding activations between runs).

        Raises:
            RuntimeLoadError: the engine cannot read or compile the model.
        """
        ...

    def describe(self, options: RuntimeOptions) -> dict[str, object]:
        """What ran, for reports and ``--json``: runtime, version, precision, threads."""
        ...
