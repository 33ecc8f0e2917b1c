"""GPTQ and mixed 4/8 bits by sensitivity (weights/gptq.py, stats.py, sensitivity.py).

GPTQ is held to the layer's output error ``||X W - X Q(W)||`` against round to nearest on
correlated inputs, in numpy and in ONNX Runtime's MatMulNBits; the mixed-bits choice must
put a layer fed outlier channels at 8 bits and leave the model close to FP32 in ONNX
Runtime. Every model is built here with onnx.helper (a few KB)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.core.errors import MixprecError
from mixprec.core.metrics import rel_l2_error
from mixprec.runtime import ort_sessions as ort_runtime
from mixprec.runtime.engine import RuntimeOptions
from mixprec.weights.blocks import BlockSpec, quantize_rtn
from mixprec.weights.config import WeightsConfig
from mixprec.weights.gptq import gptq_quantize
from mixprec.weights.mixed_bits import rank_layers

K = 64


def _correlated(rows: int, seed: int) -> np.ndarray:
    """Inputs with strongly correlated channels and a few loud ones (as LLM activations):
    one distribution (``mix``), its rows drawn by ``seed``."""
    mix = np.eye(K) + 1.5 * np.random.default_rng(0).normal(size=(K, K)) / np.sqrt(K)
    x = np.random.default_rng(seed).normal(size=(rows, K)) @ mix
    x[:, :3] *= 8.0
    return x.astype(np.float32)


def _rel(x: np.ndarray, w: np.ndarray, q: np.ndarray) -> float:
    return float(np.linalg.norm(x @ (w - q)) / np.linalg.norm(x @ w))


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("block", [16, 32])
def test_gptq_lowers_the_layer_output_error_against_rtn(symmetric: bool, block: int) -> None:
    rng = np.random.default_rng(0)
    w = (rng.normal(size=(K, 96)) * 0.05).astype(np.float32)
    x = _correlated(1024, 1)
    held_out = _correlated(512, 2)  # same distribution, other rows: no fit to the rows seen
    spec = BlockSpec(4, block, symmetric)
    g = gptq_quantize(w, spec, x.astype(np.float64).T @ x / len(x))
    assert g.codes.shape == (96, K // block, block) and g.codes.max() <= 15
    assert np.all(g.zero_points == 8) if symmetric else g.zero_points.max() <= 15
    rtn = _rel(held_out, w, quantize_rtn(w, spec).dequantize())
    gptq = _rel(held_out, w, g.dequantize())
    # measured: GPTQ leaves 40-50% of RTN's error on these inputs
    assert gptq < 0.7 * rtn, (gptq, rtn)


def _mlp(outlier: float = 24.0, seed: int = 0) -> onnx.ModelProto:
    """x -> mm1 -> mm2 -> mm3 -> Relu; mm3's first input row is ``outlier`` times larger:
    one weight per block sets the 4-bit step, and the other weights of mm3 lose most of
    their precision (at 8 bits, not)."""
    rng = np.random.default_rng(seed)
    weights = [(rng.normal(size=(K, K)) / np.sqrt(K)).astype(np.float32) for _ in range(3)]
    weights[2][0] *= outlier
    inits = [numpy_helper.from_array(w, f"w{i + 1}") for i, w in enumerate(weights)]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
        helper.make_node("MatMul", ["h1", "w2"], ["h2"], name="mm2"),
        helper.make_node("MatMul", ["h2", "w3"], ["h3"], name="mm3"),
        helper.make_node("Relu", ["h3"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", K])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _samples(count: int = 4, seed: int = 10) -> list[dict[str, np.ndarray]]:
    return [{"x": _correlated(64, seed + i)} for i in range(count)]


def _rel_out(model: onnx.ModelProto, quantized: onnx.ModelProto) -> float:
    feeds = {"x": _correlated(256, 99)}
    return rel_l2_error(run_ort(model, feeds)["y"], run_ort(quantized, feeds)["y"])


def test_the_layer_with_outlier_weights_ranks_first_and_goes_to_8_bits() -> None:
    model = _mlp()
    ranked = rank_layers(model, WeightsConfig(), _samples())
    assert ranked[0].name == "mm3"
    assert ranked[0].score > 4 * ranked[1].score  # an outlier, not a close call
    # round to nearest: GPTQ compensates most of such an outlier's damage by itself
    options = {"weights": "int4", "block_size": 16, "weight_method": "rtn"}
    # a size budget with room for one of the three layers at 8 bits: the outlier gets it
    mixed = mixprec.quantize(model, _samples(), max_size=0.25, **options)
    decisions = {r.name: r.precision for r in mixed.report.nodes}
    assert decisions == {"mm1": "int4", "mm2": "int4", "mm3": "int8"}
    assert "mm3" in mixed.report.quantization["mixed"]["int8"]
    all4 = mixprec.quantize(model, _samples(), ratio=1.0, **options)
    assert all4.report.quantization["mixed"]["int8"] == {}
    # the default budget (a tenth of the linear weights) has no room for a third of them
    default = mixprec.quantize(model, _samples(), **options)
    assert {r.precision for r in default.report.nodes} == {"int4"}
    # in ONNX Runtime: 8 bits where it matters is much closer to FP32 than all 4 bits
    near, far = _rel_out(model, mixed.model_proto), _rel_out(model, all4.model_proto)
    assert near < 0.8 * far and near < 0.06, (near, far)  # measured 0.052 against 0.073


def test_ratio_sets_the_share_of_4_bit_weights() -> None:
    model = _mlp()
    none4 = mixprec.quantize(model, _samples(), weights="int4", block_size=16, ratio=0.0)
    assert {r.precision for r in none4.report.nodes} == {"int8"}
    third = mixprec.quantize(model, _samples(), weights="int4", block_size=16, ratio=0.6)
    assert sorted(r.precision for r in third.report.nodes) == ["int4", "int4", "int8"]
    with pytest.raises(MixprecError, match="ratio"):
        WeightsConfig(ratio=1.5)


def test_gptq_in_onnx_runtime_beats_rtn_and_needs_data() -> None:
    model = _mlp(outlier=1.0)
    options = {"weights": "int4", "block_size": 16, "ratio": 1.0}
    gptq = mixprec.quantize(model, _samples(8), weight_method="gptq", **options)
    rtn = mixprec.quantize(model, _samples(8), weight_method="rtn", **options)
    g, r = _rel_out(model, gptq.model_proto), _rel_out(model, rtn.model_proto)
    assert g < 0.8 * r, (g, r)
    with pytest.raises(MixprecError, match="calibration data"):
        mixprec.quantize(model, None, weight_method="gptq", **options)


def _pairs_mlp() -> onnx.ModelProto:
    """mm1 -> Reshape to pairs of rows -> back -> mm2: an odd number of rows fails in
    ONNX Runtime, so calibration samples of 63 rows give no layer statistics."""
    rng = np.random.default_rng(0)
    weights = [(rng.normal(size=(K, K)) / np.sqrt(K)).astype(np.float32) for _ in range(2)]
    inits = [numpy_helper.from_array(w, f"w{i + 1}") for i, w in enumerate(weights)]
    inits += [
        numpy_helper.from_array(np.array([2, -1, K], np.int64), "pairs"),
        numpy_helper.from_array(np.array([-1, K], np.int64), "rows"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h1"], name="mm1"),
        helper.make_node("Reshape", ["h1", "pairs"], ["p"], name="to_pairs"),
        helper.make_node("Reshape", ["p", "rows"], ["h2"], name="to_rows"),
        helper.make_node("MatMul", ["h2", "w2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "pairs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", K])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_the_report_names_the_search_where_gptq_fell_back_to_it() -> None:
    """Before: the statistics failed, every layer fell back, and the report said
    ``method: gptq``. The fallback is the data-free scale search."""
    model = _pairs_mlp()
    options = {"weights": "int4", "block_size": 16, "ratio": 1.0, "weight_method": "gptq"}
    held = [{"x": _correlated(64, 9)}]
    odd = [{"x": _correlated(63, 1 + i)} for i in range(4)]
    fell = mixprec.quantize(model, odd, eval_data=held, **options)
    q = fell.report.quantization
    assert q["method"].startswith("search (gptq asked"), q["method"]
    assert q["methods"] == {"mm1": "search", "mm2": "search"}, q["methods"]
    assert set(q["fallbacks"]) == {"mm1", "mm2"}, q["fallbacks"]
    assert any("gptq ran on 0 of 2 layers" in n for n in fell.report.notes), fell.report.notes
    # what it wrote is what the data-free search writes, in ONNX Runtime
    rtn = mixprec.quantize(model, odd, eval_data=held, **{**options, "weight_method": "search"})
    feeds = {"x": _correlated(32, 5)}
    np.testing.assert_array_equal(
        run_ort(fell.model_proto, feeds)["y"], run_ort(rtn.model_proto, feeds)["y"]
    )
    even = [{"x": _correlated(64, 1 + i)} for i in range(4)]
    ran = mixprec.quantize(model, even, eval_data=held, **options).report.quantization
    assert (ran["method"], ran["fallbacks"]) == ("gptq", {}), ran
    assert ran["methods"] == {"mm1": "gptq", "mm2": "gptq"}, ran["methods"]


@pytest.mark.parametrize("stream", [False, True])
def test_threads_0_reaches_onnx_runtime_as_0(stream, tmp_path, monkeypatch) -> None:
    """``threads=0`` is the engine's choice (all cores). Before: the layer statistics and
    the streamed checks ran with 2. Every ONNX Runtime session mixprec makes asks
    ``thread_cap`` for its count; a recording wrapper (it calls through) sees what came."""
    asked: list[int] = []
    cap = ort_runtime.thread_cap

    def recording(threads: int) -> int:
        asked.append(threads)
        return cap(threads)

    monkeypatch.setattr(ort_runtime, "thread_cap", recording)
    model = _mlp(outlier=1.0)
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    options = {"weights": "int4", "block_size": 16, "ratio": 1.0, "stream": stream}
    method = "rtn" if stream else "gptq"  # the streamed path has no GPTQ
    runtime = RuntimeOptions(threads=0)
    result = mixprec.quantize(
        str(path), _samples(4), weight_method=method, runtime=runtime, **options
    )
    assert asked and set(asked) == {0}, asked
    x = {"x": _correlated(16, 3)}
    assert _rel_out(model, result.model_proto) < 0.2  # it ran, and quantized
    assert run_ort(result.model_proto, x)["y"].shape == (16, K)
