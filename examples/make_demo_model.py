"""Build the small FP32 demo model used by ``make demo`` (about 100 KB, seeded).

A little image classifier that exercises what mixprec handles: Conv + BatchNormalization
(folded), Relu, MaxPool, Resize (its scales must stay float32), a residual Add, a
ReduceMean head (DENY in fp16), Gemm, Softmax, and a BatchNormalization whose running
variance (1e8) would overflow float16 if stored as is.

Usage: python examples/make_demo_model.py OUT.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def w(name: str, *shape: int, scale: float = 0.2) -> TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * scale).astype(np.float32), name
        )

    def bn(prefix: str, c: int, big_var: bool = False) -> list[TensorProto]:
        var = rng.uniform(0.5, 2.0, c).astype(np.float32)
        mean = rng.standard_normal(c).astype(np.float32) * 0.1
        if big_var:
            var[0] = 9.8e7  # like PP-OCRv4 det: overflows float16 unless folded
            mean[0] = 3000.0
        return [
            numpy_helper.from_array(rng.uniform(0.8, 1.2, c).astype(np.float32), f"{prefix}_s"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32) * 0.1, f"{prefix}_b"),
            numpy_helper.from_array(mean, f"{prefix}_m"),
            numpy_helper.from_array(var, f"{prefix}_v"),
        ]

    inits = [
        w("c1_w", 16, 3, 3, 3),
        *bn("bn1", 16, big_var=True),
        w("c2_w", 32, 16, 3, 3, scale=0.1),
        *bn("bn2", 32),
        w("c3_w", 32, 32, 3, 3, scale=0.05),
        numpy_helper.from_array(np.zeros(32, np.float32), "c3_b"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "up_scales"),
        w("fc_w", 32, 10, scale=0.3),
        numpy_helper.from_array(np.zeros(10, np.float32), "fc_b"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "c1_w"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c1", "bn1_s", "bn1_b", "bn1_m", "bn1_v"], ["b1"], name="bn1"
        ),
        helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
        helper.make_node(
            "MaxPool", ["r1"], ["p1"], name="pool1", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node(
            "Conv", ["p1", "c2_w"], ["c2"], name="conv2", pads=[1, 1, 1, 1], strides=[2, 2]
        ),
        helper.make_node(
            "BatchNormalization", ["c2", "bn2_s", "bn2_b", "bn2_m", "bn2_v"], ["b2"], name="bn2"
        ),
        helper.make_node("Relu", ["b2"], ["r2"], name="relu2"),
        helper.make_node(
            "Resize", ["r2", "", "up_scales"], ["up"], name="upsample", mode="nearest"
        ),
        helper.make_node("Conv", ["up", "c3_w", "c3_b"], ["c3"], name="conv3", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c3", "up"], ["res"], name="residual"),
        helper.make_node("Relu", ["res"], ["r3"], name="relu3"),
        helper.make_node("ReduceMean", ["r3"], ["gap"], name="gap", axes=[2, 3], keepdims=0),
        helper.make_node("Gemm", ["gap", "fc_w", "fc_b"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mixprec_demo",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo-out/demo_fp32.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build(), out)
    size_kb = out.stat().st_size / 1024
    print(f"built {out} ({size_kb:.0f} KB): Conv+BN, Resize, ReduceMean, Gemm, Softmax")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
