"""Compare mixprec's rows of two bench runs: validity, casts, errors, MAC shares.

    python -m bench.harness.compare BEFORE.json AFTER.json

A refactor must leave these equal; latencies are not compared (they are noisy). The INT8
speed plan's placement depends on timings measured on the machine (``--speed auto``), so
an INT8 row whose placement (kept float / which nodes) differs is listed apart with both
placements: its error and MAC share follow the placement, not the code. Exit 1 when a
row that is not timing-dependent differs.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

FP_FIELDS = ("valid", "status", "worst_rel_l2", "max_abs_err", "top1_agreement")
FP_REPORT = ("casts_inserted", "casts_after", "param_bytes_after")
INT8_FIELDS = (
    "valid", "status", "worst_rel_l2", "max_abs_err", "agreement", "min_cosine",
    "integer_mac_share", "top1_agreement",
)  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def _placement(row: dict[str, Any]) -> Any:
    q = (row.get("report") or {}).get("quantization") or {}
    speed = q.get("speed") or {}
    return speed.get("chosen", speed.get("summary"))


def _fp_rows(data: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    rows = {}
    for r in data.get("rows", []):
        if str(r.get("converter", "")).startswith("mixprec"):
            fields = {k: r.get(k) for k in FP_FIELDS}
            fields.update({k: (r.get("report") or {}).get(k) for k in FP_REPORT})
            fields["low_mac_share"] = (r.get("stats") or {}).get("low_mac_share")
            rows[(r["model"], r["converter"], r["dtype"])] = fields
    return rows


def _int8_rows(data: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    rows = {}
    for r in (data.get("int8") or {}).get("rows", []):
        if str(r.get("tool", "")).startswith("mixprec"):
            fields = {k: r.get(k) for k in INT8_FIELDS}
            fields["placement"] = _placement(r)
            rows[(r["model"], r["tool"], "int8")] = fields
    return rows


def compare(before: dict[str, Any], after: dict[str, Any]) -> tuple[list[str], list[str], int]:
    """(differences, timing-dependent differences, rows compared)."""
    diffs, timing = [], []
    pairs = [(_fp_rows(before), _fp_rows(after)), (_int8_rows(before), _int8_rows(after))]
    count = 0
    for old_rows, new_rows in pairs:
        for key in sorted(set(old_rows) | set(new_rows)):
            old, new = old_rows.get(key), new_rows.get(key)
            if old is None or new is None:
                diffs.append(f"{' '.join(key)}: only in {'after' if old is None else 'before'}")
                continue
            count += 1
            changed = [f"{k} {old[k]!r} -> {new[k]!r}" for k in old if not _same(old[k], new[k])]
            if not changed:
                continue
            line = f"{' '.join(key)}: " + "; ".join(changed)
            (
                timing if "placement" in old and old["placement"] != new["placement"] else diffs
            ).append(line)
    return diffs, timing, count


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        before = json.load(f)
    with open(argv[1]) as f:
        after = json.load(f)
    diffs, timing, count = compare(before, after)
    for line in diffs:
        print("DIFF", line)
    for line in timing:
        print("TIMING (speed plan chose another placement)", line)
    print(f"compared {count} mixprec rows: {len(diffs)} differ, {len(timing)} differ only "
          "where the timed speed plan chose another placement")  # fmt: skip
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
