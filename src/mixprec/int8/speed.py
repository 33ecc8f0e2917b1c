"""Speed-aware INT8 placement: time candidate placements against FP32 on this machine.

ONNX Runtime's integer kernels lose to its float ones on some shapes (small or depthwise
convolutions, tiny models where the Q/DQ overhead dominates), and which ones depends on
the CPU. So, like an autotuner, ``quantize(speed="auto")`` builds a few candidate
placements, times each against the user's FP32 model and keeps the fastest only when it
is clearly faster; otherwise the model stays float.

Each placement is timed beside FP32 in its own rounds (:func:`mixprec.runtime.timing.
time_paired`; two sessions alive at a time, so memory does not grow with the number of
placements), each round giving a ratio candidate / FP32 measured milliseconds apart.
:func:`decide` reads only those paired ratios (a pure function, tested on recorded
timings): a placement is faster when its median ratio is at most ``1 - MARGIN`` and,
unless it is :data:`SURE` faster in the median, when at least :data:`MAJORITY` of the
rounds found it faster. Among the faster placements, the one listed first (the most
INT8 work: :func:`candidate_placements`) wins unless another is :data:`BAND` faster in the
median, so that two runs on one machine make the same choice when two placements time
alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnx_ir as ir

from mixprec.calibrate.measure import node_macs
from mixprec.core.layers import is_layer
from mixprec.int8.profiled import slower_layers
from mixprec.runtime.engine import LayerProfile, RuntimeLoadError, RuntimeOptions, RuntimeRunError
from mixprec.runtime.engines import engine_for
from mixprec.runtime.timing import MAJORITY, MARGIN, MIN_ROUNDS, paired_ratios, session, time_paired

__all__ = [
    "BAND",
    "PROFILED_BYTES",
    "SPEED_MARGINS",
    "STAY_FLOAT",
    "SURE",
    "Placement",
    "SpeedDecision",
    "candidate_placements",
    "choose_placement",
    "decide",
]

#: A placement is faster than FP32 as :mod:`mixprec.runtime.timing` judges paired rounds
#: (MARGIN in the median, MAJORITY of the rounds), unless its median ratio is at most
#: this (then no noise explains it: a placement twice as fast is never rejected).
SURE = 0.8
#: A placement with less INT8 work must beat the fuller one by this much in the median.
BAND = 0.05


@dataclass(frozen=True)
class SpeedDecision:
    """What :func:`decide` read from the timings and why it chose."""

    chosen: str
    ms: dict[str, float]
    ratio: dict[str, float]
    faster_share: dict[str, float]
    rounds: int
    why: str
    #: The placements found clearly faster than FP32, best first (the chosen one leads).
    faster: tuple[str, ...] = ()


def decide(
    times: Mapping[str, Sequence[float]],
    order: Sequence[str],
    pairs: Mapping[str, Sequence[float]] | None = None,
    margin: float = MARGIN,
) -> SpeedDecision:
    """The placement to keep from per-round seconds (``times["fp32"]`` is the FP32
    model's, the other labels are placements, ``order`` as
    :func:`candidate_placements` lists them, the tie order;
    ``pairs``: the FP32 rounds each placement was timed beside, when each was timed in
    its own rounds; default ``times["fp32"]`` for all).

    ``margin``: how much faster than FP32 a placement must be in the median
    (:data:`SPEED_MARGINS`: 0 for a caller that times the result against others itself;
    then a median under FP32's is enough, without the majority of rounds).

    Returns ``chosen == "fp32"`` when no placement is clearly faster.
    """
    ms = {label: float(np.median(t)) * 1e3 for label, t in times.items()}
    ratios = {label: paired_ratios(times, label, pairs) for label in times}
    ratio = {label: float(np.median(r)) for label, r in ratios.items()}
    share = {label: float(np.mean(r < 1.0)) for label, r in ratios.items()}

    def is_faster(label: str) -> bool:
        # margin 0: the caller judges the noise in its own loop (optimize's intervals);
        # PP-OCRv4 det's INT8 under the bf16 hint ran 0.93x in the median, faster in
        # only 51-62% of the rounds
        if not margin:
            return ratio[label] < 1.0
        clear = ratio[label] <= SURE or share[label] >= MAJORITY
        return ratio[label] <= 1.0 - margin and clear

    faster = [label for label in order if is_faster(label)]
    if not faster:
        by = f"{margin:.0%} " if margin else ""
        rounds = f" and in {MAJORITY:.0%} of the rounds" if margin else ""
        why = f"no INT8 placement was {by}faster than FP32 in the median{rounds}: the model "
        why += "stays float"
        return SpeedDecision("fp32", ms, ratio, share, len(times["fp32"]), why)
    best = min(faster, key=lambda label: ratio[label])
    chosen = next(label for label in faster if ratio[label] <= ratio[best] + BAND)
    why = f"{ratio[chosen]:.2f}x FP32 (median paired ratio; faster in {share[chosen]:.0%} "
    why += "of rounds)"
    if chosen != best:
        why += f"; {best!r} ({ratio[best]:.2f}x) is within {BAND:.0%}: ties go to the "
        why += "placement listed first"
    ranked = (chosen, *sorted((f for f in faster if f != chosen), key=lambda f: ratio[f]))
    return SpeedDecision(chosen, ms, ratio, share, len(times["fp32"]), why, ranked)


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


#: The largest model whose layers the speed plan reads from the runtime's profile (it
#: runs the FP32 and the all-INT8 model in two more sessions, beside the timed ones).
PROFILED_BYTES = 256 << 20

#: How much faster than FP32 a placement must be, by QuantizeConfig.speed: "auto" keeps
#: the model float unless INT8 is clearly faster; "compete" (``mixprec optimize``) keeps
#: the fastest placement faster in the median (no majority of rounds), which optimize
#: then times against its other candidates with its own intervals and tie rule (a 5%
#: gate here kept PP-OCRv4 det's INT8 out of optimize's loop, where NNCF's INT8 ran
#: 0.92x the bf16 hint).
SPEED_MARGINS = {"auto": MARGIN, "compete": 0.0}

#: The model stays float (no INT8 placement was clearly faster).
STAY_FLOAT = Placement((".*",))


def candidate_placements(
    model: ir.Model, user_excluded: tuple[str, ...], ops: str = "chains"
) -> dict[str, Placement]:
    """Placements to time, by label, in the order :func:`decide` prefers them on a tie:
    'all' first (every Conv/MatMul/Gemm and the ops their INT8 chains feed), then ORT
    quantize_static's 'every INT8 op' (the same MACs, more ops without weights quantized,
    so more rounding for at most a few percent: measured 0-6% on PP-OCRv4 det/rec), then
    those with less INT8 work.

    ``ops`` "weighted" (a runtime that reads Q/DQ pairs as FakeQuantize, OpenVINO): only
    the layers' inputs are quantized and the runtime chooses what else runs on INT8
    data, so no placement quantizes ops without weights. PP-OCRv4 det all-INT8 in
    OpenVINO under the bf16 hint (Xeon with AMX): 1.91x the bf16 hint with its
    HardSwish chains quantized, 0.95x with layer inputs only (NNCF's INT8: 1.00x)."""
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
        label: Placement(user + tuple(re.escape(n) for n in names), ops)
        for names, label in unique.items()
    }
    if ops == "weighted":
        return placements
    every = {"every INT8 op (ORT quantize_static's placement)": Placement(user, "every")}
    return {"all": placements.pop("all"), **every, **placements}


