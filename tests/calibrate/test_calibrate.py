"""Tests of mixprec.calibrate.runner and .observers: range calibration over samples."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from mixprec.calibrate.runner import collect_absmax
from mixprec.core.errors import MixprecError
from proto_builders import (
    F32,
    _const,
    _model,
    _tensor,
    _vi,
)


def _range_model() -> onnx.ModelProto:
    """x*1000 -> Exp (overflows), Tanh; an If whose then-branch holds a Constant."""
    then_branch = helper.make_graph(
        [
            _const("branch_k", np.array([-7.5, 2.0], np.float32)),
            helper.make_node("Mul", ["t", "branch_k"], ["then_out"]),
        ],
        "then",
        [],
        [_vi("then_out", F32, [2])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["t"], ["else_out"])], "else", [], [_vi("else_out", F32, [2])]
    )
    nodes = [
        helper.make_node("Mul", ["x", "k1000"], ["scaled"]),
        helper.make_node("Exp", ["scaled"], ["expd"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node(
            "If", ["cond"], ["branch"], then_branch=then_branch, else_branch=else_branch
        ),
        helper.make_node("Add", ["branch", "expd"], ["y"]),
    ]
    return _model(
        nodes,
        [_vi("x", F32, [2]), _vi("cond", TensorProto.BOOL, [])],
        [_vi("y", F32, [2])],
        [_tensor("k1000", np.array(1000.0, np.float32))],
    )


@pytest.mark.parametrize("chunk_size", [1, 2000])
def test_collect_absmax_exact_values(chunk_size: int) -> None:
    model = _range_model()
    before = model.SerializeToString()
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(True)}
    absmax = collect_absmax(model, feeds, chunk_size=chunk_size, threads=1)
    assert model.SerializeToString() == before, "the input model was mutated"
    want = {
        "x": 0.5,
        "k1000": 1000.0,
        "scaled": 500.0,
        "expd": math.inf,
        "t": float(np.tanh(np.float32(500.0))),
        "branch_k": 7.5,
        "branch": float(np.tanh(np.float32(500.0))) * 7.5,
        "y": math.inf,
    }
    assert set(absmax) == set(want), f"got keys {sorted(absmax)}, want {sorted(want)}"
    for name, value in want.items():
        assert absmax[name] == pytest.approx(value, rel=1e-6), (name, absmax[name], value)


def test_collect_absmax_nan_is_ignored_inf_is_recorded() -> None:
    model = _model(
        [
            helper.make_node("Sqrt", ["x"], ["root"]),
            helper.make_node("Reciprocal", ["x"], ["recip"]),
            helper.make_node("Add", ["root", "recip"], ["y"]),
        ],
        [_vi("x", F32, [3])],
        [_vi("y", F32, [3])],
    )
    feeds = {"x": np.array([-1.0, 4.0, 0.0], np.float32)}
    absmax = collect_absmax(model, feeds)
    assert absmax["root"] == 2.0, absmax  # sqrt(-1) is nan: ignored
    assert absmax["recip"] == math.inf, absmax


def test_collect_absmax_raises_when_the_model_cannot_run() -> None:
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Relu", ["s"], ["y"])],
        [_vi("a", F32, ["N"]), _vi("b", F32, ["M"])],
        [_vi("y", F32, [None])],
    )
    feeds = {"a": np.ones(3, np.float32), "b": np.ones(4, np.float32)}  # cannot broadcast
    with pytest.raises(MixprecError, match=r"^onnxruntime failed to run the model"):
        collect_absmax(model, feeds)


def test_collect_absmax_bisects_failing_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor ORT refuses to expose is skipped with a warning; the others are kept."""
    from mixprec.calibrate.probes import ProbeSession, VariantRunner

    real_run = VariantRunner.run

    def run(self: VariantRunner, outputs: Sequence[onnx.ValueInfoProto], feeds: dict) -> dict:
        if any(vi.name == "t" for vi in outputs):
            raise MixprecError("onnxruntime failed to run the model: refused")
        return real_run(self, outputs, feeds)

    monkeypatch.setattr(VariantRunner, "run", run)
    # Force the fetch-in-chunks fallback (used when the in-graph reduction cannot run).
    monkeypatch.setattr(ProbeSession, "create", classmethod(lambda cls, *a, **k: None))
    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    with caplog.at_level("WARNING", logger="mixprec.calibrate.runner"):
        absmax = collect_absmax(_range_model(), feeds)
    assert "t" not in absmax, absmax
    assert absmax["scaled"] == 500.0 and absmax["branch"] == pytest.approx(np.tanh(500.0)), absmax
    assert "skipped 1 tensor(s) ('t')" in caplog.text, caplog.text


