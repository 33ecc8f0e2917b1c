"""The one held-out draw: which of ``count`` items (samples, windows, a layer's rows) are
kept apart to check a fit on, never to fit it. The guard's split of the calibration
samples (:mod:`mixprec.checks.guard_samples`), the weight-only check samples and AdaRound's
held-out rows all draw here, so that "held out" means the same thing everywhere: a
seeded random share, the same every run."""

from __future__ import annotations

import numpy as np

__all__ = ["held_out_draw"]


def held_out_draw(count: int, share: float, cap: int, seed: int = 0) -> list[int]:
    """The positions held out of ``count`` items: a seeded random ``share`` of them, at
    least one (none of none) and at most ``cap``, sorted."""
    if count <= 0:
        return []
    size = min(cap, count, max(1, round(count * share)))
    return sorted(np.random.default_rng(seed).choice(count, size, replace=False).tolist())
