"""The one narrowing every repair search does.

A repair search holds its moves ranked most sensitive first (INT8 or bf16/fp16 nodes back
to float: :class:`mixprec.tune.search.Search`; weight-only layers to 8 bits, then to
float: :class:`mixprec.repair.lm_repair.Repair`) and grades prefixes of that ranking: the
first ``k`` moves made, the candidate built and checked. A bracket is a failing prefix
``lo`` and a passing prefix ``hi`` (``lo < hi``); :func:`narrow` halves it, by whatever
axis the search's ``step`` chooses (the moves' count, the MACs or bytes at stake, the
error energy), until ``step`` says it is done.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["halving", "narrow"]

#: Where the next prefix lies in the bracket (strictly inside), or None: the search is done.
Step = Callable[[int, int], int | None]


def halving(lo: int, hi: int) -> int | None:
    """The plain step: the middle count, while one lies strictly inside."""
    mid = (lo + hi) // 2
    return mid if lo < mid < hi else None


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
