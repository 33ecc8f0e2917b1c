"""The guard's confidence bound: Wilson's one-sided lower bound of an agreement share and
the rows it takes to confirm a budget, against closed forms and a simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mixprec.checks.confidence import Z_ONE_SIDED, lower_bound, rows_to_confirm


def test_every_row_agreeing_has_the_closed_form_bound_and_row_count():
    # all n rows agree: the Wilson lower bound is n / (n + z^2)
    for rows in (1, 5, 32, 80, 320):
        assert lower_bound(1.0, rows) == pytest.approx(rows / (rows + Z_ONE_SIDED**2))
    # 32 rows (2 batches of 16) cannot tell 0.99 from 0.92; it takes ceil(z^2 * b / (1 - b))
    assert lower_bound(1.0, 32) < 0.93
    assert rows_to_confirm(1.0, 0.99) == math.ceil(Z_ONE_SIDED**2 * 0.99 / 0.01) == 268
    assert lower_bound(1.0, 268) >= 0.99 > lower_bound(1.0, 267)


def test_a_share_at_or_below_the_budget_is_never_confirmed():
    assert rows_to_confirm(0.99, 0.99) is None and rows_to_confirm(0.98, 0.99) is None
    assert lower_bound(0.5, 0) == 0.0 and lower_bound(float("nan"), 10) == 0.0
    needed = rows_to_confirm(0.995, 0.99)
    assert needed is not None and lower_bound(0.995, needed) >= 0.99
    assert lower_bound(0.995, needed - 1) < 0.99
    assert needed > rows_to_confirm(1.0, 0.99)  # a share nearer the budget needs more rows


def test_the_bound_covers_the_true_share_at_least_as_often_as_it_claims():
    """Binomial draws of 300 rows at a true agreement of 0.99: the bound sits at or below
    0.99 in >= 93% of them (95% nominal; Wilson's coverage dips a little at some n)."""
    rng = np.random.default_rng(0)
    for true, rows in ((0.99, 300), (0.95, 80), (0.9, 40)):
        hits = rng.binomial(rows, true, size=4000)
        covered = np.mean([lower_bound(k / rows, rows) <= true for k in hits])
        assert covered >= 0.93, (true, rows, covered)
