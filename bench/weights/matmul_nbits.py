"""Time one K x N MatMul at M=1 (a decoding step): FP32 against ONNX Runtime's MatMulNBits
at 4 and 8 bits, accuracy_level 0 and 4. The numbers behind ``--accuracy-level``'s default
(docs/guides/weights.md).

    python -m bench.weights.matmul_nbits [K] [--threads 2] [--rounds 15]

Codes and scales are random (speed does not depend on them); the sessions run in
interleaved rounds of at least 0.15 s each, and the table gives the median (and the
fastest) milliseconds per run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def _model(k: int, n: int, node: onnx.NodeProto, weights: list[onnx.TensorProto]) -> bytes:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
        weights,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def candidates(k: int, n: int, rng: np.random.Generator) -> dict[str, bytes]:
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    found = {
        "fp32": _model(
            k, n, helper.make_node("MatMul", ["x", "W"], ["y"]), [numpy_helper.from_array(w, "W")]
        )
    }
    for bits, block, level in [(4, 32, 0), (4, 32, 4), (8, 32, 0), (8, 32, 4), (4, 128, 4),
                               (8, 128, 4)]:  # fmt: skip
        blocks = k // block
        b = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        scales = np.full(n * blocks, 0.01, np.float32)
        node = helper.make_node(
            "MatMulNBits", ["x", "B", "s"], ["y"], domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=block, accuracy_level=level,
        )  # fmt: skip
        weights = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales, "s")]
        found[f"int{bits} b{block} level {level}"] = _model(k, n, node, weights)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("k", nargs="?", type=int, default=4096, help="K = N (default 4096)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    sessions = {}
    for name, model in candidates(args.k, args.k, rng).items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = args.threads
        sessions[name] = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((1, args.k)).astype(np.float32)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(args.rounds):
        for name, session in sessions.items():
            session.run(None, {"x": x})
            start, runs = time.perf_counter(), 0
            while time.perf_counter() - start < 0.15 or runs < 3:
                session.run(None, {"x": x})
                runs += 1
            times[name].append((time.perf_counter() - start) / runs * 1e3)
    print(f"ONNX Runtime {ort.__version__}, {args.k}x{args.k} at M=1, {args.threads} threads")
    for name, values in times.items():
        print(f"  {name:20s} {np.median(values):8.3f} ms  (fastest {min(values):.3f})")


if __name__ == "__main__":
    main()
