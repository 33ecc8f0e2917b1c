"""The bench's guard table (bench/int8/report.py ``guard_table``) reads the guard record a
real ``mixprec.quantize`` writes: rows graded, the 95% bound beside the budget, and
whether the rows confirm the pass."""

from __future__ import annotations

import mixprec
from bench.int8 import report as report_int8
from guard_models import separable_classifier, separable_samples


def test_the_guard_table_shows_rows_bound_and_budget() -> None:
    result = mixprec.quantize(separable_classifier(), separable_samples(10), speed="off")
    row = {"model": "tiny", "tool": "mixprec", "report": result.report.to_dict()}
    table = report_int8.guard_table([row]).splitlines()
    assert len(table) == 3, table  # the header, its rule, one check
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    # 5 of 10 one-row samples held out; all 5 rows agree: 5 / (5 + 1.645^2) = 0.649 < 0.99
    assert cells[:5] == ["tiny", "mixprec", "5", "5", "top1 'probs'"], cells
    assert cells[5:9] == ["1", "0.6489", ">= 0.99", "no"], cells
    assert report_int8.guard_table([{"model": "m", "tool": "ort-u8s8", "report": {}}]) == ""
