"""Fuzz cases that reveal a defect not fixed yet, and the causes they show.

A :class:`Cause` is one defect of mixprec: the outcome kind it produces (see
``classify.KINDS``), a regex that its detail line matches, and a short explanation. Each
:class:`KnownDefect` is one reproducible case of the pytest budget (mutation, seed) and
its cause. The pytest run marks these cases ``xfail(strict=True)``: when a fix lands the
case passes, the test fails (XPASS), and the entry must be removed; the hypothesis
sequences accept a defect only when it matches a known cause. Reproduce a case with
``.venv/bin/python -m tests.fuzz --mutation NAME --seed N`` (``--keep DIR`` keeps files).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["CAUSES", "KNOWN", "Cause", "KnownDefect", "known_for", "matches_known"]


@dataclasses.dataclass(frozen=True)
class Cause:
    kind: str  # the defect kind observed (classify.KINDS)
    match: str  # regex searched in the outcome's detail line
    text: str  # the cause, in a sentence

    def matches(self, kind: str | None, detail: str) -> bool:
        return kind == self.kind and re.search(self.match, detail) is not None


CAUSES: dict[str, Cause] = {}


@dataclasses.dataclass(frozen=True)
class KnownDefect:
    mutation: str
    seed: int
    cause: str  # a key of CAUSES

    @property
    def kind(self) -> str:
        return CAUSES[self.cause].kind

    def matches(self, kind: str | None, detail: str) -> bool:
        return CAUSES[self.cause].matches(kind, detail)


KNOWN: tuple[KnownDefect, ...] = ()


def known_for(mutation: str, seed: int) -> KnownDefect | None:
    for entry in KNOWN:
        if entry.mutation == mutation and entry.seed == seed:
            return entry
    return None


def matches_known(kind: str | None, detail: str) -> str | None:
    """The key of the known cause an outcome shows (same kind, detail matches), if any."""
    for key, cause in CAUSES.items():
        if cause.matches(kind, detail):
            return key
    return None
