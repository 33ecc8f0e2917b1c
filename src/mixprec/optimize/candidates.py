"""The candidates ``mixprec optimize`` tries: a precision in a runtime, each a small entry.

A candidate names the engine it runs in, the engine's inference precision hint, and how
its model is built from the input: ``"input"`` (the input as it is: FP32, or the engine's
own lowering under a precision hint), ``"ort-fusions"`` (the input with ONNX Runtime's
transformer fusions: :mod:`mixprec.runtime.transformer_fusions`), ``"int8"``
(:func:`mixprec.quantize` with its default accuracy guard, timed and guarded in that
engine), ``"bf16-marks"`` (the FP32 model with the nodes mixprec's bf16 painting keeps
FP32 marked for OpenVINO: :mod:`mixprec.pipeline.marks`), or a function of the input model
(a caller's own candidate). :data:`CANDIDATES` lists the built-in ones in the order a tie
goes to: the simplest first, ``fp32-ort`` (the input in ONNX Runtime) before all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from mixprec.core.errors import MixprecError
from mixprec.runtime.engine import REGISTRY, RuntimeOptions
from mixprec.runtime.engines import engine_for

__all__ = [
    "BASELINE",
    "CANDIDATES",
    "RUNTIME_CHOICES",
    "Candidate",
    "select_candidates",
    "skip_reason",
]

#: ``runtime=`` values: every registered engine, or only one.
RUNTIME_CHOICES = ("auto", "ort", "openvino")
#: The input in ONNX Runtime: what every candidate is timed and checked against.
BASELINE = "fp32-ort"

Build = str | Callable[[onnx.ModelProto], onnx.ModelProto]


@dataclass(frozen=True)
class Candidate:
    """One way to run the model.

    Attributes:
        name: How the table and ``--candidates`` name it.
        runtime: The registered engine it runs in (``"ort"``, ``"openvino"``).
        precision: The engine's inference precision hint (None: the model's own dtypes).
        build: ``"input"``, ``"ort-fusions"``, ``"int8"``, ``"fp16"``/``"bf16"``
            (:func:`mixprec.convert`'s lists), ``"bf16-marks"`` (the FP32 model with
            OpenVINO precision marks), or a function from the input model to the
            candidate's model.
        about: One line for people.
        provider: Where the engine computes (:attr:`RuntimeOptions.provider`: ``"cuda"``,
            ``"tensorrt"``); None: its default (the CPU).

    Example:
        >>> Candidate("bf16-openvino", "openvino", "bf16", "input").options(4).precision
        'bf16'
    """

    name: str
    runtime: str
    precision: str | None
    build: Build
    about: str = ""
    provider: str | None = None

    @property
    def fits_nothing(self) -> bool:
        """Built without the data: the input, or its graph rewritten exactly."""
        return self.build in ("input", "ort-fusions")

    @property
    def fp32(self) -> bool:
        """FP32 that only rounds differently from the input (no precision hint)."""
        return self.fits_nothing and self.precision in (None, "f32")

    def options(self, threads: int) -> RuntimeOptions:
        """The runtime options it runs (and is timed) with."""
        return RuntimeOptions(
            name=self.runtime, threads=threads, precision=self.precision, provider=self.provider
        )


CANDIDATES: tuple[Candidate, ...] = (
    Candidate(BASELINE, "ort", None, "input", "the input in ONNX Runtime"),
    Candidate("fp32-openvino", "openvino", "f32", "input", "the input in OpenVINO"),
    Candidate(
        "fused-ort",
        "ort",
        None,
        "ort-fusions",
        "the input with ONNX Runtime's transformer fusions (Attention, SkipLayerNormalization)",
    ),
    Candidate("bf16-openvino", "openvino", "bf16", "input", "the input, OpenVINO's bf16 hint"),
    Candidate(
        "bf16-lists-openvino",
        "openvino",
        "bf16",
        "bf16-marks",
        "OpenVINO's bf16 hint, mixprec's FP32 nodes marked to keep their precision",
    ),
    Candidate("int8-ort", "ort", None, "int8", "mixprec.quantize, guarded, in ONNX Runtime"),
    Candidate("int8-openvino", "openvino", "f32", "int8", "mixprec.quantize, in OpenVINO"),
    # INT8 where its placement pays, bf16 for the layers left float: the speed plan times
    # placements against OpenVINO's bf16, and the guard checks the mix (MTCNN R-Net: 0.52x
    # ORT FP32 against the bf16 hint's 0.59x and int8-openvino's 0.56x, 2026-12-03)
    Candidate(
        "int8-bf16-openvino",
        "openvino",
        "bf16",
        "int8",
        "mixprec.quantize in OpenVINO, its float layers under the bf16 hint",
    ),
)


def select_candidates(
    names: Sequence[str | Candidate] | None,
    runtime: str = "auto",
    pool: Sequence[Candidate] = CANDIDATES,
) -> tuple[Candidate, ...]:
    """The candidates to try: ``names`` (names in ``pool``, the built-in ones by default,
    or :class:`Candidate` entries of the caller's), else every one of ``pool``; with
    ``runtime`` other than ``"auto"``, only those that run in it.

    Raises:
        MixprecError: one line, for an unknown name or runtime, a candidate named twice,
            or a named candidate outside ``runtime``.
    """
    if runtime not in RUNTIME_CHOICES:
        raise MixprecError(f"unknown runtime {runtime!r}: use one of {', '.join(RUNTIME_CHOICES)}")
    known = {c.name: c for c in pool}
    if names is None:
        return tuple(c for c in pool if runtime in ("auto", c.runtime))
    if isinstance(names, str):
        raise MixprecError("candidates must be a list of names, not a string")
    chosen: list[Candidate] = []
    for item in names:
        if isinstance(item, Candidate):
            found = item
        elif isinstance(item, str) and item in known:
            found = known[item]
        else:
            raise MixprecError(
                f"unknown candidate {item!r}: use {', '.join(known)} (comma-separated)"
            )
        if found.name in {c.name for c in chosen}:
            raise MixprecError(f"candidate {found.name!r} is named twice")
        if runtime != "auto" and found.runtime != runtime:
            raise MixprecError(
                f"candidate {found.name!r} runs in {found.runtime}, not in the runtime asked "
                f"for ({runtime})"
            )
        chosen.append(found)
    if not chosen:
        raise MixprecError("no candidate given: name at least one")
    order = [c.name for c in pool]  # the built-in order (ties go to the earlier)
    return tuple(sorted(chosen, key=lambda c: order.index(c.name) if c.name in order else 99))


def skip_reason(candidate: Candidate) -> str | None:
    """Why ``candidate`` cannot run here (its engine is missing, or it asks for bf16
    where this CPU does not compute it), else None."""
    engine = REGISTRY.get(candidate.runtime)
    if engine is None:
        return f"no runtime named {candidate.runtime!r} is registered"
    missing = engine.missing(RuntimeOptions(name=candidate.runtime, provider=candidate.provider))
    if missing is not None:
        return missing
    if candidate.precision == "bf16" and not engine_for(candidate.runtime).computes_bf16():
        return "this CPU does not compute bf16"
    return None