def test_collect_absmax_in_graph_matches_fetching(monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-graph ReduceMax(Abs) path gives the same ranges and shapes as fetching."""
    from mixprec.calibrate.probes import ProbeSession

    feeds = {"x": np.array([0.25, -0.5], np.float32), "cond": np.array(False)}
    shapes_fast: dict[str, list[int]] = {}
    fast = collect_absmax(_range_model(), feeds, shapes_out=shapes_fast)
    monkeypatch.setattr(ProbeSession, "create", classmethod(lambda cls, *a, **k: None))
    shapes_slow: dict[str, list[int]] = {}
    slow = collect_absmax(_range_model(), feeds, shapes_out=shapes_slow)
    assert fast.keys() == slow.keys(), (sorted(fast), sorted(slow))
    for name in fast:
        assert fast[name] == pytest.approx(slow[name]), (name, fast[name], slow[name])
    for name, dims in shapes_slow.items():
        assert shapes_fast.get(name) == dims, (name, shapes_fast.get(name), dims)


# --------------------------------------------------------------------------- observers, streams

_SMALL = """
<ir_version: 10, opset_import: ["" : 21]>
g (float[N,3] x) => (float[N,2] y) <float[3,2] w = {0.5, -1.0, 2.0, 0.25, -3.0, 1.5}> {
    m = MatMul (x, w)
    y = Tanh (m)
}
"""


def _batches(n: int, seed: int = 0, rows: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((rows, 3)) * (k + 1)).astype(np.float32)} for k in range(n)]


def _fp32_tensors(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """x, m and y over the concatenated batches, from an ONNX Runtime run of the FP32 model."""
    from helpers import make_model, run_ort

    model = make_model(_SMALL)
    model.graph.output.append(helper.make_tensor_value_info("m", F32, None))
    x = np.concatenate([b["x"] for b in batches])
    return {"x": x, **run_ort(model, {"x": x})}


@pytest.mark.parametrize("observer", ["absmax", "minmax"])
def test_minmax_and_absmax_over_batches_equal_numpy_over_the_concatenation(observer: str) -> None:
    from helpers import make_model
    from mixprec.calibrate.runner import calibrate

    batches = _batches(3)
    result = calibrate(make_model(_SMALL), batches, observer=observer)
    assert result.samples == 3 and result.observer == observer
    tensors = _fp32_tensors(batches)
    for name, values in tensors.items():
        stats = result.stats[name]
        np.testing.assert_allclose(stats.absmax, np.abs(values).max(), rtol=1e-6, err_msg=name)
        if observer == "minmax":
            np.testing.assert_allclose(stats.min, values.min(), rtol=1e-6, err_msg=name)
            np.testing.assert_allclose(stats.max, values.max(), rtol=1e-6, err_msg=name)
        else:
            assert stats.min is None and stats.max is None, stats
    assert result.absmax() == {name: s.absmax for name, s in result.stats.items()}
    assert result.shapes["m"] == [4, 2], result.shapes
    # weights: per output channel (MatMul: last axis), no ORT run needed
    w = result.stats["w"]
    assert w.channel_axis == 1, w
    np.testing.assert_array_equal(w.channel_min, [-3.0, -1.0])
    np.testing.assert_array_equal(w.channel_max, [2.0, 1.5])


@pytest.mark.parametrize("subsample", [0, 16384])  # fetched whole; sampled (all: 8 values)
def test_histogram_over_many_batches_keeps_fixed_bins_and_counts_everything(
    subsample: int,
) -> None:
    from helpers import make_model
    from mixprec.calibrate.runner import calibrate

    batches = _batches(20, seed=3)
    model = make_model(_SMALL)
    result = calibrate(model, iter(batches), observer="histogram", bins=64, subsample=subsample)
    tensors = _fp32_tensors(batches)
    for name, values in tensors.items():
        stats = result.stats[name]
        assert stats.histogram is not None and stats.histogram.shape == (64,), name
        assert int(stats.histogram.sum()) == values.size, (name, stats.histogram.sum())
        assert stats.hist_upper >= np.abs(values).max(), (name, stats.hist_upper)
        np.testing.assert_allclose(stats.absmax, np.abs(values).max(), rtol=1e-6, err_msg=name)
        # the histogram agrees with numpy's over the same range, up to bin-edge rounding
        want, _ = np.histogram(np.abs(values), bins=64, range=(0.0, stats.hist_upper))
        assert np.abs(stats.histogram - want).sum() <= 0.01 * values.size + 2, name


def test_histogram_observer_memory_is_fixed_and_ranges_grow_by_merging_bins() -> None:
    from mixprec.calibrate.observers import HistogramObserver

    obs = HistogramObserver(bins=8)
    obs.update(np.array([0.5, 1.0], np.float32))
    assert obs.upper == 1.0 and obs.counts.tolist() == [0, 0, 0, 0, 1, 0, 0, 1]
    obs.update(np.array([-3.5, np.nan, np.inf], np.float32))  # grows to 4.0: bins pair up
    assert obs.upper == 4.0 and obs.counts.shape == (8,), obs.counts
    assert obs.counts.tolist() == [0, 2, 0, 0, 0, 0, 0, 1], obs.counts  # bin width 0.5
    assert obs.stats().absmax == np.inf and obs.min == -3.5, obs.stats()


def test_histogram_bins_values_of_extreme_ranges_as_numpy_does() -> None:
    """Subnormal and near-float32-max ranges: the bin scale must neither overflow nor
    underflow (the counts are numpy's)."""
    from mixprec.calibrate.observers import HistogramObserver

    for values in ([1e-40, 5e-41, -2e-40, 0.0], [3e38, 1e38, -2e38, 1.0]):
        a = np.array(values, np.float32)
        obs = HistogramObserver(bins=8)
        obs.update(a)
        want, _ = np.histogram(np.abs(a).astype(np.float64), bins=8, range=(0.0, obs.upper))
        assert obs.counts.tolist() == want.tolist(), (values, obs.counts, want)


def test_a_generator_of_50_feeds_is_consumed_lazily() -> None:
    from helpers import make_model
    from mixprec.calibrate.runner import calibrate

    pulled: list[int] = []

    def stream():
        for k, batch in enumerate(_batches(50, seed=5, rows=1)):
            pulled.append(k)
            yield batch

    gen = stream()
    result = calibrate(make_model(_SMALL), gen)
    assert result.samples == 50 and pulled == list(range(50)), (result.samples, pulled)
    want = max(float(np.abs(b["x"]).max()) for b in _batches(50, seed=5, rows=1))
    assert result.stats["x"].absmax == pytest.approx(want)

    # the generator is pulled one item at a time, interleaved with the runs
    from mixprec.inputs.feeds import calibration_feeds

    pulled.clear()
    samples = calibration_feeds(stream())
    assert samples is not None and pulled == []
    next(samples)
    assert pulled == [0]


def test_calibrate_rejects_bad_data() -> None:
    from helpers import make_model
    from mixprec.calibrate.runner import calibrate

    model = make_model(_SMALL)
    with pytest.raises(MixprecError, match=r"holds no sample"):
        calibrate(model, [])
    with pytest.raises(MixprecError, match=r"calibration sample 1 is a int"):
        calibrate(model, [_batches(1)[0], 3])
    with pytest.raises(MixprecError, match=r"no input data for model input 'x'"):
        calibrate(model, [{"y": np.ones((1, 3), np.float32)}])
    with pytest.raises(MixprecError, match=r"unknown observer 'p99'"):
        calibrate(model, _batches(1), observer="p99")
