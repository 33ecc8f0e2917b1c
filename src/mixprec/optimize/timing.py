"""Timing the candidates against the input in ONNX Runtime, and pruning.

Each candidate is timed beside the input in ONNX Runtime (``fp32-ort``), the two taking
turns within each round, at the calibration sample's shape and with the user's threads
(:func:`mixprec.runtime.timing.time_paired`); each round gives a ratio candidate / FP32
measured milliseconds apart, and the median of those is the candidate's latency ratio,
with its 95% interval (the sign test's order statistics: :func:`median_interval`).

Pruning, so that the time grows with the model rather than with the candidates: after
:data:`~mixprec.runtime.timing.PRUNE_AFTER` (5) rounds a candidate stops being timed once it
is clearly slower than the best so far: the 95% interval of its median ratio lies 5%
(``MARGIN``) or more above the best ratio of an earlier candidate that would win, or it
is slower than the input in the median and faster in at most a fifth of the rounds. The
table shows how many rounds each candidate was timed for.

A candidate still undecided after its share (faster than the input in the median while
its interval reaches 1, or faster than the best so far in the median while its interval
reaches that ratio) is timed for another share, and its rounds pooled, up to
:data:`SHARES` shares in all: more rounds narrow the interval until it says which side
it is on, rather than a fixed count that leaves a near tie to chance.

With a time budget each candidate gets an equal share of what is left; a share too small
for :data:`~mixprec.runtime.timing.PRUNE_AFTER` rounds (after the warm-up) leaves the rest
untimed, and a budget too small to time even one is refused before any work
(:func:`minimum_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mixprec.runtime import clock
from mixprec.runtime.engine import Session
from mixprec.runtime.timing import (
    PRUNE_AFTER,
    RUN_SECONDS,
    WARMUP_ROUNDS,
    Z_COMPARE,
    median_interval,
    time_paired,
)

__all__ = ["SHARES", "Timer", "Timing", "median_interval", "minimum_seconds", "undecided"]


@dataclass(frozen=True)
class Timing:
    """What timing one candidate beside the input measured.

    Attributes:
        ratio: The median paired ratio candidate / input in ONNX Runtime.
        faster_share: The share of rounds in which the candidate was faster.
        ms: The candidate's median milliseconds per run.
        rounds: The rounds it was timed for.
        pruned: It stopped early, clearly slower than the best so far.
    """

    ratio: float
    faster_share: float
    ms: float
    rounds: int
    pruned: bool = False
    #: The 95% interval of the median ratio (:func:`median_interval`); None: not known.
    low: float | None = None
    high: float | None = None
    #: The 83.4% interval: two candidates whose such intervals do not overlap differ at
    #: about the 5% level (two 95% intervals that do not overlap ask for far more).
    compare: tuple[float, float] | None = None

    @classmethod
    def of(cls, candidate: list[float], reference: list[float], pruned: bool) -> Timing:
        """From the seconds per round of the candidate and of the input beside it."""
        own = np.asarray(candidate, dtype=np.float64)
        ratios = own / np.asarray(reference[: len(own)], dtype=np.float64)
        low, high = median_interval(ratios)
        return cls(
            float(np.median(ratios)),
            float(np.mean(ratios < 1.0)),
            float(np.median(own)) * 1e3,
            len(own),
            pruned,
            low,
            high,
            median_interval(ratios, Z_COMPARE),
        )

    def overlaps(self, other: Timing) -> bool:
        """Whether the two medians do not differ at about the 5% level (their 83.4%
        intervals share a point; the 95% ones where those are not known): a tie within
        this run's noise."""
        mine = self.compare or (self.low, self.high)
        theirs = other.compare or (other.low, other.high)
        if None in (*mine, *theirs):
            return False
        return bool(mine[0] <= theirs[1] and theirs[0] <= mine[1])  # type: ignore[operator]

    @property
    def shown(self) -> str:
        """``0.62x [0.60-0.65]`` (the interval where it is known)."""
        if self.low is None or self.high is None:
            return f"{self.ratio:.2f}x"
        return f"{self.ratio:.2f}x [{self.low:.2f}-{self.high:.2f}]"


