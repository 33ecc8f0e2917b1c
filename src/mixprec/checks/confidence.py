"""How sure a pass is: the lower confidence bound of an agreement share measured on
held-out rows, and how many rows it would take to confirm a budget.

An agreement check (top-1 on class scores, equal elements of an integer output) counts
the held-out rows that agree with FP32. Its share is an estimate: 32 rows that all agree
cannot tell a model that agrees on 99% of new inputs from one that agrees on 97%. The
guard compares the one-sided Wilson score lower bound of the share (95%: z = 1.645) with
the budget as well as the share itself: a pass whose bound is below the budget is a pass
the held-out rows cannot confirm, and the guard says so with the rows it would take.

The bound treats rows as independent answers. Rows of one image's class map (a
segmentation's pixels, a detector's anchor positions, a recogniser's timesteps) are not:
there it is optimistic, and the sample count is the sounder reading of how much was seen.

Wilson's interval, not the normal approximation, because the shares here sit near 1
(where the normal interval collapses to zero width when every row agrees); not
Clopper-Pearson, which is conservative by design and would ask for ~10% more rows.
"""

from __future__ import annotations

import math

__all__ = ["CONFIDENCE", "Z_ONE_SIDED", "lower_bound", "rows_to_confirm"]

#: The confidence of the guard's lower bounds ...
CONFIDENCE = 0.95
#: ... as the one-sided standard normal quantile.
Z_ONE_SIDED = 1.6448536269514722


def lower_bound(share: float, rows: int, z: float = Z_ONE_SIDED) -> float:
    """The one-sided Wilson score lower bound of an agreement ``share`` measured on
    ``rows`` independent rows (0 for no rows)."""
    if rows <= 0 or not math.isfinite(share):
        return 0.0
    p = min(max(share, 0.0), 1.0)
    z2 = z * z
    centre = p + z2 / (2 * rows)
    spread = z * math.sqrt(p * (1 - p) / rows + z2 / (4 * rows * rows))
    return max(0.0, (centre - spread) / (1 + z2 / rows))


def rows_to_confirm(share: float, budget: float, z: float = Z_ONE_SIDED) -> int | None:
    """The fewest rows on which the same ``share`` would have a lower bound of at least
    ``budget``; None when no count would (the share is at or below the budget)."""
    if not math.isfinite(share) or share <= budget:
        return None
    high = 1
    while lower_bound(share, high, z) < budget:
        high *= 2
        if high > 1 << 40:  # a share a hair above the budget: no useful count
            return None
    low = high // 2  # lower_bound(share, low) < budget, or low == 0
    while high - low > 1:
        mid = (low + high) // 2
        if lower_bound(share, mid, z) >= budget:
            high = mid
        else:
            low = mid
    return high
