"""Histogram calibration from in-graph samples (one ONNX Runtime run per sample) against
the full-fetch histogram, on a small conv net with image-like inputs.

Tolerances, all per activation tensor, subsampled vs every value fetched:
* min, max, absmax and the histogram's total count: equal (float rounding only);
* MSE clip: its squared error, read on the full histogram, within 2% of the full
  histogram's own optimum;
* 99.999th percentile: within one bin (the tail comes from the exact largest |x|);
* entropy (KL) clip: it moves no more than it moves between full histograms of two
  calibration sets of the same kind of image (the divergence is flat near its minimum:
  small changes in the counts move the clip): on average over the tensors at most 1.25
  times as much (measured: 0.10 vs 0.11), and at most 40% for any tensor (measured:
  25%, against up to 37% between calibration sets);
with 2048 values sampled per tensor and sample (3% of the largest tensor).
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from mixprec.calibrate.observers import HistogramObserver, TensorStats
from mixprec.calibrate.probe_nodes import draw_positions, sample_indices
from mixprec.calibrate.probes import ProbeSession, Subsample
from mixprec.calibrate.runner import calibrate
from mixprec.int8.params import (
    entropy_threshold,
    mse_threshold,
    percentile_threshold,
)
from proto_builders import F32, _model, _tensor, _vi

#: Values sampled per tensor and sample in these tests (tensors hold up to 65536).
SAMPLED = 2048


def _conv_net(opset: int = 21) -> onnx.ModelProto:
    """image [1,3,64,64] -> Conv 3x3 (16) -> Relu -> Conv 3x3 stride 2 (24) -> Clip 0..6
    -> Conv 1x1 (24) -> Add (skip) -> Conv 3x3 (8) -> Tanh. He-normal weights with a few
    output channels scaled up, as trained nets have (heavy-tailed activations)."""
    rng = np.random.default_rng(7)

    def conv(name: str, cin: int, cout: int, k: int) -> list[onnx.TensorProto]:
        w = rng.standard_normal((cout, cin, k, k)) * math.sqrt(2.0 / (cin * k * k))
        w[rng.choice(cout, 2, replace=False)] *= 4.0  # outlier channels
        b = rng.standard_normal(cout) * 0.1
        return [
            _tensor(f"{name}_w", w.astype(np.float32)),
            _tensor(f"{name}_b", b.astype(np.float32)),
        ]

    def node(name: str, x: str, stride: int = 1, pad: int = 1) -> onnx.NodeProto:
        return helper.make_node(
            "Conv", [x, f"{name}_w", f"{name}_b"], [name], strides=[stride] * 2, pads=[pad] * 4
        )

    nodes = [
        node("c1", "image"),
        helper.make_node("Relu", ["c1"], ["r1"]),
        node("c2", "r1", stride=2),
        helper.make_node("Clip", ["c2", "zero", "six"], ["r2"]),
        node("c3", "r2", pad=0),
        helper.make_node("Add", ["c3", "r2"], ["s3"]),
        node("c4", "s3"),
        helper.make_node("Tanh", ["c4"], ["y"]),
    ]
    weights = [
        *conv("c1", 3, 16, 3),
        *conv("c2", 16, 24, 3),
        *conv("c3", 24, 24, 1),
        *conv("c4", 24, 8, 3),
        _tensor("zero", np.array(0.0, np.float32)),
        _tensor("six", np.array(6.0, np.float32)),
    ]
    inputs, outputs = [_vi("image", F32, [1, 3, 64, 64])], [_vi("y", F32, [1, 8, 32, 32])]
    model = _model(nodes, inputs, outputs, weights)
    model.opset_import[0].version = opset  # the probes differ below 12 and from 18 on
    return model


ACTIVATIONS = ("c1", "r1", "c2", "r2", "c3", "s3", "c4", "y")


def _images(count: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Image-like inputs: a lit gradient, flat boxes, dark strokes, sensor noise,
    normalized as ImageNet models take them."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:64, 0:64] / 64.0
    for _ in range(count):
        img = np.empty((3, 64, 64))
        img[:] = 0.4 + 0.3 * (rng.random() * yy + rng.random() * xx)
        for _ in range(4):
            y0, x0 = rng.integers(0, 48, 2)
            img[:, y0 : y0 + rng.integers(4, 16), x0 : x0 + rng.integers(4, 16)] = rng.random(
                (3, 1, 1)
            )
        for _ in range(3):
            row = rng.integers(0, 64)
            img[:, row, rng.integers(0, 32) :][:, : rng.integers(8, 32)] = 0.05
        img += rng.normal(0, 0.02, img.shape)
        mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
        img = (np.clip(img, 0, 1) - mean[:, None, None]) / std[:, None, None]
        yield {"image": img[None].astype(np.float32)}


def _fp32_tensors(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every activation of one sample, from an ONNX Runtime run of the FP32 model."""
    from helpers import run_ort

    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    del wide.graph.output[:]
    wide.graph.output.extend(helper.make_tensor_value_info(n, F32, None) for n in ACTIVATIONS)
    return run_ort(wide, feeds)