#: The most shares of timing one undecided candidate gets (:func:`undecided`).
SHARES = 3


def undecided(timing: Timing, bar: float | None) -> bool:
    """Whether more rounds could change what ``timing`` decides: faster than the input in
    the median with an interval that reaches 1, or faster in the median than ``bar`` (the
    best ratio so far) with an interval that reaches it."""
    if timing.pruned or timing.high is None:
        return False
    if timing.ratio < 1.0 <= timing.high:
        return True
    return bar is not None and timing.ratio < bar <= timing.high


def minimum_seconds(run_seconds: float) -> float:
    """The least time one candidate's timing takes, for a model one run of which takes
    ``run_seconds``: the warm-up and the rounds before pruning, of two sessions, each run
    repeated to at least 10 ms."""
    rounds = WARMUP_ROUNDS + PRUNE_AFTER
    return rounds * 2 * max(run_seconds, RUN_SECONDS)


class Timer:
    """Times candidates one by one beside the input's session, within a budget.

    Args:
        reference: the input in ONNX Runtime, set up for timing.
        feeds: the inputs every run gets.
        budget: seconds for all the timing (None: about a second per candidate).
        count: the candidates to time (the budget is shared among them).
    """

    def __init__(
        self,
        reference: Session,
        feeds: Mapping[str, np.ndarray],
        budget: float | None,
        count: int,
    ) -> None:
        self.reference = reference
        self.feeds = dict(feeds)
        self.left = math.inf if budget is None else budget
        self.budget = budget
        self.count = max(count, 1)
        reference.run(self.feeds)  # the first run sets up (allocations, kernels' caches)
        start = clock.now()
        reference.run(self.feeds)
        self.run_seconds = clock.now() - start

    def share(self) -> float | None:
        """The seconds the next candidate gets (None: the default), or 0 when the budget
        cannot time another one."""
        if self.budget is None:
            return None
        share = self.left / self.count
        return share if share >= minimum_seconds(self.run_seconds) else 0.0

    def time(self, session: Session, bar: float | None) -> Timing | None:
        """Times ``session`` beside the input; ``bar``: the best ratio so far of a
        candidate that would win (pruning's mark). None when the budget is spent."""
        return self._paired(self.reference, session, bar, prune=True)

    def head_to_head(self, earlier: Session, later: Session) -> Timing | None:
        """Times ``later`` beside ``earlier`` (its ratio to it, not to the input), two
        candidates whose ratios to the input tied: each round pairs them directly, so
        the noise of two separate timings beside the input does not add up. Never
        pruned; more shares while the interval reaches 1. None when the budget is spent."""
        return self._paired(earlier, later, None, prune=False)

    def _paired(
        self, reference: Session, session: Session, bar: float | None, prune: bool
    ) -> Timing | None:
        seconds = self.share()
        self.count = max(self.count - 1, 1)
        if seconds == 0.0:
            return None
        own: list[float] = []
        beside: list[float] = []
        for share in range(SHARES):
            dropped: set[str] = set()
            start = clock.now()
            times = time_paired(
                {"fp32": reference, "candidate": session},
                self.feeds,
                bar,
                seconds=seconds,
                dropped=dropped,
                prune=prune and share == 0,  # more rounds of an undecided one: all count
            )
            self.left -= clock.now() - start
            own += times["candidate"]
            beside += times["fp32"][: len(times["candidate"])]  # the rounds it was in
            timing = Timing.of(own, beside, "candidate" in dropped)
            if not undecided(timing, bar) or not self._spare(seconds):
                break
        return timing

    def _spare(self, seconds: float | None) -> bool:
        """Whether another share fits and leaves each candidate still to come its own."""
        if seconds is None:
            return True
        return self.left >= seconds * (self.count + 1)
