"""AWQ's scaled weights (:mod:`mixprec.weights.scaled`): made when read, and a large one read
a slice of columns at a time with the very values the whole scaled weight holds."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from mixprec.weights import scaled
from mixprec.weights.blocks import BlockSpec, quantize_rtn
from mixprec.weights.slices import column_slices, quantize_in_slices

RNG = np.random.default_rng(45)


def _value(stored: np.ndarray) -> ir.Value:
    value = ir.Value(name="w")
    value.const_value = ir.tensor(stored, name="w")
    return value


@pytest.mark.parametrize("transposed", [False, True])
def test_a_large_scaled_weight_reads_by_slices_the_values_of_the_whole(
    monkeypatch: pytest.MonkeyPatch, transposed: bool
) -> None:
    stored = RNG.standard_normal((48, 40)).astype(np.float32)
    rows = RNG.uniform(0.5, 2.0, 48).astype(np.float32)
    cols = RNG.uniform(0.5, 2.0, 40).astype(np.float32)
    value = _value(stored)
    scaled.rescale(value, rows[:, None])  # AWQ's rows, then a later group's columns
    scaled.rescale(value, cols[None, :], divide=True)
    want = (stored * rows[:, None]) / cols[None, :]
    assert value.const_value is not None
    np.testing.assert_array_equal(value.const_value.numpy(), want)  # what a save writes
    monkeypatch.setattr(scaled, "WHOLE_BYTES", 1000)
    lazy = scaled.scaled_matrix(value, transposed)
    assert isinstance(lazy, scaled.ScaledArray)
    matmul = want.T if transposed else want
    assert lazy.shape == matmul.shape and lazy.nbytes == matmul.nbytes
    for part in column_slices(*lazy.shape, max_bytes=4 * lazy.shape[0] * 7):
        np.testing.assert_array_equal(lazy[:, part], matmul[:, part])
    np.testing.assert_array_equal(np.asarray(lazy), matmul)
    spec = BlockSpec(4, 16, symmetric=False)
    whole, sliced = (
        quantize_rtn(matmul, spec),
        quantize_in_slices(lambda w: quantize_rtn(w, spec), lazy, max_bytes=4 * lazy.shape[0] * 7),
    )
    np.testing.assert_array_equal(sliced.codes, whole.codes)


def test_a_small_scaled_weight_is_a_plain_array_and_a_replaced_one_is_not_scaled() -> None:
    stored = RNG.standard_normal((8, 6)).astype(np.float32)
    value = _value(stored)
    assert scaled.scaled_matrix(value, False) is None
    factor = np.full((8, 1), 2.0, np.float32)
    scaled.rescale(value, factor)
    small = scaled.scaled_matrix(value, False)
    assert isinstance(small, np.ndarray)
    np.testing.assert_array_equal(small, stored * 2.0)
    value.const_value = ir.tensor(stored, name="w")  # another pass replaced it
    assert scaled.scaled_matrix(value, False) is None
