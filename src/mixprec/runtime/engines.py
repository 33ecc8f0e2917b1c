"""The one registry of inference engines (``--runtime NAME``), and which engine checks a
low-precision model's accuracy for real.

A bf16 model can only be checked for real where an engine computes bf16: ONNX Runtime's
CPU provider never does, OpenVINO does on CPUs with AVX-512 BF16 or AMX. Elsewhere the
model is emulated in FP32 (:mod:`mixprec.runtime.emulate`), and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixprec.core.errors import MixprecError
from mixprec.runtime.cpu import cpu_features
from mixprec.runtime.engine import RUNTIME_NAMES, Engine, RuntimeOptions
from mixprec.runtime.openvino import OpenVinoEngine
from mixprec.runtime.ort import OrtEngine

__all__ = ["ENGINES", "CheckPlan", "check_plan", "engine_for", "runtime_options"]

ENGINES: dict[str, Engine] = {"ort": OrtEngine(), "openvino": OpenVinoEngine()}
assert tuple(ENGINES) == RUNTIME_NAMES


def engine_for(options: RuntimeOptions | str) -> Engine:
    """The engine ``options`` names; one error line when its extra is not installed."""
    name = options if isinstance(options, str) else options.name
    engine = ENGINES.get(name)
    if engine is None:
        raise MixprecError(f"unknown runtime {name!r}: use one of {', '.join(ENGINES)}")
    missing = engine.missing()
    if missing is not None:
        raise MixprecError(missing)
    return engine


def runtime_options(runtime: RuntimeOptions | str | None, threads: int = 2) -> RuntimeOptions:
    """``runtime=`` as the API takes it (a name, options or None) as options."""
    if runtime is None:
        return RuntimeOptions(threads=threads)
    if isinstance(runtime, RuntimeOptions):
        return runtime
    if isinstance(runtime, str):
        return RuntimeOptions(name=runtime, threads=threads)
    raise MixprecError(
        f"runtime must be a name ({', '.join(ENGINES)}) or RuntimeOptions, "
        f"not {type(runtime).__name__}"
    )


@dataclass(frozen=True)
class CheckPlan:
    """How a converted model is checked: in ``engine`` as is, or ``emulated`` in FP32
    (then ``why`` says why no engine could run it for real)."""

    options: RuntimeOptions
    emulated: bool
    why: str = ""


def check_plan(low_dtype: str, runtime: RuntimeOptions | None, mode: str) -> CheckPlan:
    """Where to check a model whose low dtype is ``low_dtype``.

    ``runtime`` None is the default choice: ONNX Runtime, except for a bf16 model on a
    CPU that computes bf16 with OpenVINO installed, which OpenVINO runs for real. In mode
    ``auto`` a bf16 model is emulated when the engine would silently compute its bf16
    layers in f32 (OpenVINO on a CPU without bf16); ONNX Runtime is tried as is, and the
    caller emulates when it refuses the model (its CPU provider has no bf16 kernels for
    most ops). Mode ``emulated`` always emulates.
    """
    chosen = runtime or RuntimeOptions()
    if runtime is None and low_dtype == "bfloat16" and mode == "auto":
        openvino = ENGINES["openvino"]
        if openvino.missing() is None and openvino.computes_bf16():
            chosen = RuntimeOptions(name="openvino", threads=chosen.threads)
    if mode == "emulated":
        return CheckPlan(chosen, True)
    engine = engine_for(chosen)
    silent_f32 = engine.name != "ort" and not engine.computes_bf16()
    if low_dtype == "bfloat16" and mode == "auto" and silent_f32:
        return CheckPlan(chosen, True, _no_bf16_reason(engine))
    return CheckPlan(chosen, False)


def _no_bf16_reason(engine: Engine) -> str:
    if not cpu_features().bf16:
        return f"{engine.label} computes bf16 layers in f32 on this CPU (no avx512_bf16/AMX)"
    return f"{engine.label} does not report bf16 support on this CPU"