def _mse_cost(stats: TensorStats, clip: float) -> float:
    """Expected squared error of the clip at ``clip`` over ``stats``'s histogram."""
    from mixprec.int8.params import _squared_errors

    assert stats.histogram is not None
    width = stats.hist_upper / len(stats.histogram)
    edge = min(len(stats.histogram), max(1, round(clip / width)))
    return float(_squared_errors(stats, np.array([edge]))[1][0])


Stats = dict[str, TensorStats]


@pytest.fixture(scope="module")
def both() -> tuple[Stats, Stats]:
    """(subsampled, full-fetch) histogram statistics over 8 samples."""
    model = _conv_net()
    sub = calibrate(model, _images(8), observer="histogram", subsample=SAMPLED).stats
    full = calibrate(model, _images(8), observer="histogram", subsample=0).stats
    return sub, full


def test_min_max_and_counts_are_exact_against_onnxruntime(both: tuple[Stats, Stats]) -> None:
    sub, _ = both
    model = _conv_net()
    runs = [_fp32_tensors(model, feeds) for feeds in _images(8)]
    for name in ACTIVATIONS:
        values = np.concatenate([run[name].ravel() for run in runs])
        stats = sub[name]
        assert stats.min == values.min() and stats.max == values.max(), name
        assert stats.absmax == np.abs(values).max(), name
        assert stats.histogram is not None and len(stats.histogram) == 2048, name
        assert stats.hist_upper >= stats.absmax, name
        np.testing.assert_allclose(stats.histogram.sum(), values.size, rtol=1e-9, err_msg=name)
        top = np.abs(values).max()
        bin_of_max = min(int(top / stats.hist_upper * 2048), 2047)
        assert stats.histogram[bin_of_max] >= 1, (name, "the exact max is counted")
        assert not stats.histogram[bin_of_max + 1 :].any(), (name, "nothing above the max")


def test_ranges_from_samples_match_the_full_histogram(both: tuple[Stats, Stats]) -> None:
    sub, full = both
    for name in ACTIVATIONS:
        s, f = sub[name], full[name]
        assert (s.min, s.max, s.hist_upper) == (f.min, f.max, f.hist_upper), name
        width = f.hist_upper / 2048
        t_full, t_sub = mse_threshold(f), mse_threshold(s)
        assert t_full is not None and t_sub is not None, name
        assert _mse_cost(f, t_sub) <= 1.02 * _mse_cost(f, t_full), (name, t_sub, t_full)
        p_full, p_sub = percentile_threshold(f), percentile_threshold(s)
        assert p_full is not None and p_sub is not None, name
        assert abs(p_sub - p_full) <= width * 1.001, (name, p_sub, p_full)


def _entropy_moves(stats: Stats, reference: Stats) -> np.ndarray:
    """|relative move| of each activation's entropy clip from ``reference``'s."""
    moves = []
    for name in ACTIVATIONS:
        got, want = entropy_threshold(stats[name]), entropy_threshold(reference[name])
        assert got is not None and want is not None and want > 0, name
        moves.append(abs(got / want - 1.0))
    return np.array(moves)


def test_entropy_clips_move_no_more_than_between_calibration_sets(
    both: tuple[Stats, Stats],
) -> None:
    sub, full = both
    other = calibrate(_conv_net(), _images(8, seed=1), observer="histogram", subsample=0).stats
    sampling, between = _entropy_moves(sub, full), _entropy_moves(other, full)
    assert sampling.mean() <= 1.25 * between.mean(), (sampling, between)
    assert sampling.max() <= 0.4, dict(zip(ACTIVATIONS, sampling.round(3), strict=True))


