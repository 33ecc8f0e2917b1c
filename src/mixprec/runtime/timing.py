"""Paired timing: models timed against a reference on this machine, the service the INT8
speed plan (:mod:`mixprec.int8.speed`) and ``mixprec optimize`` (:mod:`mixprec.optimize.
timing`) both call, and the rule that reads its rounds.

Timing on shared machines is noisy: each model is timed beside the reference (``"fp32"``)
in rounds, the sessions taking turns within each round, and each round gives a ratio
model / reference measured milliseconds apart. The INT8 speed plan counts a placement
faster when its median ratio is at most ``1 - MARGIN`` and it was faster in
:data:`MAJORITY` of the rounds (``optimize`` has its own margin, with the same majority);
a median's interval (:func:`median_interval`) says how sure a ratio is. The clock is
:func:`mixprec.runtime.clock.now`, so tests time fake sessions on a virtual clock.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from mixprec.runtime import clock
from mixprec.runtime.engine import RuntimeOptions, Session
from mixprec.runtime.engines import engine_for

__all__ = [
    "MAJORITY",
    "MARGIN",
    "MIN_ROUNDS",
    "PRUNE_AFTER",
    "RUN_SECONDS",
    "WARMUP_ROUNDS",
    "Z_95",
    "Z_COMPARE",
    "hopeless",
    "median_interval",
    "paired_ratios",
    "session",
    "time_paired",
]

#: A model must be at least this much faster than the reference in the median paired
#: ratio to count as faster ...
MARGIN = 0.05
#: ... and faster than the reference in at least this share of the rounds.
MAJORITY = 0.6
#: Each timed run repeats the model until it lasts this long (tiny models are all noise).
RUN_SECONDS = 0.01
#: Timing stops after this many seconds once MIN_ROUNDS are done (no budget given).
_BUDGET_SECONDS = 1.0
#: The least and most rounds, and the warm-up rounds before them (not recorded).
MIN_ROUNDS, _MAX_ROUNDS, WARMUP_ROUNDS = 15, 60, 2
#: From this many rounds on, a model that can no longer win stops being timed (slower
#: than the reference in the median and faster in at most :data:`_HOPELESS_SHARE` of the
#: rounds, or MARGIN slower than a model found faster before it), so the cost of a plan
#: grows with the model, not with the number of candidates.
PRUNE_AFTER, _HOPELESS_SHARE = 5, 0.2
#: z of the 95% interval of a median ratio, and of the narrower one (83.4%) whose overlap
#: of two independent medians' intervals is about a 5% test of their difference.
Z_95, Z_COMPARE = 1.96, 1.386


def paired_ratios(
    times: Mapping[str, Sequence[float]],
    label: str,
    pairs: Mapping[str, Sequence[float]] | None = None,
) -> np.ndarray:
    """Per-round ratios of ``label`` to the reference (a model dropped early has the
    first rounds only): to the reference rounds it was timed beside (``pairs``), else
    ``times["fp32"]``."""
    own = np.asarray(times[label], dtype=np.float64)
    reference = (pairs or {}).get(label, times["fp32"])
    return own / np.asarray(reference[: len(own)], dtype=np.float64)


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


def hopeless(times: Mapping[str, Sequence[float]], label: str, bar: float | None = None) -> bool:
    """A model that can no longer win: slower than the reference in the median and
    faster in at most :data:`_HOPELESS_SHARE` of the rounds so far, or surely
    :data:`MARGIN` slower than ``bar`` (the ratio of a model listed before it, found
    faster): the 95% interval of its median ratio lies at or above ``bar + MARGIN``
    (after 5 rounds, every round did). A median alone pruned OpenVINO's bf16 R-Net on 5
    slow first rounds (0.55x [0.22-0.63] against 0.40x) where 60 rounds measured 0.34x."""
    ratios = paired_ratios(times, label)
    median = float(np.median(ratios))
    if bar is not None and median_interval(ratios)[0] >= bar + MARGIN:
        return True
    return median >= 1.0 and float(np.mean(ratios < 1.0)) <= _HOPELESS_SHARE


def session(proto: onnx.ModelProto, runtime: RuntimeOptions | None = None) -> Session:
    """A timing session in the deployment's engine (ONNX Runtime by default).

    Several sessions are alive at once, taking turns: an ONNX Runtime session's pool
    threads then spin within a run, as served, and stop when it ends
    (:data:`~mixprec.runtime.engine.TIMING_HINTS`); threads still spinning would take
    the cores from the next session in the round (MTCNN P-Net timed 'all' at 0.14x FP32
    in half the rounds and slower in the other half), and threads that never spin run
    ONNX Runtime 1.4-1.9x slower than its defaults on small models.
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
    the reference the rounds pair with). After :data:`PRUNE_AFTER` rounds a model that
    can no longer win drops out (its list stops there, :func:`hopeless`): slower than the
    reference, or :data:`MARGIN` slower in the median than ``bar``, the paired ratio of a
    model listed before it and already found faster. When none is left, timing stops.

    ``seconds``: stop once that many seconds passed and :data:`PRUNE_AFTER` rounds are
    done (default: :data:`_BUDGET_SECONDS` and at least :data:`MIN_ROUNDS` rounds);
    ``dropped`` gets the labels that dropped out; ``prune=False``: none drops out (more
    rounds of models already found undecided)."""
    runners = {label: _runner(s, feeds) for label, s in sessions.items()}
    start = clock.now()
    runners["fp32"]()
    repeat = max(1, int(RUN_SECONDS / max(clock.now() - start, 1e-6)))
    labels = list(runners)
    least, limit = (MIN_ROUNDS, _BUDGET_SECONDS) if seconds is None else (PRUNE_AFTER, seconds)
    times: dict[str, list[float]] = {label: [] for label in labels}
    began = clock.now()
    rounds = 0
    while rounds < _MAX_ROUNDS + WARMUP_ROUNDS and len(labels) > 1:
        order = labels[rounds % len(labels) :] + labels[: rounds % len(labels)]
        for label in order:
            start = clock.now()
            for _ in range(repeat):
                runners[label]()
            if rounds >= WARMUP_ROUNDS:
                times[label].append((clock.now() - start) / repeat)
        rounds += 1
        done = rounds - WARMUP_ROUNDS
        if prune and done >= PRUNE_AFTER:
            kept = [x for x in labels if x == "fp32" or not hopeless(times, x, bar)]
            if dropped is not None:
                dropped.update(set(labels) - set(kept))
            labels = kept
        if done >= least and clock.now() - began >= limit:
            break
    return times
