"""The choice: the fastest accurate candidate, and why each of the others lost.

:func:`choose` reads only the table (a pure function, tested on made-up timings):

* a candidate that was skipped, failed, missed its accuracy budget or was not timed
  cannot win (a pruned one was clearly slower than an earlier one, or than the input,
  and loses to it);
* one that was timed wins only when it is :data:`GAIN` (3%) faster than the input in
  ONNX Runtime in the median paired ratio and faster in :data:`MAJORITY` of the rounds
  (noise explains less);
* and surely: the 95% interval of its median ratio lies under 1;
* among those, the first in the candidates' order (the simplest) wins unless a later one
  is :data:`GAIN` faster still and their medians differ (their 83.4% intervals do not
  overlap: :meth:`Timing.overlaps`; else a tie, said so), so that two runs on one
  machine choose alike;
* a tie between the earlier one and a later one (the fastest in the median, else the
  fastest of the later ones that tie) is timed again head to head (:class:`HeadToHead`:
  the two beside each other, not each beside the input), and the later one wins only
  when it is surely :data:`GAIN` faster there;
* when none qualifies, the input is the answer: ``fp32-ort`` wins, and the model is
  written unchanged. Where the caller left ``fp32-ort`` out of the candidates, the
  fastest accurate candidate among theirs wins however it compares with the input.

On a GPU device the baseline is the input on that device (``fp32-cuda``): the same
rules, with that name where ``fp32-ort`` stands above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from mixprec.checks.outputs import OutputCheck, least_confirmed, shown
from mixprec.optimize.candidates import BASELINE
from mixprec.optimize.timing import Timing
from mixprec.runtime.timing import MAJORITY

__all__ = ["GAIN", "MAJORITY", "HeadToHead", "Row", "accuracy_text", "choose", "contender"]

#: A candidate must be this much faster than the input (median paired ratio), and this
#: much faster than an earlier one, to be chosen over it.
GAIN = 0.03


@dataclass(frozen=True)
class Row:
    """One candidate in the table.

    Attributes:
        name: The candidate.
        runtime: The engine it runs in.
        hints: The engine properties it runs with (``{"INFERENCE_PRECISION_HINT": "bf16"}``).
        status: ``"timed"``, ``"baseline"`` (the input: ratio 1 by definition),
            ``"skipped"``, ``"failed"``, ``"inaccurate"`` or ``"not timed"``.
        checks: Its outputs held to their budgets against FP32 in ONNX Runtime.
        timing: What timing it measured (None where it was not timed).
        note: Why it was skipped, failed or not timed; how it was built.
        listed: Among the candidates the caller asked for (the input is always in the
            table, as the reference).
        verdict: ``"wins"``, ``"lost"``, ``"skipped"``, ``"failed"``, ``"inaccurate"`` or
            ``"reference"`` (filled by :func:`choose`).
        reason: Why it lost (filled by :func:`choose`).
        confirm: Its passes must be confirmed by the held-out rows (the 95% lower bound
            of each share meets its budget) to count as accurate: every candidate that
            changes the model's numbers beyond FP32 rounding (INT8, fp16, bf16).
        accepted: The caller accepts unconfirmed passes (``--accept-unconfirmed``).
    """

    name: str
    runtime: str
    hints: dict[str, str] = field(default_factory=dict)
    status: str = "timed"
    checks: tuple[OutputCheck, ...] = ()
    timing: Timing | None = None
    note: str = ""
    listed: bool = True
    verdict: str = ""
    reason: str = ""
    confirm: bool = True
    accepted: bool = False

    @property
    def ratio(self) -> float | None:
        """Latency as a ratio to the baseline, the input in ONNX Runtime (on the device
        asked for); 1 for the baseline itself."""
        if self.status == "baseline":
            return 1.0
        return None if self.timing is None else self.timing.ratio

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def unconfirmed(self) -> list[OutputCheck]:
        """The passes its held-out rows cannot confirm, where they must."""
        return [c for c in self.checks if c.passed and not c.confirmed] if self.confirm else []

    @property
    def accurate(self) -> bool:
        """Its checks pass, confirmed where they must be (or the caller accepts them)."""
        return self.passed and (self.accepted or not self.unconfirmed)

    def eligible(self) -> bool:
        """It may be chosen: listed, accurate, and timed (or the input). A pruned
        candidate is eligible too: whatever it was clearly slower than ranks before it."""
        if not self.listed or not self.accurate:
            return False
        return self.status == "baseline" or (self.status == "timed" and self.timing is not None)

    def to_dict(self) -> dict[str, object]:
        t = self.timing
        return {
            "name": self.name,
            "runtime": self.runtime,
            "hints": dict(self.hints),
            "status": self.status,
            "ratio": self.ratio,
            "ratio_interval": None if t is None or t.low is None else [t.low, t.high],
            "ms": None if t is None else t.ms,
            "faster_share": None if t is None else t.faster_share,
            "rounds": None if t is None else t.rounds,
            "pruned": None if t is None else t.pruned,
            "accurate": self.accurate if self.checks else None,
            "confirmed": not self.unconfirmed if self.checks else None,
            "accuracy": accuracy_text(self.checks),
            "checks": [c.to_dict() for c in self.checks],
            "verdict": self.verdict,
            "reason": self.reason,
            "note": self.note,
        }


def accuracy_text(checks: Sequence[OutputCheck]) -> str:
    """The worst check as ``top-1 1 on 'probs' (needs >= 0.99)``; empty without checks."""
    if not checks:
        return ""
    worst = min(checks, key=lambda c: c.slack())
    if worst.note:
        return f"a miss on {worst.output!r} ({worst.note})"
    side = worst.side
    label = worst.needs().split(f" {side} ")[0]
    got = shown(worst.value, worst.limit)
    return f"{label} {got} on {worst.output!r} (needs {side} {worst.limit:g})"


def _beats_input(row: Row) -> bool:
    """3% faster in the median, in most rounds, and surely: the 95% interval of its
    ratio lies under 1 (an identical session of the input measured 0.91x once)."""
    t = row.timing
    if row.status == "baseline" or t is None:
        return row.status == "baseline"
    sure = t.high is None or t.high < 1.0
    return t.ratio <= 1.0 - GAIN and t.faster_share >= MAJORITY and sure


def _ties(row: Row, best: Row) -> bool:
    """Within :data:`GAIN` of the best, or its interval overlaps the best's: a tie."""
    close = (row.ratio or 0.0) <= (best.ratio or 0.0) + GAIN
    if row.timing is None or best.timing is None:
        return close
    return close or row.timing.overlaps(best.timing)


