"""The INT8 guard's runs: one quantization of the input (:func:`quantize_once`), a
model's outputs in the deployment's engine (a bf16 fallback emulated where that engine
cannot compute bf16), the held-out samples' FP32 reference and its drift from ONNX
Runtime's CPU provider, and a candidate checked against it (:func:`checked`). The guard
(:mod:`.int8_guard`) and its repair (:mod:`.int8_repair`) both run through these."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import onnx
import onnx_ir as ir

from mixprec.checks.guard_samples import Samples
from mixprec.checks.outputs import (
    GuardBudget,
    OutputCheck,
    UserMetric,
    check_outputs,
    missed,
)
from mixprec.checks.user_metric import Labels
from mixprec.checks.validate import detect_low_dtype
from mixprec.core.errors import MixprecError
from mixprec.core.output_kinds import OutputKind
from mixprec.inputs.feeds import feeds_for
from mixprec.int8.config import QuantizeConfig
from mixprec.io.models import load_input
from mixprec.passes.emulate import emulate_low_precision
from mixprec.pipeline.quantize import Reuse, run_quantize
from mixprec.pipeline.report import Report
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import check_plan, engine_for

__all__ = [
    "Held",
    "Say",
    "checked",
    "copy_input",
    "fp32_drift",
    "fp32_reference",
    "input_unchanged",
    "outputs_in",
    "part",
    "quantize_once",
    "user_metric",
]

Say = Callable[[str], None]


def quantize_once(
    source: onnx.ModelProto,
    config: QuantizeConfig,
    data: Any,
    progress: Say | None,
    reuse: Reuse | None = None,
) -> tuple[ir.Model, Report]:
    """One quantization of ``source`` (the input as loaded, weights inline); a result
    with no INT8 node is the input unchanged. ``reuse``: see :class:`Reuse`."""
    work, report = run_quantize(
        copy_input(source), config, calibration_data=data, progress=progress, reuse=reuse
    )
    if config.fallback == "fp32" and not any(n.precision == "int8" for n in report.nodes):
        # Nothing runs in INT8: the input as given, never the prepared copy (prepare's
        # rewrites may move ORT off a faster path, e.g. Casts before a Pad).
        work = copy_input(source)
        report.unchanged = True
        report.notes.append("no node runs in INT8: the input model is written unchanged")
    return work, report


def copy_input(source: onnx.ModelProto) -> ir.Model:
    """A private copy of the loaded input (no external data left to read)."""
    return load_input(source)[0]


def outputs_in(
    model: ir.Model, samples: Iterable[dict[str, Any]], runtime: RuntimeOptions | None = None
) -> list[dict[str, Any]]:
    """The model's outputs in the deployment's engine (``runtime``; None: ONNX Runtime's
    CPU provider). A bf16 fallback runs as its FP32 emulation (every bf16
    tensor rounded) where that engine cannot compute bf16: ONNX Runtime's CPU provider
    cannot load it, and OpenVINO computes it in f32 on a CPU without bf16."""
    proto = ir.to_proto(model)
    options = runtime or RuntimeOptions()
    plan = check_plan(detect_low_dtype(proto), options, "auto")
    if not plan.emulated:
        try:
            session = engine_for(options).session(proto, options)
            return [session.run(feeds_for(model, s)) for s in samples]
        except RuntimeLoadError:
            if not engine_for(options).refuses_bf16():
                raise
            # ORT refuses the bf16 islands of --fallback bf16 (no bf16 kernels): emulate
    ort = RuntimeOptions(threads=options.threads)
    session = engine_for(ort).session(emulate_low_precision(proto), ort)
    return [session.run(feeds_for(model, s)) for s in samples]


#: What the guard holds of the held-out samples: the samples (streamed), their FP32
#: outputs and their labels.
Held = tuple[Samples, list[dict[str, Any]], Labels | None]


def checked(
    work: ir.Model,
    held: Held,
    config: QuantizeConfig,
    how: tuple[dict[str, OutputKind], GuardBudget],
) -> list[OutputCheck]:
    """The guard's checks of ``work`` on the samples of ``held``; a model the runtime
    refuses to run (a placement that changed a value-dependent length inside the graph)
    misses every check with the runtime's reason, and the repair goes on as for any
    miss."""
    kinds, budget = how
    samples, reference, labels = held
    user = user_metric(config)
    try:
        got = outputs_in(work, samples, config.runtime)
        return check_outputs(reference, got, kinds, budget, user, labels)
    except RuntimeRunError as e:
        if user is not None:
            return [OutputCheck(user.name, "metric", math.nan, user.budget, False, str(e))]
        return missed(reference, kinds, budget, str(e))


def fp32_reference(model: ir.Model, samples: Samples, runtime: RuntimeOptions) -> Held:
    """The held-out samples' FP32 outputs in the deployment's engine (``runtime``: the
    INT8 model is checked there, so the FP32 model is too) and their labels (their arrays
    that are not model inputs; None when none has any), in one pass over them. The FP32
    model failing there is one error line: no INT8 model could be judged against it."""
    inputs = {v.name for v in model.graph.inputs}
    found: list[dict[str, Any]] = []

    def tee(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for sample in items:
            found.append({k: v for k, v in sample.items() if k not in inputs})
            yield sample

    try:
        outputs = outputs_in(model, tee(samples), runtime)
    except (RuntimeLoadError, RuntimeRunError) as e:
        raise MixprecError(
            f"the accuracy guard cannot run the FP32 model in {runtime.name} on the held-out "
            f"samples, so nothing can be checked against it: {e}"
        ) from None
    return samples, outputs, found if any(found) else None


def fp32_drift(
    model: ir.Model,
    held: Held,
    runtime: RuntimeOptions,
    how: tuple[dict[str, OutputKind], GuardBudget],
) -> list[OutputCheck] | None:
    """How far the FP32 model's own outputs in the deployment's engine are from ONNX
    Runtime's CPU provider's on the held-out samples, by the guard's checks (None when
    the deployment is that provider): the reference the INT8 model is held to moved by
    this much before any quantization."""
    if runtime == RuntimeOptions(threads=runtime.threads):
        return None
    samples, reference, _ = held
    kinds, budget = how
    cpu = outputs_in(model, samples, RuntimeOptions(threads=runtime.threads))
    return check_outputs(cpu, reference, kinds, budget)


def part(held: Held, positions: list[int]) -> Held:
    """The held-out samples at ``positions``, with their FP32 outputs and labels."""
    samples, reference, labels = held
    picked = [labels[k] for k in positions] if labels is not None else None
    return samples.only(positions), _pick(reference, positions), picked


def input_unchanged(config: QuantizeConfig) -> QuantizeConfig:
    """``config`` keeping every node float with an FP32 fallback, untimed: a quantization
    with it writes the input unchanged (:func:`quantize_once`)."""
    return dataclasses.replace(config, exclude_nodes=(".*",), speed="off", fallback="fp32")


def user_metric(config: QuantizeConfig) -> UserMetric | None:
    """The user's own metric (``--metric``), if any, named after its function."""
    if config.metric is None or config.metric_budget is None:
        return None
    name = getattr(config.metric, "__name__", "metric")
    return UserMetric(config.metric, float(config.metric_budget), name)


def _pick(items: list[Any], indices: list[int]) -> list[Any]:
    return [items[k] for k in indices]
