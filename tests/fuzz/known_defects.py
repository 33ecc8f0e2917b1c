"""Fuzz cases that reveal a defect not fixed yet.

Each entry is one reproducible case (mutation, seed), the defect kind observed (see
``classify.KINDS``), a regex its detail line matches (used to recognise the same cause
in other cases, e.g. the hypothesis sequences) and a short cause. The pytest run marks
these cases ``xfail(strict=True)``: when a fix lands the case passes, the test fails,
and the entry must be removed. Reproduce one with its ``repro`` command.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["KNOWN", "KnownDefect", "known_for", "matches_known"]


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    mutation: str
    seed: int
    kind: str
    match: str  # regex searched in the outcome's detail line
    cause: str

    def matches(self, kind: str | None, detail: str) -> bool:
        return kind == self.kind and re.search(self.match, detail) is not None


KNOWN: tuple[KnownDefect, ...] = ()


def known_for(mutation: str, seed: int) -> KnownDefect | None:
    for entry in KNOWN:
        if entry.mutation == mutation and entry.seed == seed:
            return entry
    return None


def matches_known(kind: str | None, detail: str) -> KnownDefect | None:
    """The known defect whose cause an outcome shows (same kind, detail matches), if any."""
    for entry in KNOWN:
        if entry.matches(kind, detail):
            return entry
    return None
