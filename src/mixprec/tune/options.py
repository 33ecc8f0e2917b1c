"""The tuner's hand-over from another face: ``convert(max_error=)`` and the accuracy
guard's repair give the target's options as a dict, never the tuner's own."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.io.models import ModelLike, input_kind, load_input
from mixprec.runtime.engine import RuntimeOptions
from mixprec.runtime.engines import runtime_options
from mixprec.tune.result import TuneResult
from mixprec.tune.run import TuneRequest, tune_model
from mixprec.tune.targets import make_target

__all__ = ["tune_from_options"]


def tune_from_options(
    model: ModelLike,
    target: str | None,
    data: Any,
    *,
    options: dict[str, Any],
    metric: str | Callable[..., float] = "rel-l2",
    budget: float | str | None = None,
    calibration_data: Mapping[str, Any] | Iterable[Mapping[str, Any]] | None = None,
    max_evaluations: int | None = None,
    progress: Callable[[str], None] | None = None,
    threads: int = 2,
    mode: str = "emulated",
    metric_budget: float | None = None,
    calibrated: tuple[ir.Model, float] | None = None,
    runtime: RuntimeOptions | str | None = None,
) -> TuneResult:
    """One tuning run with the target's options as a dict (``convert``'s or
    ``quantize``'s: a ``mode`` there is quantize's INT8 mode, apart from the tuner's own
    ``mode``); a ``log_dir`` among them is left to the caller. ``calibrated``: ``model``
    already prepared and calibrated with these options on ``calibration_data`` (a private
    copy the tuner may change), and the seconds that took; the tuner then searches from
    it instead of calibrating again. ``runtime``: where the search runs (candidates,
    sensitivity, the FP32 reference); for int8 also the quantizer's unless ``options``
    name one."""
    if max_evaluations is not None and (
        isinstance(max_evaluations, bool)
        or not isinstance(max_evaluations, int)
        or max_evaluations < 1
    ):
        raise MixprecError(f"max_evaluations must be an int >= 1, got {max_evaluations!r}")
    t0 = time.perf_counter()
    options = {k: v for k, v in options.items() if k != "log_dir"}
    chosen = runtime_options(runtime, threads) if runtime is not None else None
    tuned = make_target(target, options, mode)
    if chosen is not None and tuned.int8 and "runtime" not in options:
        tuned = make_target(target, {**options, "runtime": chosen}, mode)
    request = TuneRequest(
        target=tuned,
        data=data,
        metric=metric,
        budget=budget,
        calibration_data=calibration_data,
        max_evaluations=max_evaluations,
        threads=threads,
        shapes=options.get("shapes"),
        metric_budget=metric_budget,
        runtime=chosen,
    )
    if calibrated is None:
        work, kind = load_input(model)
        return tune_model(work, kind, request, progress, started=t0)
    work, seconds = calibrated
    return tune_model(
        work, input_kind(model), request, progress, started=t0, calibrated_seconds=seconds
    )
