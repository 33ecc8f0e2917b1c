"""Speed-aware INT8 placement: time candidate placements against FP32 on this machine.

ONNX Runtime's integer kernels lose to its float ones on some shapes (small or depthwise
convolutions, tiny models where the Q/DQ overhead dominates), and which ones depends on
the CPU. So, like an autotuner, ``quantize(speed="auto")`` builds a few candidate
placements, times each against the user's FP32 model and keeps the fastest only when it
is clearly faster; otherwise the model stays float.

Timing on shared machines is noisy: each placement is timed beside FP32 in its own rounds
(two sessions alive at a time, so memory does not grow with the number of placements),
the two taking turns within each round, and each round gives a ratio candidate / FP32
measured milliseconds apart.
:func:`decide` reads only those paired ratios (a pure function, tested on recorded
timings): a placement is faster when its median ratio is at most ``1 - MARGIN`` and,
unless it is :data:`SURE` faster in the median, when at least :data:`MAJORITY` of the
rounds found it faster. Among the faster placements, the one listed first (the most
INT8 work: :func:`candidate_placements`) wins unless another is :data:`BAND` faster in the
median, so that two runs on one machine make the same choice when two placements time
alike.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import node_macs
from mixprec.runtime import clock
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions, RuntimeRunError, Session
from mixprec.runtime.engines import engine_for

__all__ = [
    "BAND",
    "MAJORITY",
    "MARGIN",
    "PRUNE_AFTER",
    "RUN_SECONDS",
    "STAY_FLOAT",
    "SURE",
    "WARMUP_ROUNDS",
    "Z_95",
    "Z_COMPARE",
    "Placement",
    "SpeedDecision",
    "candidate_placements",
    "choose_placement",
    "decide",
    "median_interval",
    "session",
    "time_paired",
]

#: A placement must be at least this much faster than FP32 in the median paired ratio.
MARGIN = 0.05
#: ... and faster than FP32 in at least this share of the rounds,
MAJORITY = 0.6
#: ... unless its median ratio is at most this (then no noise explains it: a placement
#: twice as fast in the median is never rejected).
SURE = 0.8
#: A placement with less INT8 work must beat the fuller one by this much in the median.
BAND = 0.05
#: Each timed run repeats the model until it lasts this long (tiny models are all noise).
_RUN_SECONDS = 0.01
#: Timing stops after this many seconds once _MIN_ROUNDS are done.
_BUDGET_SECONDS = 1.0
_MIN_ROUNDS, _MAX_ROUNDS, _WARMUP = 15, 60, 2
#: From this many rounds on, a placement that can no longer be chosen stops being timed
#: (slower than FP32 in the median and faster in at most :data:`_HOPELESS_SHARE` of the
#: rounds, or MARGIN slower than an earlier placement found faster), so the plan's cost
#: grows with the model, not with the number of candidates.
_PRUNE_AFTER, _HOPELESS_SHARE = 5, 0.2
#: The same, for callers that time with a budget of their own (``mixprec optimize``):
#: the rounds before pruning, the warm-up rounds, and the least time of one timed run.
PRUNE_AFTER, WARMUP_ROUNDS, RUN_SECONDS = _PRUNE_AFTER, _WARMUP, _RUN_SECONDS


@dataclass(frozen=True)
class SpeedDecision:
    """What :func:`decide` read from the timings and why it chose."""

    chosen: str
    ms: dict[str, float]
    ratio: dict[str, float]
    faster_share: dict[str, float]
    rounds: int
    why: str


def decide(
    times: Mapping[str, Sequence[float]],
    order: Sequence[str],
    pairs: Mapping[str, Sequence[float]] | None = None,
) -> SpeedDecision:
    """The placement to keep from per-round seconds (``times["fp32"]`` is the FP32
    model's, the other labels are placements, ``order`` as
    :func:`candidate_placements` lists them, the tie order;
    ``pairs``: the FP32 rounds each placement was timed beside, when each was timed in
    its own rounds; default ``times["fp32"]`` for all).

    Returns ``chosen == "fp32"`` when no placement is clearly faster.
    """
    ms = {label: float(np.median(t)) * 1e3 for label, t in times.items()}
    ratios = {label: _paired(times, label, pairs) for label in times}
    ratio = {label: float(np.median(r)) for label, r in ratios.items()}
    share = {label: float(np.mean(r < 1.0)) for label, r in ratios.items()}
    faster = [
        label
        for label in order
        if ratio[label] <= 1.0 - MARGIN and (ratio[label] <= SURE or share[label] >= MAJORITY)
    ]
    if not faster:
        why = (
            f"no INT8 placement was {MARGIN:.0%} faster than FP32 in the median and in "
            f"{MAJORITY:.0%} of the rounds: the model stays float"
        )
        return SpeedDecision("fp32", ms, ratio, share, len(times["fp32"]), why)
    best = min(faster, key=lambda label: ratio[label])
    chosen = next(label for label in faster if ratio[label] <= ratio[best] + BAND)
    why = f"{ratio[chosen]:.2f}x FP32 (median paired ratio; faster in {share[chosen]:.0%} "
    why += "of rounds)"
    if chosen != best:
        why += f"; {best!r} ({ratio[best]:.2f}x) is within {BAND:.0%}: ties go to the "
        why += "placement listed first"
    return SpeedDecision(chosen, ms, ratio, share, len(times["fp32"]), why)


def _paired(
    times: Mapping[str, Sequence[float]],
    label: str,
    pairs: Mapping[str, Sequence[float]] | None = None,
) -> np.ndarray:
    """Per-round ratios of ``label`` to FP32 (a placement dropped early has the first
    rounds only): to the FP32 rounds it was timed beside (``pairs``), else ``times["fp32"]``."""
    own = np.asarray(times[label], dtype=np.float64)
    reference = (pairs or {}).get(label, times["fp32"])
    return own / np.asarray(reference[: len(own)], dtype=np.float64)


#: z of the 95% interval of a median ratio, and of the narrower one (83.4%) whose overlap
#: of two independent medians' intervals is about a 5% test of their difference.
Z_95, Z_COMPARE = 1.96, 1.386


def median_interval(values: np.ndarray | Sequence[float], z: float = Z_95) -> tuple[float, float]:
    """A distribution-free interval of the median of ``values`` (rounds' ratios), 95% at
    the default ``z``: the order statistics k and n + 1 - k, k at n/2 - z sqrt(n)/2 (the
    sign test's; the whole range for fewer than 6 values)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    n = len(ordered)
    if n == 0:
        return math.nan, math.nan
    if n < 6:
        return float(ordered[0]), float(ordered[-1])
    lo = max(math.floor(n / 2 - z * math.sqrt(n) / 2), 0)
    return float(ordered[lo]), float(ordered[n - 1 - lo])


def _hopeless(times: Mapping[str, Sequence[float]], label: str, bar: float | None = None) -> bool:
    """A placement :func:`decide` can no longer choose: slower than FP32 in the median
    and faster in at most :data:`_HOPELESS_SHARE` of the rounds so far, or surely
    :data:`MARGIN` slower than ``bar`` (a placement listed before it, found faster:
    whenever this one is within :data:`BAND` of the best, so is that one, which comes
    first): the 95% interval of its median ratio lies at or above ``bar + MARGIN`` (after
    5 rounds, every round did). A median alone pruned OpenVINO's bf16 R-Net on 5 slow
    first rounds (0.55x [0.22-0.63] against 0.40x) where 60 rounds measured 0.34x."""
    ratios = _paired(times, label)
    median = float(np.median(ratios))
    if bar is not None and median_interval(ratios)[0] >= bar + MARGIN:
        return True
    return median >= 1.0 and float(np.mean(ratios < 1.0)) <= _HOPELESS_SHARE


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


@dataclass(frozen=True)
class Placement:
    """A candidate INT8 placement: node exclusions on top of the user's, and how ops
    without weights join (:class:`~mixprec.int8.plan.AnnotateInt8Pass`'s ``placement``)."""

    exclude: tuple[str, ...]
    ops: str = "chains"


#: The model stays float (no INT8 placement was clearly faster).
STAY_FLOAT = Placement((".*",))


def candidate_placements(model: ir.Model, user_excluded: tuple[str, ...]) -> dict[str, Placement]:
    """Placements to time, by label, in the order :func:`decide` prefers them on a tie:
    'all' first (every Conv/MatMul/Gemm and the ops their INT8 chains feed), then ORT
    quantize_static's 'every INT8 op' (the same MACs, more ops without weights quantized,
    so more rounding for at most a few percent: measured 0-6% on PP-OCRv4 det/rec), then
    those with less INT8 work."""
    macs = node_macs(model)
    total = sum(macs.values()) or 1
    depthwise = _depthwise(model)
    small = [n for n, m in macs.items() if m and m < 0.01 * total]
    found = {"all": (), "no depthwise Conv": tuple(depthwise)}
    found["only Conv/MatMul/Gemm with >= 1% of the MACs"] = tuple(dict.fromkeys(depthwise + small))
    unique: dict[tuple[str, ...], str] = {}
    for label, names in found.items():
        unique.setdefault(names, label)
    user = tuple(user_excluded)
    placements = {
        label: Placement(user + tuple(re.escape(n) for n in names))
        for names, label in unique.items()
    }
    every = {"every INT8 op (ORT quantize_static's placement)": Placement(user, "every")}
    return {"all": placements.pop("all"), **every, **placements}


def session(proto: onnx.ModelProto, runtime: RuntimeOptions | None = None) -> Session:
    """A timing session in the deployment's engine (ONNX Runtime by default).

    Several sessions are alive at once: an ONNX Runtime session then keeps no arena (each
    frees its activations after every run, so timing costs about one inference's memory,
    not one per session) and no spinning pool threads, which would take the cores from
    the next session in the round (MTCNN P-Net timed 'all' at 0.14x FP32 in half the
    rounds and slower in the other half).
    """
    options = runtime or RuntimeOptions()
    return engine_for(options).session(proto, options, timing=True)


def _runner(session: Session, feeds: Mapping[str, np.ndarray]) -> Callable[[], object]:
    """One run of ``session`` on ``feeds`` to time: on a device with its own memory (a GPU
    provider) the feeds are bound there once (:meth:`Session.bind`), so the copies are not
    timed; on the CPU (or a session without the binding path), ``run(feeds)`` as always."""
    if getattr(session, "binds_on_device", False):
        return session.bind(feeds).run
    return functools.partial(session.run, feeds)


def time_paired(
    sessions: Mapping[str, Session],
    feeds: Mapping[str, np.ndarray],
    bar: float | None = None,
    *,
    seconds: float | None = None,
    dropped: set[str] | None = None,
    prune: bool = True,
) -> dict[str, list[float]]:
    """Seconds per run of each session, round by round (rotating order; ``"fp32"`` is
    the reference the rounds pair with). After :data:`_PRUNE_AFTER` rounds a placement
    that can no longer be chosen drops out (its list stops there): slower than FP32, or
    :data:`MARGIN` slower in the median than ``bar``, the paired ratio of a placement
    listed before it and already found faster (:func:`decide` would choose that one).
    When none is left, timing stops.

    ``seconds``: stop once that many seconds passed and :data:`PRUNE_AFTER` rounds are
    done (default: :data:`_BUDGET_SECONDS` and at least :data:`_MIN_ROUNDS` rounds);
    ``dropped`` gets the labels that dropped out; ``prune=False``: none drops out (more
    rounds of placements already found undecided)."""
    runners = {label: _runner(s, feeds) for label, s in sessions.items()}
    start = clock.now()
    runners["fp32"]()
    repeat = max(1, int(_RUN_SECONDS / max(clock.now() - start, 1e-6)))
    labels = list(runners)
    least, limit = (_MIN_ROUNDS, _BUDGET_SECONDS) if seconds is None else (_PRUNE_AFTER, seconds)
    times: dict[str, list[float]] = {label: [] for label in labels}
    began = clock.now()
    rounds = 0
    while rounds < _MAX_ROUNDS + _WARMUP and len(labels) > 1:
        order = labels[rounds % len(labels) :] + labels[: rounds % len(labels)]
        for label in order:
            start = clock.now()
            for _ in range(repeat):
                runners[label]()
            if rounds >= _WARMUP:
                times[label].append((clock.now() - start) / repeat)
        rounds += 1
        done = rounds - _WARMUP
        if prune and done >= _PRUNE_AFTER:
            kept = [x for x in labels if x == "fp32" or not _hopeless(times, x, bar)]
            if dropped is not None:
                dropped.update(set(labels) - set(kept))
            labels = kept
        if done >= least and clock.now() - began >= limit:
            break
    return times


def choose_placement(
    fp32: onnx.ModelProto,
    placements: Mapping[str, Placement],
    build: Callable[[Placement], onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
    runtime: RuntimeOptions | None = None,
) -> tuple[Placement, dict[str, object]]:
    """Times the user's ``fp32`` model and each placement built by ``build(placement)``
    on ``feeds`` (``placements`` in :func:`candidate_placements`' order) in the ``runtime`` the
    user deploys on (ONNX Runtime by default).

    Returns the placement to use (:data:`STAY_FLOAT` when none is clearly faster) and
    what was measured (``ms``, ``ratio``, ``faster_share``, ``rounds``, ``dropped``: the
    rounds of each placement dropped early, ``chosen``, ``summary``).
    """
    reference = session(fp32, runtime)
    times: dict[str, list[float]] = {"fp32": []}
    pairs: dict[str, list[float]] = {}
    refused: dict[str, str] = {}
    bar: float | None = None  # the best paired ratio of a placement found faster so far
    for label, placement in placements.items():
        # One placement at a time beside FP32: two sessions alive, not one per
        # placement (MiniLM's five sessions took its peak RSS to 1.7x ORT's quantizer's).
        try:  # a placement the runtime cannot compile is no candidate (OpenVINO's LPT
            candidate = session(build(placement), runtime)  # threw on PP-OCR cls)
            candidate.run(feeds)
        except (RuntimeLoadError, RuntimeRunError) as e:
            refused[label] = str(e)
            continue
        timed = time_paired({"fp32": reference, label: candidate}, feeds, bar)
        del candidate
        times[label], pairs[label] = timed[label], timed["fp32"]
        times["fp32"] += timed["fp32"]
        alone = decide(timed, [label])
        if alone.chosen == label:
            bar = min(alone.ratio[label], bar if bar is not None else math.inf)
    placements = {k: v for k, v in placements.items() if k not in refused}
    dropped: dict[str, int] = {}
    if not placements:
        decision = SpeedDecision("fp32", {}, {}, {}, 0, "the runtime refused every placement")
    else:
        decision = decide(times, list(placements), pairs)
        decision = replace(decision, rounds=max(len(t) for t in pairs.values()))
        # dropped early: stopped before the minimum number of rounds (hopeless)
        dropped = {k: len(v) for k, v in pairs.items() if len(v) < _MIN_ROUNDS}
    chosen = placements[decision.chosen] if decision.chosen != "fp32" else STAY_FLOAT
    where = (runtime or RuntimeOptions()).name
    summary = _summary(decision, feeds, where, (dropped, refused))
    return chosen, {
        "ms": decision.ms,
        "ratio": decision.ratio,
        "faster_share": decision.faster_share,
        "rounds": decision.rounds,
        "dropped": dropped,
        "chosen": decision.chosen,
        "runtime": where,
        "refused": refused,
        "shapes": {k: list(np.shape(v)) for k, v in feeds.items()},
        "summary": summary,
    }


def _summary(
    decision: SpeedDecision,
    feeds: Mapping[str, np.ndarray],
    where: str,
    left: tuple[dict[str, int], dict[str, str]],
) -> str:
    """The plan's note: what was timed where, at which shapes, what was chosen and why;
    ``left``: the placements dropped early (their rounds) and those the runtime refused."""
    dropped, refused = left
    shapes = ", ".join(f"{k} {list(np.shape(v))}" for k, v in feeds.items())
    return (
        f"INT8 placement timed in {where} on this CPU at {shapes} (ms, median of up to "
        f"{decision.rounds} rounds, each placement interleaved with FP32): "
        + ", ".join(
            f"{label} {value:.2f}"
            + (f" (dropped after {dropped[label]} rounds)" if label in dropped else "")
            for label, value in decision.ms.items()
        )
        + f"; chose {decision.chosen!r}: {decision.why}"
        + "".join(f"; {label!r} refused by the runtime: {why}" for label, why in refused.items())
    )
