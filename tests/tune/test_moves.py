"""The drivers every repair search shares (mixprec.tune.moves): growing prefixes, then
narrowing, on a stand-in grader that keeps what it graded."""

from __future__ import annotations

import pytest

from mixprec.tune.moves import Move, climb, halving, halvings, midpoint, narrow, shares


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
    grade = Grader(3)
    assert narrow(grade, 0, 16, halvings(2)) == (0, 4)
    assert grade.graded == [8, 4]


def test_a_step_outside_the_bracket_grades_nothing() -> None:
    grade = Grader(0)
    assert narrow(grade, 3, 9, lambda lo, hi: hi) == (3, 9)
    assert narrow(grade, 3, 4, halving) == (3, 4)
    assert grade.graded == []


class Search:
    """A stand-in search: ``n`` moves, passing from ``first_passing`` on."""

    def __init__(self, n: int, first_passing: int) -> None:
        self.moves = [Move(f"m{i}", "float", float(n - i), 1.0) for i in range(n)]
        self.grade = Grader(first_passing)


def test_climb_grades_growing_prefixes_then_narrows_from_the_last_failing_one() -> None:
    search = Search(16, first_passing=5)
    assert climb(search, [2, 4, 8, 16], halving) == 5
    # 2 and 4 fail, 8 passes: the bracket (4, 8) is halved to 6, then 5
    assert search.grade.graded == [2, 4, 8, 6, 5]


def test_climb_says_none_when_no_prefix_passes() -> None:
    search = Search(4, first_passing=9)
    assert climb(search, [1, 2, 4], halving) is None
    assert search.grade.graded == [1, 2, 4]


def test_the_first_passing_count_is_narrowed_from_nothing_moved() -> None:
    search = Search(8, first_passing=1)
    assert climb(search, [4, 8], halving) == 1
    assert search.grade.graded == [4, 2, 1]


def test_shares_of_a_cost_axis_and_its_midpoint() -> None:
    # one heavy move among light ones: halving the cost lands on it, not the middle count
    axis = shares([1.0, 1.0, 96.0, 1.0, 1.0], total=200.0)
    assert axis == pytest.approx([0.0, 0.005, 0.01, 0.49, 0.495, 0.5])
    assert midpoint(axis, 0, 5) == 3
    assert shares([0.0, 0.0]) == [0.0, 0.0, 0.0]  # nothing at stake: no division by zero
    assert midpoint(shares([1.0] * 8), 0, 8) == 4