@dataclass(frozen=True)
class HeadToHead:
    """The tie's two candidates timed beside each other: ``timing`` is ``later``'s
    ratio to ``earlier`` (each round pairs them), narrower than the difference of their
    two ratios to the input, each measured beside it at another time."""

    earlier: str
    later: str
    timing: Timing | None  # None: the time budget was spent before it

    @property
    def decides(self) -> bool:
        """``later`` is surely :data:`GAIN` faster: its median ratio to ``earlier`` at
        most ``1 - GAIN``, faster in most rounds, and the 95% interval under 1."""
        t = self.timing
        if t is None:
            return False
        sure = t.high is not None and t.high < 1.0
        return t.ratio <= 1.0 - GAIN and t.faster_share >= MAJORITY and sure

    def text(self) -> str:
        """``head to head: int8-openvino 0.97x [0.93-1.01] of fp32-openvino: a tie``."""
        if self.timing is None:
            return f"{self.later} and {self.earlier} not timed head to head: the budget was spent"
        said = f"{self.later} wins" if self.decides else f"a tie, {self.earlier} kept"
        return f"head to head: {self.later} {self.timing.shown} of {self.earlier}: {said}"

    def to_dict(self) -> dict[str, object]:
        t = self.timing
        return {
            "earlier": self.earlier,
            "later": self.later,
            "ratio": None if t is None else t.ratio,
            "ratio_interval": None if t is None or t.low is None else [t.low, t.high],
            "faster_share": None if t is None else t.faster_share,
            "rounds": None if t is None else t.rounds,
            "decides": self.decides,
        }


def _tied(rows: Sequence[Row], baseline: str) -> tuple[list[Row], Row | None]:
    """The candidates that may win and tie with the fastest one, in the table's order
    (the first is the winner), and the fastest one; ``[]`` and None where none may win."""
    pool = [r for r in rows if r.eligible()]
    if any(r.name == baseline and r.listed for r in rows):
        pool = [r for r in pool if _beats_input(r)]
    timed = [r for r in pool if r.ratio is not None]
    if not timed:
        return [], None
    best = min(timed, key=lambda r: r.ratio or 0.0)
    return [r for r in timed if _ties(r, best)], best


