"""Build a tiny FP32 language-model-shaped demo for weight-only quantization (seeded).

Token ids -> an embedding table (1000 x 128) -> two residual MLP blocks (LayerNorm,
MatMul 128x512, Relu, MatMul 512x128) -> LayerNorm -> an lm_head tied to the embedding
table (``MatMul(h, Transpose(table))``) -> logits over 1000 tokens. About 1.6 MB, and a
calibration file of 16 sequences of 16 tokens beside it (``OUT_calib.npz``).

Usage: python examples/make_demo_lm.py OUT.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCAB, HIDDEN, FF, BLOCKS = 1000, 128, 512, 2


def build() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32) * 0.5,
        "ln_scale": np.ones(HIDDEN, np.float32),
        "ln_bias": np.zeros(HIDDEN, np.float32),
    }
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h0"], name="embed_tokens")]
    x = "h0"
    for i in range(BLOCKS):
        weights[f"up{i}"] = (rng.standard_normal((HIDDEN, FF)) / np.sqrt(HIDDEN)).astype(np.float32)
        weights[f"down{i}"] = (rng.standard_normal((FF, HIDDEN)) / np.sqrt(FF)).astype(np.float32)
        nodes += [
            helper.make_node("LayerNormalization", [x, "ln_scale", "ln_bias"], [f"n{i}"]),
            helper.make_node("MatMul", [f"n{i}", f"up{i}"], [f"u{i}"], name=f"mlp{i}_up"),
            helper.make_node("Relu", [f"u{i}"], [f"g{i}"]),
            helper.make_node("MatMul", [f"g{i}", f"down{i}"], [f"d{i}"], name=f"mlp{i}_down"),
            helper.make_node("Add", [x, f"d{i}"], [f"h{i + 1}"]),
        ]
        x = f"h{i + 1}"
    nodes += [
        helper.make_node("LayerNormalization", [x, "ln_scale", "ln_bias"], ["final"]),
        helper.make_node("Transpose", ["embed"], ["embed_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["final", "embed_t"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(
        nodes,
        "demo_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", VOCAB])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "demo_lm.onnx")
    onnx.save(build(), out)
    ids = np.random.default_rng(1).integers(0, VOCAB, (16, 1, 16))
    calib = out.with_name(f"{out.stem}_calib.npz")
    np.savez(calib, input_ids=ids)
    print(f"built {out} ({out.stat().st_size / 1e6:.1f} MB) and {calib}")


if __name__ == "__main__":
    main()
