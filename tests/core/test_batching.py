"""runs_within: the byte-budget runs that calibration fetches, learned-rounding captures
and the weight statistics share."""

from mixprec.core.batching import runs_within


def test_runs_keep_order_stay_within_the_budget_and_the_count():
    sizes = {"a": 3, "b": 4, "c": 10, "d": 1, "e": 1, "f": 1}
    runs = runs_within(sizes, sizes.__getitem__, 7)
    assert runs == [["a", "b"], ["c"], ["d", "e", "f"]]  # "c" alone: larger than the budget
    assert runs_within(sizes, sizes.__getitem__, 7, count=2) == [
        ["a", "b"],
        ["c"],
        ["d", "e"],
        ["f"],
    ]
    assert runs_within([], len, 7) == []