def choose_placement(
    fp32: onnx.ModelProto,
    placements: Mapping[str, Placement],
    build: Callable[[Placement], onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
    runtime: RuntimeOptions | None = None,
    profile: bool = True,
    margin: float = MARGIN,
) -> tuple[Placement, dict[str, object], list[tuple[str, Placement]]]:
    """Times the user's ``fp32`` model and each placement built by ``build(placement)``
    on ``feeds`` (``placements`` in :func:`candidate_placements`' order) in the ``runtime`` the
    user deploys on (ONNX Runtime by default).

    ``profile``: first ask the runtime's per-layer profile which layers of the first
    placement are no faster in INT8, and time a placement keeping them float first
    (:func:`_with_profiled`).

    Returns the placement to use (:data:`STAY_FLOAT` when none is clearly faster) and
    what was measured (``ms``, ``ratio``, ``faster_share``, ``rounds``, ``dropped``: the
    rounds of each placement dropped early, ``chosen``, ``summary``, ``profiled``: the
    layers the profile kept float, with their regions' ratios; ``profile_note``: why no
    such placement was timed, empty when one was or ``profile`` is off; ``faster``: the
    placements found clearly faster, best first), and the other placements found faster,
    best first, by label (the guard's fallback when the chosen one misses).
    """
    slower: dict[str, float] = {}
    no_profile = ""
    if profile:
        build, placements, slower, no_profile = _with_profiled(
            fp32, placements, build, feeds, runtime, ahead=margin > 0
        )
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
        alone = decide(timed, [label], margin=margin)
        if alone.chosen == label:
            bar = min(alone.ratio[label], bar if bar is not None else math.inf)
    placements = {k: v for k, v in placements.items() if k not in refused}
    dropped: dict[str, int] = {}
    if not placements:
        decision = SpeedDecision("fp32", {}, {}, {}, 0, "the runtime refused every placement")
    else:
        decision = decide(times, list(placements), pairs, margin)
        decision = replace(decision, rounds=max(len(t) for t in pairs.values()))
        # dropped early: stopped before the minimum number of rounds (hopeless)
        dropped = {k: len(v) for k, v in pairs.items() if len(v) < MIN_ROUNDS}
    chosen = placements[decision.chosen] if decision.chosen != "fp32" else STAY_FLOAT
    where = (runtime or RuntimeOptions()).name
    summary = _summary(decision, feeds, where, (dropped, refused))
    if no_profile:
        summary += f"; no placement from the per-layer profile: {no_profile}"
    measured: dict[str, object] = {
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
        "profiled": slower,
        "profile_note": no_profile,
        "faster": list(decision.faster),
    }
    return chosen, measured, [(k, placements[k]) for k in decision.faster if k != decision.chosen]


def _with_profiled(
    fp32: onnx.ModelProto,
    placements: Mapping[str, Placement],
    build: Callable[[Placement], onnx.ModelProto],
    feeds: Mapping[str, np.ndarray],
    runtime: RuntimeOptions | None,
    ahead: bool = True,
) -> tuple[Callable[[Placement], onnx.ModelProto], dict[str, Placement], dict[str, float], str]:
    """The placements with one more where the runtime's profile
    (:mod:`mixprec.int8.profiled`) found layers of the first (fullest) placement no
    faster in INT8 than in FP32: that placement with those layers kept float. ``ahead``:
    listed first, it wins a tie (as fast, and more of the model in FP32); else listed
    right after the fullest one, which wins a tie (speed "compete": optimize, whose guard
    checks the result, wants the faster in the long run: PP-OCRv4 det under OpenVINO's
    bf16 hint, Xeon with AMX, 'all' 0.93-0.95x FP32 in three plans, the profiled one
    0.96-0.99x, and optimize kept the bf16 hint where the profiled INT8 won the plan's
    tie, took INT8 where 'all' did). Returns the build (the first placement's model
    built once), the placements, the slower layers with their regions' ratios, and why
    none were found (empty when some were)."""
    first_label, first = next(iter(placements.items()))
    if fp32.ByteSize() > PROFILED_BYTES:  # two more sessions and copies of a large model
        return build, dict(placements), {}, f"the model is over {PROFILED_BYTES >> 20} MB"
    built = {first: build(first)}

    def cached(placement: Placement) -> onnx.ModelProto:
        # handed over once: each placement is built once, and the copy held through the
        # others' timing was MiniLM's peak (OpenVINO's INT8 speed plan)
        found = built.pop(placement, None)
        return found if found is not None else build(placement)

    fp32_profile = _profile(fp32, feeds, runtime)
    int8_profile = _profile(built[first], feeds, runtime) if fp32_profile is not None else None
    if fp32_profile is None or int8_profile is None:
        return cached, dict(placements), {}, "the runtime gave none (its reason is logged)"
    named = {n.name for n in built[first].graph.node} - {""}  # the prepared graph's names
    layers = [n.name for n in fp32.graph.node if is_layer(n) and n.name in named]
    slower = slower_layers(fp32.graph, layers, fp32_profile, int8_profile)
    if not slower:
        return cached, dict(placements), {}, "it found no layer slower in INT8"
    if len(slower) == len(layers):
        return cached, dict(placements), {}, "it found every layer no faster in INT8"
    kept = Placement(first.exclude + tuple(re.escape(n) for n in slower), first.ops)
    label = f"{first_label} but {len(slower)} layer(s) the profile found no faster in INT8"
    if ahead:
        return cached, {label: kept, **placements}, slower, ""
    rest = {k: v for k, v in placements.items() if k != first_label}
    return cached, {first_label: first, label: kept, **rest}, slower, ""


def _profile(
    model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], runtime: RuntimeOptions | None
) -> LayerProfile | None:
    """The engine's per-kernel profile of ``model`` (None: an engine without one)."""
    options = runtime or RuntimeOptions()
    profiler = getattr(engine_for(options), "layer_profile", None)  # a registered engine's
    return profiler(model, feeds, options) if profiler is not None else None


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
