"""Run many cases and summarise them: counts per mutation and outcome, defects by cause."""

from __future__ import annotations

import collections
import dataclasses
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from . import mutators
from .classify import CLEAN_ERROR, DEFECT, SUCCESS, Outcome, classify, first_stderr_line
from .driver import Case, Materialized, Observation, materialize, observe
from .known_defects import KnownDefect, known_for, matches_known

__all__ = ["Result", "cause_key", "emit_known", "plan", "run_case", "summarize"]


@dataclasses.dataclass
class Result:
    case: Case
    mat: Materialized
    obs: Observation
    outcome: Outcome

    @property
    def known(self) -> KnownDefect | None:
        """The known-defect entry of this case, when the outcome is the recorded one."""
        entry = known_for(self.case.name, self.case.seed)
        if entry is not None and entry.matches(self.outcome.kind, self.outcome.detail):
            return entry
        return None

    def report(self) -> str:
        """Several lines: the case, what it ran, the outcome, stderr, how to reproduce it."""
        lines = [
            f"{self.case}: {self.outcome}",
            f"  {self.mat.describe()}",
            f"  exit {self.obs.rc}, {self.obs.seconds:.2f} s, first stderr line: "
            f"{first_stderr_line(self.obs)}",
            f"  reproduce: {self.case.repro()}",
        ]
        return "\n".join(lines)


def run_case(
    case: Case,
    workdir: Path | None = None,
    *,
    timeout: float = 60.0,
    subprocess_mode: bool = False,
    keep: bool = False,
) -> Result:
    """Materialize, run and classify ``case`` (in a temporary folder unless ``workdir``)."""
    mat = materialize(case)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="mixprec-fuzz-") as tmp:
            obs = observe(mat, Path(tmp), timeout=timeout, subprocess_mode=subprocess_mode)
    else:
        workdir.mkdir(parents=True, exist_ok=True)
        obs = observe(mat, workdir, timeout=timeout, subprocess_mode=subprocess_mode, keep=keep)
    return Result(case, mat, obs, classify(obs))


def plan(n: int, seed: int, names: Iterable[str] | None = None) -> list[Case]:
    """``n`` cases, round robin over the mutations (all, or ``names``), seeds from ``seed``."""
    names = list(names or [m.name for m in mutators.MUTATIONS])
    return [Case((names[i % len(names)],), seed + i // len(names)) for i in range(n)]


def cause_key(outcome: Outcome) -> str:
    """The defect's kind and detail with names and numbers blanked: one key per cause."""
    detail = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", outcome.detail)
    detail = re.sub(r"/[^\s:,)]+", "PATH", detail)
    detail = re.sub(r"\d+", "N", detail)
    return f"{outcome.kind}: {detail[:160]}"


def summarize(results: list[Result], say: Callable[[str], None] = print) -> None:
    """Print counts per mutation group, per mutation and outcome, then defects by cause."""
    groups = {m.name: m.group for m in mutators.MUTATIONS}
    by_mut: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_group: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in results:
        group = groups.get(r.case.mutations[0], "?") if len(r.case.mutations) == 1 else "mixed"
        by_mut[r.case.name][r.outcome.cls] += 1
        by_group[group][r.outcome.cls] += 1
    cols = (SUCCESS, CLEAN_ERROR, DEFECT)

    def table(title: str, rows: dict[str, collections.Counter[str]]) -> None:
        say(f"\n{title:28s} {'cases':>6s} {cols[0]:>14s} {cols[1]:>12s} {cols[2]:>7s}")
        total: collections.Counter[str] = collections.Counter()
        for key, counts in [*rows.items(), ("total", total)]:
            if key != "total":
                total.update(counts)
            a, b, c = (counts[col] for col in cols)
            say(f"{key:28s} {sum(counts.values()):6d} {a:14d} {b:12d} {c:7d}")

    table("mutation group", by_group)
    table("mutation", by_mut)
    defects = [r for r in results if r.outcome.is_defect]
    causes: dict[str, list[Result]] = collections.defaultdict(list)
    for r in defects:
        causes[cause_key(r.outcome)].append(r)
    kinds = collections.Counter(r.outcome.kind for r in defects)
    say(f"\ndefects: {len(defects)} in {len(causes)} causes; by kind: {dict(kinds)}")
    for key, rs in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        first = rs[0]
        known = matches_known(first.outcome.kind, first.outcome.detail)
        tag = f" [known cause: {known}]" if known else " [NEW]"
        muts = collections.Counter(r.case.name for r in rs)
        say(f"\n- {key} ({len(rs)} cases: {dict(muts)}){tag}")
        for r in rs[:3]:
            say(
                f"    {r.case} ({r.mat.seed_model} opset {r.mat.opset} {r.mat.dtype or 'default'})"
                f": {first_stderr_line(r.obs)}"
            )
            say(f"      {r.case.repro()}")


def emit_known(results: list[Result], say: Callable[[str], None] = print) -> None:
    """Print ``KNOWN`` entries (Python) for the defects found, with the cause that matches."""
    for r in results:
        if r.outcome.is_defect:
            cause = matches_known(r.outcome.kind, r.outcome.detail) or "?"
            say(f'    K("{r.case.name}", {r.case.seed}, "{cause}"),  # {cause_key(r.outcome)[:60]}')
    unmatched = {
        cause_key(r.outcome)
        for r in results
        if r.outcome.is_defect and matches_known(r.outcome.kind, r.outcome.detail) is None
    }
    for key in sorted(unmatched):
        say(f"# no cause matches: {key}")
