"""One shape for every repair search: moves, a cost, a grader.

A repair search holds its **moves**, ranked most sensitive first, each a node or layer,
where it goes and what going there costs (:class:`Move`). Its **grader** builds and checks
the candidate with the first ``k`` moves made (:meth:`Moves.grade`). The strategies:

- INT8 nodes back to float, and bf16/fp16 nodes back to FP32: :class:`mixprec.tune.search.Search`
  (the cost of a move: the MACs that leave low precision), and the INT8 guard's widening
  of the tuner's answer (:mod:`mixprec.repair.int8_repair`);
- weight-only layers to 8 bits, then to float: :class:`mixprec.repair.lm_repair.Repair`
  (the cost: the bytes a layer adds).

The drivers are shared: :func:`climb` grades growing prefixes until one passes, then
:func:`narrow` halves the bracket between a failing prefix ``lo`` and a passing one
``hi`` by whatever axis the search's ``step`` chooses (the count of moves: :func:`halving`;
their cost or error energy: :func:`midpoint` on :func:`shares`) until ``step`` says it
is done.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

__all__ = ["Move", "Moves", "climb", "halving", "halvings", "midpoint", "narrow", "shares"]

#: Where the next prefix lies in the bracket (strictly inside), or None: the search is done.
Step = Callable[[int, int], int | None]


@dataclasses.dataclass(frozen=True)
class Move:
    """One repair move: ``name`` (a node or layer) goes ``to`` a precision ("float",
    "int8"); ``score`` its sensitivity (what ranks it), ``cost`` what the move costs (MACs
    leaving low precision, bytes added)."""

    name: str
    to: str
    score: float
    cost: float


class Moves(Protocol):
    """A repair search as the drivers see it: its moves, most sensitive first, and the
    grade of a prefix of them."""

    @property
    def moves(self) -> Sequence[Move]: ...

    def grade(self, k: int) -> bool:
        """The first ``k`` moves made, the candidate built and checked: whether it passes."""
        ...


def shares(values: Sequence[float], total: float | None = None) -> list[float]:
    """The share of ``total`` (default: their sum) that each prefix of ``values`` holds
    (``len(values) + 1`` entries, rising from 0): the axis :func:`midpoint` halves."""
    cumulative = np.cumsum([0.0, *values])
    whole = float(cumulative[-1]) if total is None else total
    return [float(c) / whole if whole > 0 else 0.0 for c in cumulative]


def midpoint(axis: Sequence[float], lo: int, hi: int) -> int:
    """The ``k`` strictly inside (lo, hi) where ``axis`` (cumulative, rising) is halfway
    between its values at ``lo`` and ``hi``."""
    half = (axis[lo] + axis[hi]) / 2
    k = int(np.searchsorted(np.asarray(axis), half, side="left"))
    return min(max(k, lo + 1), hi - 1)


def halving(lo: int, hi: int) -> int | None:
    """The plain step: the middle count, while one lies strictly inside."""
    mid = (lo + hi) // 2
    return mid if lo < mid < hi else None


def halvings(rounds: int) -> Step:
    """A step that halves the count at most ``rounds`` times."""
    left = iter(range(rounds))
    return lambda lo, hi: halving(lo, hi) if next(left, None) is not None else None


def narrow(passes: Callable[[int], bool], lo: int, hi: int, step: Step) -> tuple[int, int]:
    """The bracket (``lo`` failing, ``hi`` passing) narrowed: each prefix ``step`` names
    is graded (``passes``) and replaces the bound it is on the side of. Stops when
    ``step`` returns None or a prefix outside the bracket."""
    while (k := step(lo, hi)) is not None and lo < k < hi:
        if passes(k):
            hi = k
        else:
            lo = k
    return lo, hi


def climb(search: Moves, counts: Sequence[int], step: Step) -> int | None:
    """The fewest moves found to pass: the prefixes ``counts`` (rising) graded in turn
    until one passes, then the bracket between it and the failing one before it (0 for
    the first) narrowed by ``step``. None when none passes."""
    lo = 0
    for k in counts:
        if search.grade(k):
            return narrow(search.grade, lo, k, step)[1]
        lo = k
    return None