def _standings(rows: Sequence[Row], baseline: str) -> tuple[str, Row | None]:
    """The earliest candidate that ties with the fastest (the input where none may
    win), and the fastest one."""
    tied, best = _tied(rows, baseline)
    return (tied[0].name if tied else baseline), best


def contender(rows: Sequence[Row], baseline: str = BASELINE) -> tuple[str, str] | None:
    """The earlier winner and the fastest later candidate that tied with it, to be timed
    head to head: the fastest one overall where that is a later one, and also where
    the winner is the fastest in the median (each timed beside the input in 15 rounds,
    two candidates 4% apart swap places: PP-OCRv4 det's INT8 under the bf16 hint ran
    0.25x ORT FP32 against the hint's 0.24x in one run, 0.96x the hint head to head in
    another); None where no later candidate ties with the winner."""
    tied, _ = _tied(rows, baseline)
    if len(tied) < 2 or tied[0].name == baseline:
        return None
    return tied[0].name, min(tied[1:], key=lambda r: r.ratio or 0.0).name


def choose(
    rows: Sequence[Row], baseline: str = BASELINE, duel: HeadToHead | None = None
) -> tuple[str, list[Row]]:
    """The winner's name and the rows with their verdict and reason (``rows`` in the
    candidates' order, the row of ``baseline``, the input every other one was timed
    beside, among them); ``duel``: the :func:`contender` pair timed head to head."""
    listed_input = any(r.name == baseline and r.listed for r in rows)
    winner = _standings(rows, baseline)[0]
    if duel is not None and (duel.earlier, duel.later) != contender(rows, baseline):
        duel = None  # timed for another table
    if duel is not None and duel.decides:
        winner = duel.later
    by_name = {r.name: r for r in rows}
    done = []
    for r in rows:
        verdict, reason = _verdict(r, winner, by_name, listed_input, baseline)
        if duel is not None and verdict == "lost" and r.name in (duel.earlier, duel.later):
            reason = _duel_reason(r.name, duel)
        done.append(dataclasses.replace(r, verdict=verdict, reason=reason))
    return winner, done


def _duel_reason(name: str, duel: HeadToHead) -> str:
    """Why one of the pair timed head to head lost."""
    if duel.timing is None:
        return f"a tie with {duel.earlier}, not timed head to head (the budget was spent)"
    shown = duel.timing.shown
    if name == duel.earlier:  # the later one surely faster
        return f"slower than {duel.later} head to head ({duel.later} {shown} of it)"
    return f"a tie with {duel.earlier} head to head ({shown} of it): ties go to the earlier one"


def _verdict(
    row: Row, winner: str, rows: dict[str, Row], strict: bool, baseline: str
) -> tuple[str, str]:
    """The row's verdict and why it lost (to ``winner``); ``strict``: the input is a
    candidate, so the others must beat it."""
    if row.name == winner:
        return "wins", ""
    if row.status in ("skipped", "failed"):
        return row.status, row.note
    if row.checks and not row.passed:
        why = f"misses its budget: {accuracy_text(row.checks)}"
        return "inaccurate", why
    if row.checks and not row.accurate:
        weakest = least_confirmed(row.unconfirmed)
        return "inaccurate", f"unconfirmed: {weakest.to_confirm()} (--accept-unconfirmed)"
    if not row.listed:
        return "reference", "not among the candidates: timed against only"
    best = rows[winner]
    t = row.timing
    if row.status == "not timed" or (t is None and row.status != "baseline"):
        return "lost", row.note or "not timed"
    if t is not None and t.pruned:
        why = f"pruned after {t.rounds} rounds: clearly slower than the best so far"
        return "lost", why
    ratio, best_ratio = row.ratio or 1.0, best.ratio or 1.0
    if row.status == "baseline" or (winner != baseline and ratio >= best_ratio):
        return "lost", f"slower than {winner} ({best_ratio:.2f}x)"
    if strict and t is not None and t.ratio > 1.0 - GAIN:
        where = "in ONNX Runtime" if baseline == BASELINE else f"({baseline})"
        return "lost", f"not {GAIN:.0%} faster than the input {where}"
    if strict and t is not None and t.faster_share < MAJORITY:
        return "lost", f"faster in only {t.faster_share:.0%} of the rounds (needs {MAJORITY:.0%})"
    if strict and t is not None and t.high is not None and t.high >= 1.0:
        return "lost", f"its 95% interval reaches the input's speed ({t.shown})"
    shown = best.timing.shown if best.timing is not None else f"{best_ratio:.2f}x"
    return "lost", f"a tie with {winner} ({shown}): ties go to the earlier one"
