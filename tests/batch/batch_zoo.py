"""A small model zoo on disk for the batch tests: real models that mixprec converts, a
file that is not a model, and a model whose run never ends (caught mid-run, or timed
out)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx

from text_models import filled_model

MLP = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2,16] x) => (float[2,8] y) <float[16,32] w1, float[32] b1, float[32,8] w2> {
    h = MatMul (x, w1)
    hb = Add (h, b1)
    r = Relu (hb)
    y = MatMul (r, w2)
}
"""

CONV = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[1,4,8,8] x) => (float[1,4,8,8] y) <float[4,4,3,3] w1, float[4,4,3,3] w2> {
    c1 = Conv <pads = [1,1,1,1]> (x, w1)
    r = Relu (c1)
    y = Conv <pads = [1,1,1,1]> (r, w2)
}
"""

#: A Loop of 192x192 MatMuls: with the default count, a run never ends in a test's time
#: (on any CPU), so a timeout or a signal is always what ends its worker.
SLOW = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[192,192] x) => (float[192,192] y) <float[192,192] w, int64 n> {
    cond = Constant <value = bool {1}> ()
    y = Loop (n, cond, x) <body = body (int64 i, bool c, float[192,192] a)
                                    => (bool co, float[192,192] b) {
        co = Identity (c)
        m = MatMul (a, w)
        b = Tanh (m)
    }>
}
"""


def write(path: Path, model: onnx.ModelProto) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def mlp(seed: int = 0) -> onnx.ModelProto:
    return filled_model(MLP, seed=seed)


def conv(seed: int = 0) -> onnx.ModelProto:
    return filled_model(CONV, seed=seed)


def slow(iterations: int = 10**12) -> onnx.ModelProto:
    proto = onnx.parser.parse_model(SLOW)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((192, 192)) / 14).astype(np.float32)
    proto.graph.initializer.extend(
        [
            onnx.numpy_helper.from_array(w, "w"),
            onnx.numpy_helper.from_array(np.array(iterations, np.int64), "n"),
        ]
    )
    del proto.graph.value_info[:]
    onnx.checker.check_model(proto, full_check=True)
    return proto


def feeds(model_path: Path, seed: int = 1) -> dict[str, np.ndarray]:
    """Random inputs at a model's declared (static) input shapes."""
    proto = onnx.load(model_path)
    rng = np.random.default_rng(seed)
    return {
        v.name: rng.standard_normal([d.dim_value for d in v.type.tensor_type.shape.dim]).astype(
            np.float32
        )
        for v in proto.graph.input
    }


def manifest(path: Path, entries: dict[str, dict[str, object]]) -> Path:
    """A TOML manifest at ``path`` listing ``entries`` (model path -> its options)."""
    lines = []
    for model, options in entries.items():
        lines += ["[[models]]", f'path = "{model}"']
        lines += [f"{key} = {json.dumps(value)}" for key, value in options.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def make_zoo(root: Path) -> Path:
    """``root/zoo``: vision/conv.onnx, text/mlp.onnx, mlp2.onnx and broken.onnx."""
    zoo = root / "zoo"
    write(zoo / "vision" / "conv.onnx", conv())
    write(zoo / "text" / "mlp.onnx", mlp())
    write(zoo / "mlp2.onnx", mlp(seed=3))
    (zoo / "broken.onnx").write_bytes(b"this is not an ONNX model")
    return zoo
