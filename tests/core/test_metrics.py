"""Tests of mixprec.core.metrics: output comparison."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mixprec.core.metrics import OutputComparison, compare_outputs


def test_compare_outputs_thresholds_and_top1() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 10)).astype(np.float32)
    noise = rng.standard_normal(ref.shape)
    noise *= 0.005 * np.linalg.norm(ref) / np.linalg.norm(noise)  # rel L2 error 0.005
    out = (ref + noise).astype(np.float32)

    (loose,) = compare_outputs({"logits": ref}, {"logits": out}, rtol=1e-2, atol=0.0)
    (tight,) = compare_outputs({"logits": ref}, {"logits": out}, rtol=1e-3, atol=0.0)
    assert loose.rel_l2_error == pytest.approx(0.005, rel=1e-3), loose
    assert loose.passed and not tight.passed, (loose, tight)
    assert loose.max_abs_error == pytest.approx(float(np.abs(out - ref).max()), rel=1e-6)
    assert loose.ref_abs_max == pytest.approx(float(np.abs(ref).max()))

    swapped = ref.copy()
    row = swapped[0]
    i, j = int(np.argmax(row)), int(np.argmin(row))
    row[i], row[j] = row[j], row[i]
    (cmp,) = compare_outputs({"logits": ref}, {"logits": swapped}, rtol=1e-2)
    assert cmp.top1_agreement == pytest.approx(7 / 8), cmp
    assert not cmp.passed, cmp  # a large error; top-1 itself never decides
    (spatial,) = compare_outputs({"f": np.ones((1, 2, 3, 4))}, {"f": np.ones((1, 2, 3, 4))}, rtol=0)
    assert spatial.top1_agreement is None and spatial.passed, spatial


def test_compare_outputs_edge_cases() -> None:
    near_zero = np.full(4, 1e-6, np.float32)
    (cmp,) = compare_outputs({"y": near_zero}, {"y": near_zero * 3}, rtol=1e-2, atol=1e-3)
    assert cmp.passed and cmp.rel_l2_error == pytest.approx(2.0), cmp  # atol branch

    bad = np.array([1.0, np.inf], np.float32)
    (cmp,) = compare_outputs({"y": np.ones(2, np.float32)}, {"y": bad}, rtol=1.0, atol=1.0)
    assert not cmp.passed and "non-finite" in cmp.note, cmp

    (cmp,) = compare_outputs({"y": np.ones(3)}, {"y": np.ones(4)}, rtol=1.0)
    assert not cmp.passed and "shape" in cmp.note, cmp

    ids = np.array([1, 2, 3], np.int64)
    same, diff = compare_outputs(
        {"a": ids, "b": ids}, {"a": ids.copy(), "b": ids + 1}, rtol=1.0, atol=1.0
    )
    assert same.passed and same.rel_l2_error == 0.0, same
    assert not diff.passed and diff.rel_l2_error == 1.0, diff

    (missing,) = compare_outputs({"y": ids}, {}, rtol=1.0)
    assert not missing.passed and "missing" in missing.note
    assert missing.to_dict()["max_abs_error"] == "inf"
    assert set(OutputComparison("n", 0, 0, 0, None, True).to_dict()) == {
        "name",
        "max_abs_error",
        "rel_l2_error",
        "ref_abs_max",
        "top1_agreement",
        "passed",
        "note",
    }


def test_the_output_checks_have_one_home():
    """validate (compare_outputs), tune's metrics and the INT8 guard read these."""
    from mixprec.checks import outputs as guard
    from mixprec.core.metrics import (
        cosine_similarity,
        equal_share,
        max_abs_error,
        rel_l2_error,
        top1_agreement,
        worst_rel_l2,
    )
    from mixprec.tune import metrics

    ref = np.array([[1.0, 2.0, np.nan], [3.0, 0.0, 1.0]], np.float32)
    out = ref * 1.01
    assert rel_l2_error(ref, out) == pytest.approx(0.01, rel=1e-4)  # nan position skipped
    assert rel_l2_error(ref, np.where(np.isnan(ref), 0, np.inf)) == np.inf
    assert max_abs_error(ref, out) == pytest.approx(0.03, rel=1e-4)
    scores = np.zeros((2, 3, 2), np.float32)
    scores[:, 1] = 1.0
    flipped = scores.copy()
    flipped[0, :, 0] = [0, 0, 1]
    assert top1_agreement(scores, flipped, axis=1) == pytest.approx(3 / 4)
    assert cosine_similarity([1.0, 0.0], [0.0, 1.0]) == pytest.approx(0.0)
    assert cosine_similarity([1.0, 2.0], [np.nan, 1.0]) == -1.0
    assert equal_share(np.arange(4), np.array([0, 1, 2, 0])) == 0.75
    # the tuner's and the guard's measures are these, not copies
    assert metrics.rel_l2([{"y": ref}], [{"y": out}]) == rel_l2_error(ref, out)
    assert guard.worst_rel_l2 is worst_rel_l2 and guard.top1_agreement is top1_agreement


def test_rel_l2_has_one_value_wherever_it_is_read():
    """Before: validate (compare_outputs) measured over the positions where both were
    finite, the guard and tune (rel_l2_error) gave inf for an output not finite where
    FP32 is, and tune pooled its samples into one norm where the guard took the worst."""
    from mixprec.checks import outputs as guard
    from mixprec.core.metrics import rel_l2_error, worst_rel_l2
    from mixprec.tune import metrics

    ref = np.array([3.0, 4.0, np.nan, 1.0], np.float32)
    broken = np.array([3.0, 4.0, 7.0, np.inf], np.float32)  # inf where FP32 is finite
    (validated,) = compare_outputs({"y": ref}, {"y": broken}, rtol=1.0, atol=0.0)
    assert validated.rel_l2_error == math.inf == rel_l2_error(ref, broken), validated
    assert not validated.passed and "1 non-finite value(s)" in validated.note
    close = np.array([3.0, 4.5, 0.0, 1.0], np.float32)  # the NaN position is not compared
    (validated,) = compare_outputs({"y": ref}, {"y": close}, rtol=1.0, atol=0.0)
    want = 0.5 / math.sqrt(26.0)
    assert validated.rel_l2_error == pytest.approx(want, rel=1e-12) == rel_l2_error(ref, close)
    # two samples: 0.1 on the first, 0.01 on the second (pooled: 0.014); every reader
    # takes the worst sample
    refs = [np.array([3.0, 4.0]), np.array([30.0, 40.0])]
    outs = [np.array([3.0, 4.5]), np.array([30.0, 40.5])]
    assert worst_rel_l2(refs, outs) == pytest.approx(0.1)
    samples = [{"y": r} for r in refs], [{"y": o} for o in outs]
    assert metrics.rel_l2(*samples) == pytest.approx(0.1)
    checks = guard.check_outputs(*samples, {"y": "rel-l2"}, guard.GuardBudget.of(None, 0.05))
    assert checks[0].value == pytest.approx(0.1) and not checks[0].passed, checks
