"""``mixprec optimize --device cuda|tensorrt``: the candidates on a GPU, and their build.

On the CPU (``device="cpu"``, the default) the candidates are
:data:`~mixprec.optimize.candidates.CANDIDATES`. On a GPU device they are the input, its
fp16 and its bf16 conversion (:func:`mixprec.convert`'s lists and rules, calibrated on
the samples that are not held out), each in ONNX Runtime on that device's provider
(onnxruntime-gpu's ``CUDAExecutionProvider`` or ``TensorrtExecutionProvider``):

* accuracy: every candidate, the input on the device included, is checked against the
  input in ONNX Runtime's CPU provider (the same FP32 reference as on the CPU: the
  device's own FP32, TF32 matmuls included, is a candidate, not the truth);
* speed: every candidate is timed beside the input on the device (``fp32-cuda``), the
  feeds bound once in the device's memory (:meth:`~mixprec.runtime.engine.Session.bind`),
  so that host-device copies are not timed. The choice's rules are the CPU's, with that
  baseline: a candidate wins when it is 3% faster than the input on the device.

The winner, the input included, is written with ``mixprec.runtime=ort`` and
``mixprec.runtime_hints={"provider": "cuda"}``: :func:`mixprec.validate` and
:func:`~mixprec.runtime.engines.run_model` run it on that provider.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import split_for_guard
from mixprec.core.config import ConvertConfig
from mixprec.core.errors import MixprecError
from mixprec.inputs.samples import feeds_for
from mixprec.io.models import load_input
from mixprec.optimize.candidates import BASELINE, CANDIDATES, Candidate, skip_reason
from mixprec.pipeline.convert import run_convert

__all__ = [
    "DEVICES",
    "LOW_BUILDS",
    "baseline_of",
    "check_device",
    "converted",
    "device_candidates",
]

#: ``device=`` values: the CPU (every runtime), or a GPU provider of ONNX Runtime.
DEVICES = ("cpu", "cuda", "tensorrt")
#: Candidate builds that convert the input to a float precision (:func:`converted`),
#: named as :func:`~mixprec.core.ops.parse_dtype` reads them.
LOW_BUILDS = ("fp16", "bf16")


def device_candidates(device: str) -> tuple[Candidate, ...]:
    """The built-in candidates on ``device``, the baseline (the input there) first.

    Example:
        >>> [c.name for c in device_candidates("cuda")]
        ['fp32-cuda', 'fp16-cuda', 'bf16-cuda']
    """
    if device not in DEVICES:
        raise MixprecError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if device == "cpu":
        return CANDIDATES
    where = f"ONNX Runtime's {device} provider"
    return (
        Candidate(f"fp32-{device}", "ort", None, "input", f"the input in {where}", device),
        Candidate(f"fp16-{device}", "ort", None, "fp16", f"mixprec.convert fp16, {where}", device),
        Candidate(f"bf16-{device}", "ort", None, "bf16", f"mixprec.convert bf16, {where}", device),
    )


def baseline_of(device: str) -> str:
    """The candidate every other one is timed beside on ``device``."""
    return BASELINE if device == "cpu" else device_candidates(device)[0].name


def check_device(device: str) -> None:
    """One error line when ``device`` is unknown, or its provider is not installed here
    (which package and provider it needs, and what this onnxruntime has)."""
    first = device_candidates(device)[0]
    why = None if device == "cpu" else skip_reason(first)
    if why is not None:
        raise MixprecError(f"device {device!r} cannot run here: {why}")


def converted(source: onnx.ModelProto, build: str, calibration: Any) -> onnx.ModelProto:
    """``source`` converted to the build's precision (:data:`LOW_BUILDS`) with
    :func:`mixprec.convert`'s default lists and rules, its ranges measured on the
    calibration samples that are not held out (those the guard's split calibrates on).

    Raises:
        MixprecError: the conversion cannot be made (the candidate failed).
    """
    model = ir.from_proto(source)
    split = split_for_guard(calibration, None, model)
    config = ConvertConfig.resolve(build)
    inputs = None if split.calibration is None else _Inputs(model, split.calibration)
    work, _kind = load_input(source)  # a private copy: the rewrite frees FP32 weights it read
    work, _report = run_convert(work, config, calibration_data=inputs)
    return ir.to_proto(work)


class _Inputs:
    """The model's inputs of each sample (labels dropped), read afresh at each pass."""

    def __init__(self, model: ir.Model, samples: Iterable[Mapping[str, Any]]) -> None:
        self.model = model
        self.samples = samples

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for sample in self.samples:
            yield feeds_for(self.model, sample)