def _count_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts InferenceSession creations and runs (every ORT session mixprec makes)."""
    counts = {"sessions": 0, "runs": 0}
    init, run, run_values = (
        ort.InferenceSession.__init__,
        ort.InferenceSession.run,
        ort.InferenceSession.run_with_ort_values,
    )

    def counting_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["sessions"] += 1
        init(self, *args, **kwargs)

    def counting_run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["runs"] += 1
        return run(self, *args, **kwargs)

    def counting_values(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        counts["runs"] += 1
        return run_values(self, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "__init__", counting_init)
    monkeypatch.setattr(ort.InferenceSession, "run", counting_run)
    monkeypatch.setattr(ort.InferenceSession, "run_with_ort_values", counting_values)
    return counts


def test_one_onnxruntime_run_per_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _count_runs(monkeypatch)
    result = calibrate(_conv_net(), _images(6), observer="histogram", subsample=SAMPLED)
    assert result.samples == 6
    assert counts == {"sessions": 1, "runs": 6}, counts
    assert all(result.stats[n].histogram is not None for n in ACTIVATIONS)


def test_memory_does_not_grow_with_samples() -> None:
    """The process's resident memory stays flat from the 8th to the 64th sample, and the
    result is as large after 64 samples as after 8."""
    rss: list[int] = []

    def tracked(count: int) -> Iterator[dict[str, np.ndarray]]:
        for feeds in _images(count):
            with open("/proc/self/status") as status:
                rss.append(next(int(r.split()[1]) for r in status if r.startswith("VmRSS")))
            yield feeds

    model = _conv_net()
    short = calibrate(model, tracked(8), observer="histogram", subsample=SAMPLED)
    rss.clear()
    long = calibrate(model, tracked(64), observer="histogram", subsample=SAMPLED)
    assert long.samples == 64
    assert len(pickle.dumps(long.stats)) == len(pickle.dumps(short.stats))
    grown_kb = max(rss[8:]) - rss[7]
    assert grown_kb < 8 * 1024, f"resident memory grew {grown_kb} KB over samples 8..64"


@pytest.mark.parametrize("opset", [11, 13, 21])
def test_probe_samples_are_the_tensor_at_the_drawn_positions(opset: int) -> None:
    """What the probes give, against the FP32 tensors of an ORT run: the exact min, max
    and shape, the flattened tensor at ``floor(positions * size)``, and its largest |x|
    in order."""
    model = _conv_net(opset)
    work = ir.from_proto(model)
    subsample = Subsample(size=30000, top=64, seed=3)  # c1 holds 65536 values, c2 24576
    names = ("c1", "c2", "y")
    probe = ProbeSession.create(
        work, [(n, ir.DataType.FLOAT) for n in names], 1, subsample=subsample
    )
    assert probe is not None
    feeds = next(_images(1))
    ranges = probe.run(feeds)
    want = _fp32_tensors(model, feeds)
    positions = draw_positions(np.random.default_rng(3), 30000)
    np.testing.assert_array_equal(probe.last_positions, positions)
    for name in names:
        flat = want[name].ravel()
        sample, top = probe.last_samples[name]
        assert ranges[name] == (float(flat.min()), float(flat.max()), list(want[name].shape))
        np.testing.assert_array_equal(sample, flat[sample_indices(positions, flat.size)])
        np.testing.assert_array_equal(top, np.sort(np.abs(flat))[::-1][:64])
    assert [v.name for v in work.graph.outputs] == ["y"], "the model was changed"
    assert [v.name for v in work.graph.inputs] == ["image"], "the model was changed"


def test_sample_indices_are_stratified_and_cover_small_tensors() -> None:
    positions = draw_positions(np.random.default_rng(0), 4096)
    assert positions.dtype == np.float64 and np.all(np.diff(positions) > 0)
    assert positions.min() >= 0.0 and positions.max() < 1.0
    strata = np.floor(positions * 4096).astype(int)
    np.testing.assert_array_equal(strata, np.arange(4096))  # one position per stratum
    for count in (1, 7, 2048):  # at most half the sample: every value is taken
        indices = sample_indices(positions, count)
        assert np.unique(indices).size == count and indices.max() == count - 1, count
    big = sample_indices(positions, 10**9)
    assert np.unique(big).size == 4096 and big.max() < 10**9


def test_update_sample_keeps_the_tail_exact_and_the_total() -> None:
    """A 100000-value batch seen as 1000 sampled values and its 50 largest |x|: those 50
    are counted once each, the rest stands for the other 99950."""
    rng = np.random.default_rng(1)
    values = rng.standard_t(3, 100_000).astype(np.float32)  # heavy tails
    top = np.sort(np.abs(values))[::-1][:50]
    sample = values[np.sort(rng.choice(values.size, 1000, replace=False))]
    obs = HistogramObserver(256)
    obs.update_sample(float(values.min()), float(values.max()), values.size, sample, top)
    assert obs.upper == float(np.abs(values).max())
    np.testing.assert_allclose(obs.counts.sum(), values.size, rtol=1e-9)
    edges = np.linspace(0, obs.upper, 257)
    above = np.searchsorted(edges, top[-1], side="right")  # bins wholly above the 50th
    exact, _ = np.histogram(top, bins=256, range=(0.0, obs.upper))
    np.testing.assert_array_equal(obs.counts[above:], exact[above:])


def test_histogram_falls_back_to_fetching_when_probes_cannot_run(
    monkeypatch: pytest.MonkeyPatch, both: tuple[Stats, Stats]
) -> None:
    _, full = both
    monkeypatch.setattr(ProbeSession, "create", classmethod(lambda cls, *a, **k: None))
    fetched = calibrate(_conv_net(), _images(8), observer="histogram", subsample=SAMPLED).stats
    for name in ACTIVATIONS:
        assert fetched[name].histogram is not None, name
        np.testing.assert_array_equal(fetched[name].histogram, full[name].histogram)


def test_a_tensor_holding_nan_is_fetched_and_its_nans_ignored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sqrt of a negative is NaN: that tensor's probes say NaN, so it alone is fetched in a
    second run; the histogram counts its other values."""
    from helpers import make_model

    model = make_model("""
        <ir_version: 10, opset_import: ["" : 21]>
        g (float[4] x) => (float[4] y) {
            root = Sqrt (x)
            y = Relu (x)
        }
    """)
    counts = _count_runs(monkeypatch)
    feeds = {"x": np.array([-1.0, 4.0, 9.0, 0.0], np.float32)}
    stats = calibrate(model, [feeds], observer="histogram", bins=4).stats
    assert counts == {"sessions": 2, "runs": 2}, counts
    root = stats["root"]
    assert (root.min, root.max, root.hist_upper) == (0.0, 3.0, 3.0), root
    assert root.histogram is not None and root.histogram.tolist() == [1, 0, 1, 1]
    assert stats["y"].histogram is not None and stats["y"].histogram.tolist() == [2, 1, 0, 1]


