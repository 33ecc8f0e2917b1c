"""The clock every timing of a model reads: seconds, monotonic, :func:`time.perf_counter`.

One home, so that a test can time a fake engine with a set speed: its sessions advance a
virtual clock as they run, and the test puts that clock here (``monkeypatch.setattr(
clock, "now", virtual)``). Then a ratio is what the fake engine's speed makes it, on any
machine under any load, and nothing in a test waits on the wall clock.
"""

from __future__ import annotations

import time

__all__ = ["now"]


def now() -> float:
    """Seconds on the timing clock (only differences mean anything)."""
    return time.perf_counter()
