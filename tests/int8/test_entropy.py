"""``--method entropy`` (the KL-divergence clip): sane clips on known distributions, and an
all-INT8 ReLU net as close to FP32 as min/max's.

Before: the exact zeros of a ReLU's output (half its values) sat in the histogram's first
bin, and smearing that spike over its group of bins made the divergence prefer the lowest
clips (1.45 sigma on a half-normal); and 128 levels were counted where uint8 has 256 over
a one-sided range. A 4-layer ReLU net's logits went from rel L2 0.010 (min/max) to 0.41,
top-1 agreement 0.22; on the bench's PP-OCR cls 0.15 -> 0.75 and MNIST CNN 0.010 -> 0.69.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import mixprec
from helpers import run_ort
from mixprec.calibrate.observers import HistogramObserver
from mixprec.core.metrics import rel_l2_error
from mixprec.int8.params import activation_qparams, entropy_threshold, mse_threshold


def _stats(batches: list[np.ndarray]):
    hist = HistogramObserver()
    for batch in batches:
        hist.update(batch.astype(np.float32))
    return hist.stats()


def test_a_relus_zero_spike_no_longer_pulls_the_clip_down():
    rng = np.random.default_rng(3)
    relu = _stats([np.maximum(rng.standard_normal(50000), 0.0) for _ in range(8)])
    clip = entropy_threshold(relu)
    # before: 1.45 (15% of the positive values clipped); min-squared-error clips at ~3.97
    assert clip is not None and 3.0 < clip <= relu.absmax, clip
    assert abs(clip - mse_threshold(relu)) < 0.25 * relu.absmax
    # the uint8 grid of a one-sided tensor has twice the steps of symmetric int8: the
    # divergence, counting them, clips no lower
    signed = entropy_threshold(relu, unsigned=False)
    assert signed is not None and signed <= clip
    params = activation_qparams(relu, "entropy", unsigned=True)
    assert not isinstance(params, str) and params.note == ""


def test_the_clip_is_kept_where_it_costs_no_more_squared_error_than_minmax():
    """A Laplace tail: the KL clip (~10 of a max of ~13.5) is used; 8 outliers at 80 off a
    Gaussian (a fifth of its energy): min/max, with the reason (test_quantize.py)."""
    rng = np.random.default_rng(0)
    laplace = _stats([rng.laplace(size=50000) for _ in range(8)])
    entropy = activation_qparams(laplace, "entropy", unsigned=True)
    minmax = activation_qparams(laplace, "minmax", unsigned=True)
    assert not isinstance(entropy, str) and not isinstance(minmax, str)
    assert entropy.note == "" and float(entropy.scale) < 0.9 * float(minmax.scale)


def _relu_net(depth: int = 4, channels: int = 8) -> onnx.ModelProto:
    """x[1,3,16,16] -> depth x (Conv 3x3 -> Relu) -> GlobalAveragePool -> Gemm: logits[1,10]
    (He-initialised, seeded): every activation has a ReLU's zero spike."""
    rng = np.random.default_rng(0)
    inits, nodes, prev, cin = [], [], "x", 3
    for k in range(depth):
        w = rng.standard_normal((channels, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))
        b = rng.standard_normal(channels) * 0.1
        inits += [
            numpy_helper.from_array(w.astype(np.float32), f"w{k}"),
            numpy_helper.from_array(b.astype(np.float32), f"b{k}"),
        ]
        nodes += [
            helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"c{k}"], [f"r{k}"]),
        ]
        prev, cin = f"r{k}", channels
    fc = (rng.standard_normal((10, channels)) * 0.5).astype(np.float32)
    inits.append(numpy_helper.from_array(fc, "fc"))
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "relu_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _images(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.random((1, 3, 16, 16)).astype(np.float32)} for _ in range(n)]


def _errors(model: onnx.ModelProto, quantized: onnx.ModelProto, samples) -> tuple[float, float]:
    ref = np.concatenate([run_ort(model, s)["logits"] for s in samples])
    got = np.concatenate([run_ort(quantized, s)["logits"] for s in samples])
    rel = rel_l2_error(ref, got)
    return rel, float(np.mean(ref.argmax(-1) == got.argmax(-1)))


def test_all_int8_entropy_is_as_close_to_fp32_as_minmax_on_a_relu_net():
    """Before: rel L2 0.41 and top-1 agreement 0.22 against min/max's 0.010 and 0.97."""
    model = _relu_net()
    calib, held = _images(16, 1), _images(32, 2)
    options = {"speed": "off", "guard": False, "mode": "static"}
    by_method = {
        m: _errors(model, mixprec.quantize(model, calib, method=m, **options).model_proto, held)
        for m in ("minmax", "entropy")
    }
    (rel_mm, top_mm), (rel_ent, top_ent) = by_method["minmax"], by_method["entropy"]
    assert rel_mm < 0.03, by_method  # the net quantizes well
    assert rel_ent <= 1.5 * rel_mm + 0.005, by_method
    assert top_ent >= top_mm - 0.07, by_method
