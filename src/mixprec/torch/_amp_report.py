"""What ``mixprec.torch.autocast`` ran in which precision: calls per op and per module,
with the list and the rule that decided, printed as tables and saved as JSON."""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixprec.io.models import write_text

__all__ = ["AmpReport", "CallKey"]


@dataclass(frozen=True)
class CallKey:
    """One kind of call: the op type, the torch function, the innermost module running
    (its qualified name, "" outside any or without ``module=``), the dtype of its first
    output, its list and the rule that decided."""

    op: str
    function: str
    module: str
    dtype: str
    list: str
    rule: str


@dataclass
class AmpReport:
    """Calls counted by :class:`CallKey` since the autocast object was made."""

    target: str
    #: (op, function, module, dtype, list, rule) -> calls: plain tuples, cheap to count
    counts: Counter[tuple[str, str, str, str, str, str]] = field(default_factory=Counter)
    excluded: list[str] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=dict)

    @property
    def calls(self) -> Counter[CallKey]:
        """The counts by :class:`CallKey`."""
        return Counter({CallKey(*key): n for key, n in self.counts.items()})

    def by_op(self) -> dict[tuple[str, str, str], Counter[str]]:
        """(op, list, rule) -> calls per dtype."""
        table: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
        for key, n in self.calls.items():
            table[(key.op, key.list, key.rule)][key.dtype] += n
        return dict(table)

    def by_module(self) -> dict[str, Counter[str]]:
        """Module -> calls per dtype."""
        table: dict[str, Counter[str]] = defaultdict(Counter)
        for key, n in self.calls.items():
            table[key.module][key.dtype] += n
        return dict(table)

    def dtype_counts(self) -> Counter[str]:
        """All calls per dtype."""
        total: Counter[str] = Counter()
        for key, n in self.calls.items():
            total[key.dtype] += n
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "calls": [
                {**key.__dict__, "count": n}
                for key, n in sorted(self.calls.items(), key=lambda kv: (kv[0].op, kv[0].module))
            ],
            "by_op": [
                {"op": op, "list": lst, "rule": rule, "dtypes": dict(c)}
                for (op, lst, rule), c in sorted(self.by_op().items())
            ],
            "by_module": {m or "(top)": dict(c) for m, c in sorted(self.by_module().items())},
            "excluded": list(self.excluded),
            "policy": self.policy,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON (atomically)."""
        write_text(path, json.dumps(self.to_dict(), indent=1))

    def format_table(self) -> str:
        """Per op (list, rule, calls per dtype), then per module, then the exclusions."""
        dtypes = sorted(self.dtype_counts())
        rows = [("op", "list", "rule", *dtypes)]
        for (op, lst, rule), c in sorted(self.by_op().items()):
            rows.append((op, lst, rule, *(str(c.get(d, 0)) for d in dtypes)))
        lines = _aligned(rows)
        mods = [("module", *dtypes)]
        for name, c in sorted(self.by_module().items()):
            mods.append((name or "(top)", *(str(c.get(d, 0)) for d in dtypes)))
        lines += ["", *_aligned(mods)]
        if self.excluded:
            lines += ["", f"excluded (float32): {', '.join(self.excluded)}"]
        return "\n".join(lines)

    def write_log_dir(self, folder: str | os.PathLike[str]) -> list[Path]:
        """``amp_report.json`` and ``amp_report.txt`` in ``folder``."""
        where = Path(folder)
        where.mkdir(parents=True, exist_ok=True)
        self.save(where / "amp_report.json")
        write_text(where / "amp_report.txt", self.format_table() + "\n")
        return [where / "amp_report.json", where / "amp_report.txt"]


def _aligned(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