def test_channel_probes_ride_along_with_the_histogram_probes() -> None:
    """Per-channel means and max |x| and kept rows come from the same single run, equal
    to numpy over the FP32 tensors of ORT runs (ranks known: the probes need them)."""
    model = onnx.shape_inference.infer_shapes(_conv_net())
    result = calibrate(
        model,
        _images(3),
        observer="histogram",
        subsample=SAMPLED,
        channel_means={"r1": 1},
        channel_absmax={"c3": 1},
        rows={"c3": 5},
    )
    runs = [_fp32_tensors(model, feeds) for feeds in _images(3)]
    means = np.mean([run["r1"].mean(axis=(0, 2, 3), dtype=np.float64) for run in runs], axis=0)
    np.testing.assert_allclose(result.channel_means["r1"], means, rtol=1e-5, atol=1e-6)
    absmax = np.max([np.abs(run["c3"]).max(axis=(0, 2, 3)) for run in runs], axis=0)
    np.testing.assert_array_equal(result.channel_absmax["c3"], absmax)
    kept = result.rows["c3"]
    assert kept.shape == (15, 32), kept.shape  # 5 rows of each sample, last axis 32 wide
    every_row = np.concatenate([run["c3"].reshape(-1, 32) for run in runs])
    assert all((every_row == row).all(axis=1).any() for row in kept)
    assert result.stats["c3"].histogram is not None and result.samples == 3
