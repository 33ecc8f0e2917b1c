"""Speed-aware INT8 placement: time candidate placements against FP32 on this machine.

ONNX Runtime's integer kernels lose to its float ones on some shapes (small or depthwise
convolutions, tiny models where the Q/DQ overhead dominates), and which ones depends on
the CPU. So, like an autotuner, ``quantize(speed="auto")`` builds a few candidate
placements, times each against the FP32 model and keeps the fastest only when it is
clearly faster than FP32; otherwise the model stays float.

Timing on shared machines is noisy: sessions take turns within each round (in rotating
order), each round gives a ratio candidate / FP32 measured seconds apart, and the
decision uses the median of those paired ratios with a margin (:data:`MARGIN`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from mixprec.calibrate.measure import node_macs

__all__ = ["MARGIN", "candidate_placements", "choose_placement"]

#: A placement is kept only when its median paired ratio to FP32 is <= 1 - MARGIN and
#: three rounds in four found it faster than FP32 (its upper quartile is below 1).
MARGIN = 0.05
#: Each timed run repeats the model until it lasts this long (tiny models are all noise).
_RUN_SECONDS = 0.01
#: Timing stops after this many seconds once _MIN_ROUNDS are done.
_BUDGET_SECONDS = 1.0
_MIN_ROUNDS, _MAX_ROUNDS, _WARMUP = 15, 60, 2


def _depthwise(model: ir.Model) -> list[str]:
    names = []
    for node in model.graph:
        group = node.attributes.get("group")
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if node.op_type != "Conv" or group is None or group.as_int() <= 1 or weight is None:
            continue
        shape = weight.shape
        if shape is not None and len(shape) > 1 and shape[1] == 1:
            names.append(node.name or "")
    return names


def candidate_placements(
    model: ir.Model, user_excluded: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """Placements to time, as exclusion patterns on top of the user's, by label."""
    macs = node_macs(model)
    total = sum(macs.values()) or 1
    depthwise = _depthwise(model)
    small = [n for n, m in macs.items() if m and m < 0.01 * total]
    found = {"all": (), "no depthwise Conv": tuple(depthwise)}
    found["only Conv/MatMul/Gemm with >= 1% of the MACs"] = tuple(dict.fromkeys(depthwise + small))
    unique: dict[tuple[str, ...], str] = {}
    for label, names in found.items():
        unique.setdefault(names, label)
    return {
        label: tuple(user_excluded) + tuple(re.escape(n) for n in names)
        for names, label in unique.items()
    }


def _session(proto: onnx.ModelProto):  # -> ort.InferenceSession
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # Several sessions are alive at once: without the arena each frees its activations
    # after every run, so timing costs about one inference's memory, not one per session.
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def time_paired(
    sessions: Mapping[str, object], feeds: Mapping[str, np.ndarray]
) -> tuple[dict[str, float], dict[str, float], int, dict[str, float]]:
    """Median seconds per run, median paired ratio to ``"fp32"`` of each session and the
    upper quartile of those ratios.

    Returns ``(ms, ratio, rounds, upper)``.
    """
    runners = {label: s.run for label, s in sessions.items()}  # type: ignore[attr-defined]
    start = time.perf_counter()
    runners["fp32"](None, feeds)
    repeat = max(1, int(_RUN_SECONDS / max(time.perf_counter() - start, 1e-6)))
    labels = list(runners)
    times: dict[str, list[float]] = {label: [] for label in labels}
    began = time.perf_counter()
    rounds = 0
    while rounds < _MAX_ROUNDS + _WARMUP:
        order = labels[rounds % len(labels) :] + labels[: rounds % len(labels)]
        for label in order:
            start = time.perf_counter()
            for _ in range(repeat):
                runners[label](None, feeds)
            if rounds >= _WARMUP:
                times[label].append((time.perf_counter() - start) / repeat)
        rounds += 1
        done = rounds - _WARMUP
        if done >= _MIN_ROUNDS and time.perf_counter() - began >= _BUDGET_SECONDS:
            break
    base = np.asarray(times["fp32"])
    ms = {label: float(np.median(t)) * 1e3 for label, t in times.items()}
    ratio = {label: float(np.median(np.asarray(t) / base)) for label, t in times.items()}
    upper = {label: float(np.quantile(np.asarray(t) / base, 0.75)) for label, t in times.items()}
    return ms, ratio, rounds - _WARMUP, upper


def choose_placement(
    fp32: onnx.ModelProto,
    placements: Mapping[str, tuple[str, ...]],
    build: Callable[[tuple[str, ...]], onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
) -> tuple[tuple[str, ...], dict[str, object]]:
    """Times the ``fp32`` model and each placement built by ``build(exclusions)`` on
    ``feeds``.

    Returns the exclusions to use (``(".*",)``: none is clearly faster, stay float) and
    what was measured (``ms``, ``ratio``, ``rounds``, ``chosen``, ``summary``).
    """
    sessions = {"fp32": _session(fp32)}
    for label, excluded in placements.items():
        sessions[label] = _session(build(excluded))
    ms, ratio, rounds, upper = time_paired(sessions, feeds)
    best = min(placements, key=lambda label: ratio[label])
    clearly = ratio[best] <= 1.0 - MARGIN and upper[best] < 1.0
    chosen = best if clearly else "fp32"
    excluded = placements[best] if chosen != "fp32" else (".*",)
    summary = (
        f"INT8 placement timed on this CPU (ms, median of {rounds} interleaved rounds): "
        + ", ".join(f"{label} {value:.2f}" for label, value in ms.items())
        + f"; chose {chosen!r}"
        + (
            f" (no INT8 placement was at least {MARGIN:.0%} faster than FP32 in the median "
            "and faster in three rounds of four: the model stays float)"
            if chosen == "fp32"
            else f", {ratio[chosen]:.2f}x FP32 (median paired ratio)"
        )
    )
    return excluded, {
        "ms": ms,
        "ratio": ratio,
        "ratio_q75": upper,
        "rounds": rounds,
        "chosen": chosen,
        "summary": summary,
    }
