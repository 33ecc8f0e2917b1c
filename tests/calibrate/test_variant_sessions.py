""":class:`mixprec.calibrate.probes.VariantRunner` keeps its sessions (one per output set)
within a budget of weight bytes: each session holds the model's weights on its own, so a
model over half the budget keeps one session at a time, and its outputs are unchanged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from mixprec.calibrate import probes
from mixprec.calibrate.probes import VariantRunner
from text_models import filled_model

TEXT = """<ir_version: 8, opset_import: ["" : 17]>
g (float[1, 64] x) => (float[1, 64] y) <float[64, 64] w1, float[64, 64] w2>
{ h = MatMul(x, w1)
  r = Relu(h)
  y = MatMul(r, w2) }"""


def _outputs(*names: str) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names]


@pytest.mark.parametrize(("budget", "kept"), [(1 << 30, 2), (20_000, 1)])
def test_sessions_are_kept_within_the_weight_budget(
    monkeypatch: pytest.MonkeyPatch, budget: int, kept: int
) -> None:
    """32 KB of weights: a 1 GiB budget keeps both output sets' sessions, a 20 KB one
    keeps one (the older is dropped before the next is built); the values are the same."""
    monkeypatch.setattr(probes, "_KEPT_BYTES", budget)
    model = filled_model(TEXT)
    runner = VariantRunner(model, threads=1)
    x = {"x": np.linspace(-1, 1, 64, dtype=np.float32)[None]}
    first = runner.run(_outputs("h", "y"), x)
    second = runner.run(_outputs("r"), x)
    again = runner.run(_outputs("h", "y"), x)
    assert len(runner._sessions) == kept
    np.testing.assert_array_equal(first["y"], again["y"])
    np.testing.assert_array_equal(np.maximum(first["h"], 0), second["r"])
    runner.close()
