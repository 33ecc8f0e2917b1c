"""Items cut into consecutive runs under a byte budget (one home for the three places that
hold a bounded amount of fetched or accumulated data at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

__all__ = ["runs_within"]

T = TypeVar("T")


def runs_within(
    items: Iterable[T], nbytes: Callable[[T], int], most: int, count: int | None = None
) -> list[list[T]]:
    """``items`` in order, in runs of at most ``most`` bytes (``nbytes`` of each item) and,
    given ``count``, at most that many items; an item larger than ``most`` gets a run of
    its own. No run is empty."""
    runs: list[list[T]] = [[]]
    total = 0
    for item in items:
        size = nbytes(item)
        full = total + size > most or (count is not None and len(runs[-1]) >= count)
        if runs[-1] and full:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += size
    return [run for run in runs if run]
