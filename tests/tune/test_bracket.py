"""The narrowing every repair search shares (mixprec.tune.bracket)."""

from __future__ import annotations

import pytest

from mixprec.tune.bracket import halving, narrow


class Grader:
    """Passes every prefix of at least ``first_passing`` moves; keeps what it graded."""

    def __init__(self, first_passing: int) -> None:
        self.first_passing = first_passing
        self.graded: list[int] = []

    def __call__(self, k: int) -> bool:
        self.graded.append(k)
        return k >= self.first_passing


@pytest.mark.parametrize("first_passing", [1, 2, 7, 13, 20])
def test_halving_finds_the_shortest_passing_prefix(first_passing: int) -> None:
    grade = Grader(first_passing)
    assert narrow(grade, 0, 20, halving) == (first_passing - 1, first_passing)
    assert len(grade.graded) == len(set(grade.graded)) <= 5  # ceil(log2 20), none twice
    assert all(0 < k < 20 for k in grade.graded)


def test_a_step_that_says_done_stops_the_search() -> None:
    rounds = iter(range(2))

    def two_rounds(lo: int, hi: int) -> int | None:
        return halving(lo, hi) if next(rounds, None) is not None else None

    grade = Grader(3)
    assert narrow(grade, 0, 16, two_rounds) == (0, 4)
    assert grade.graded == [8, 4]


def test_a_step_outside_the_bracket_grades_nothing() -> None:
    grade = Grader(0)
    assert narrow(grade, 3, 9, lambda lo, hi: hi) == (3, 9)
    assert narrow(grade, 3, 4, halving) == (3, 4)
    assert grade.graded == []
