"""``python -m tests.fuzz``: a fuzz campaign, or one case again.

Examples (from the repository root)::

    .venv/bin/python -m tests.fuzz --cases 2000 --seed 1000       # a campaign (make fuzz)
    .venv/bin/python -m tests.fuzz --mutation truncate --seed 3    # one case, in detail
    .venv/bin/python -m tests.fuzz --mutation truncate --seed 3 --keep /tmp/mixprec-fuzz
    .venv/bin/python -m tests.fuzz --list                          # the mutations

Exit status: 0 when every defect found is a known one (``known_defects.py``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from . import mutators
from .campaign import Result, emit_known, plan, run_case, summarize
from .driver import Case, command_line

SUBPROCESS_EVERY = 20  # one case in this many runs through `python -m mixprec`


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--cases", type=int, default=None, help="number of cases (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--mutation", help="only this mutation (NAME, or NAME+NAME for a sequence)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    p.add_argument(
        "--subprocess-every",
        type=int,
        default=SUBPROCESS_EVERY,
        help="run every Nth case through `python -m mixprec` (0: never)",
    )
    p.add_argument("--subprocess", action="store_true", help="run every case as a subprocess")
    p.add_argument("--keep", metavar="DIR", help="keep each case's folder under DIR")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument(
        "--emit-known", action="store_true", help="print known_defects.KNOWN entries for defects"
    )
    return p


def _one(case: Case, args: argparse.Namespace) -> int:
    keep = Path(args.keep) if args.keep else None
    result = run_case(
        case, keep, timeout=args.timeout, subprocess_mode=args.subprocess, keep=keep is not None
    )
    print(result.report())
    if keep is not None:
        folder = max(keep.glob("case-*"), key=os.path.getmtime)
        print(f"  files kept in {folder}; the command:\n  {command_line(result.mat, folder)}")
    print("--- stdout\n" + result.obs.stdout.rstrip())
    print("--- stderr\n" + result.obs.stderr.rstrip())
    return 1 if result.outcome.is_defect else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for m in mutators.MUTATIONS:
            print(
                f"{m.name:24s} {m.group:14s} {(m.model or m.data).__doc__ or ''}".rstrip().split(
                    "\n"
                )[0]
            )
        return 0
    for var in [v for v in os.environ if v.startswith("MIXPREC_")]:
        del os.environ[var]
    names = args.mutation.split("+") if args.mutation else None
    if names is not None:
        for name in names:
            mutators.by_name(name)
    if args.mutation and args.cases is None:
        return _one(Case(tuple(names or ()), args.seed), args)
    cases = (
        [Case(tuple(names), args.seed + i) for i in range(args.cases)]
        if names is not None
        else plan(args.cases or 1000, args.seed)
    )
    results: list[Result] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mixprec-fuzz-") as tmp:
        for i, case in enumerate(cases):
            sub = args.subprocess or (args.subprocess_every and i % args.subprocess_every == 0)
            r = run_case(case, Path(tmp), timeout=args.timeout, subprocess_mode=bool(sub))
            results.append(r)
            if args.verbose or (r.outcome.is_defect and r.known is None):
                print(
                    f"[{i + 1}/{len(cases)}] {r.case}{' (subprocess)' if sub else ''}: {r.outcome}",
                    flush=True,
                )
            elif (i + 1) % 100 == 0:
                print(f"[{i + 1}/{len(cases)}] {time.monotonic() - start:.0f} s", flush=True)
    summarize(results)
    if args.emit_known:
        print()
        emit_known(results)
    print(f"\n{len(results)} cases in {time.monotonic() - start:.0f} s")
    new = [r for r in results if r.outcome.is_defect and r.known is None]
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
