"""The one registry of inference engines (``--runtime NAME``), the door every model run
goes through, and which engine checks a low-precision model's accuracy for real.

ONNX Runtime and OpenVINO are registered here; :func:`register_engine` adds another (an
engine of a package of its own, or a test's) without touching any caller: callers reach
engines through :func:`engine_for` and ask them what they can do.

A bf16 model can only be checked for real where an engine computes bf16: ONNX Runtime's
CPU provider never does, OpenVINO does on CPUs with AVX-512 BF16 or AMX. Elsewhere the
model is emulated in FP32 (:mod:`mixprec.passes.emulate`), and the report says so.

OpenVINO's precision marks (:mod:`mixprec.runtime.ov_marks`: bf16 by its hint, the nodes
mixprec keeps FP32 marked) are written through here too (:func:`write_marked_ir`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from mixprec.core.errors import MixprecError
from mixprec.io.runtime_fields import HINTS_KEY, RUNTIME_KEY, json_field, props_of
from mixprec.runtime.cpu import cpu_features
from mixprec.runtime.engine import (
    REGISTRY,
    Engine,
    LoadHints,
    ModelSource,
    RuntimeOptions,
    runtime_names,
)
from mixprec.runtime.openvino import OpenVinoEngine, write_marked_ir
from mixprec.runtime.ort import OrtEngine

__all__ = [
    "ENGINES",
    "PRECISION_HINT",
    "PROVIDER_HINT",
    "CheckPlan",
    "check_plan",
    "engine_for",
    "options_from_metadata",
    "options_of_model",
    "register_engine",
    "run_model",
    "runtime_hints",
    "runtime_options",
    "runtime_taking",
    "unregister_engine",
    "write_marked_ir",
]

#: The registered engines by name (the same table :class:`RuntimeOptions` validates with).
ENGINES: Mapping[str, Engine] = REGISTRY


def register_engine(engine: Engine) -> None:
    """Adds ``engine`` under ``engine.name``: ``RuntimeOptions(name=...)`` and
    ``--runtime`` then take it, and every caller runs through it when asked to.

    Example:
        >>> register_engine(MyEngine())  # doctest: +SKIP
        >>> mixprec.validate(original, converted, runtime=RuntimeOptions("mine"))  # doctest: +SKIP

    Raises:
        MixprecError: an engine of that name is registered already.
    """
    if engine.name in REGISTRY:
        raise MixprecError(f"a runtime named {engine.name!r} is registered already")
    REGISTRY[engine.name] = engine


def unregister_engine(name: str) -> None:
    """Removes the engine registered as ``name`` (nothing when there is none)."""
    REGISTRY.pop(name, None)


register_engine(OrtEngine())
register_engine(OpenVinoEngine())


def engine_for(options: RuntimeOptions | str) -> Engine:
    """The engine ``options`` names; one error line when it (or the provider ``options``
    asks for) is not installed here."""
    name = options if isinstance(options, str) else options.name
    engine = REGISTRY.get(name)
    if engine is None:
        raise MixprecError(f"unknown runtime {name!r}: use one of {', '.join(runtime_names())}")
    missing = engine.missing(None if isinstance(options, str) else options)
    if missing is not None:
        raise MixprecError(missing)
    return engine


def run_model(
    model: ModelSource,
    feeds: Mapping[str, np.ndarray],
    options: RuntimeOptions | None = None,
    *,
    output_names: Sequence[str] | None = None,
    hints: LoadHints | None = None,
) -> dict[str, np.ndarray]:
    """Runs ``model`` once in the engine ``options`` names; the outputs by name.

    Without ``options``, the model runs where its ``metadata_props`` say
    (:func:`options_from_metadata`: ``mixprec optimize`` writes them), else in ONNX
    Runtime's CPU provider with all graph optimizations.

    Example:
        >>> run_model("model_fast.onnx", {"x": x})  # doctest: +SKIP
        {'probs': array(...)}

    Raises:
        RuntimeLoadError: the engine cannot load the model.
        RuntimeRunError: it cannot run it on ``feeds``.
        MixprecError: the metadata names a runtime that is not installed here.
    """
    options = options or options_of_model(model) or RuntimeOptions()
    session = engine_for(options).session(model, options, hints=hints)
    return session.run(feeds, output_names)


def runtime_taking(precision: str | None) -> str:
    """The first registered engine (the default first) that takes the inference
    precision hint ``precision``: ONNX Runtime for None/f32, OpenVINO for bf16/f16."""
    for name in runtime_names():
        try:
            RuntimeOptions(name, precision=precision)
        except MixprecError:
            continue
        return name
    raise MixprecError(f"no runtime takes the inference precision {precision!r}")


def runtime_options(runtime: RuntimeOptions | str | None, threads: int = 2) -> RuntimeOptions:
    """``runtime=`` as the API takes it (a name, options or None) as options."""
    if runtime is None:
        return RuntimeOptions(threads=threads)
    if isinstance(runtime, RuntimeOptions):
        return runtime
    if isinstance(runtime, str):
        return RuntimeOptions(name=runtime, threads=threads)
    raise MixprecError(
        f"runtime must be a name ({', '.join(runtime_names())}) or RuntimeOptions, "
        f"not {type(runtime).__name__}"
    )


#: The property that carries :attr:`RuntimeOptions.precision` (OpenVINO's name for it).
PRECISION_HINT = "INFERENCE_PRECISION_HINT"
#: The property that carries :attr:`RuntimeOptions.provider` (where the engine computes:
#: ONNX Runtime's ``"cuda"``/``"tensorrt"`` provider, OpenVINO's device).
PROVIDER_HINT = "provider"
#: The properties :data:`HINTS_KEY` may set, each a string.
_HINTS = (PRECISION_HINT, PROVIDER_HINT)


def runtime_hints(options: RuntimeOptions) -> dict[str, str]:
    """The engine properties ``options`` set beyond the engine's defaults, as
    :data:`HINTS_KEY` stores them: ``{"INFERENCE_PRECISION_HINT": "bf16"}``,
    ``{"provider": "cuda"}``, ``{}`` for none (threads are the deployment's own choice and
    are not stored)."""
    hints = {} if options.precision is None else {PRECISION_HINT: options.precision}
    if options.provider is not None:
        hints[PROVIDER_HINT] = options.provider
    return hints


def options_from_metadata(model: onnx.ModelProto, threads: int = 2) -> RuntimeOptions | None:
    """The runtime a model's ``metadata_props`` say it runs in (:data:`RUNTIME_KEY`,
    :data:`HINTS_KEY`, as ``mixprec optimize`` writes them), with ``threads``; None when
    the model names none (then it runs in ONNX Runtime, the default).

    Example:
        >>> options_from_metadata(model)  # doctest: +SKIP
        RuntimeOptions(name='openvino', threads=2, precision='bf16', ...)
        >>> options_from_metadata(model_for_cuda).provider  # doctest: +SKIP
        'cuda'

    Raises:
        MixprecError: one line, when the fields name an unknown runtime or one not
            installed here, are not a JSON object, or carry a property mixprec cannot set.
    """
    props = props_of(model)
    name = props.get(RUNTIME_KEY)
    if name is None:
        return None
    hints = json_field(model, HINTS_KEY, dict, "a JSON object") if props.get(HINTS_KEY) else {}
    unknown = sorted(set(hints) - set(_HINTS))
    if unknown:
        raise MixprecError(
            f"metadata {HINTS_KEY} sets {', '.join(map(repr, unknown))}: mixprec reads only "
            f"{' and '.join(_HINTS)}"
        )
    for key in _HINTS:
        if hints.get(key) is not None and not isinstance(hints[key], str):
            raise MixprecError(f"metadata {HINTS_KEY}: {key} must be a string")
    precision, provider = hints.get(PRECISION_HINT), hints.get(PROVIDER_HINT)
    try:
        options = RuntimeOptions(name=name, threads=threads, precision=precision, provider=provider)
    except MixprecError as e:
        raise MixprecError(f"metadata {RUNTIME_KEY}={name!r}: {e}") from None
    missing = REGISTRY[name].missing(options)
    if missing is not None:  # the runtime it was chosen for is not here: say so, and how
        raise MixprecError(
            f"the model's metadata {RUNTIME_KEY}={name!r} names a runtime that cannot run "
            f"here ({missing}); name another runtime to run it anyway (--runtime ort)"
        )
    return options


def options_of_model(model: ModelSource, threads: int = 2) -> RuntimeOptions | None:
    """:func:`options_from_metadata` of a model given as a proto, its bytes or its path
    (read without its external data: only the fields are wanted)."""
    try:
        if isinstance(model, onnx.ModelProto):
            proto = model
        elif isinstance(model, bytes | bytearray):
            proto = onnx.load_model_from_string(bytes(model))
        else:
            proto = onnx.load(os.fspath(model), load_external_data=False)
    except Exception:  # not an ONNX model: the engine says so when it loads it
        return None
    return options_from_metadata(proto, threads)


@dataclass(frozen=True)
class CheckPlan:
    """How a converted model is checked: in ``engine`` as is, or ``emulated`` in FP32
    (then ``why`` says why no engine could run it for real)."""

    options: RuntimeOptions
    emulated: bool
    why: str = ""


def _bf16_engine(threads: int) -> RuntimeOptions | None:
    """Options for the first registered engine that computes bf16 here, if any."""
    for engine in REGISTRY.values():
        if engine.missing() is None and engine.computes_bf16():
            return RuntimeOptions(name=engine.name, threads=threads)
    return None


def check_plan(low_dtype: str, runtime: RuntimeOptions | None, mode: str) -> CheckPlan:
    """Where to check a model whose low dtype is ``low_dtype``.

    ``runtime`` None is the default choice: ONNX Runtime, except for a bf16 model on a
    CPU where an installed engine computes bf16 (OpenVINO), which runs it for real. In
    mode ``auto`` a bf16 model is emulated when the engine would silently compute its bf16
    layers in f32 (OpenVINO on a CPU without bf16); an engine that refuses bf16 (ONNX
    Runtime) is tried as is, and the caller emulates when it refuses the model (its CPU
    provider has no bf16 kernels for most ops). Mode ``emulated`` always emulates.
    """
    chosen = runtime or RuntimeOptions()
    if runtime is None and low_dtype == "bfloat16" and mode == "auto":
        chosen = _bf16_engine(chosen.threads) or chosen
    if mode == "emulated":
        return CheckPlan(chosen, True)
    engine = engine_for(chosen)
    silent_f32 = not engine.refuses_bf16() and not engine.computes_bf16()
    if low_dtype == "bfloat16" and mode == "auto" and silent_f32:
        return CheckPlan(chosen, True, _no_bf16_reason(engine))
    return CheckPlan(chosen, False)


def _no_bf16_reason(engine: Engine) -> str:
    if not cpu_features().bf16:
        return f"{engine.label} computes bf16 layers in f32 on this CPU (no avx512_bf16/AMX)"
    return f"{engine.label} does not report bf16 support on this CPU"
