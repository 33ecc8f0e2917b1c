"""Peak memory of `mixprec convert` on a large synthetic model with external data.

Builds a chain of N MatMuls of 8192x8192 float32 weights (256 MiB each) saved with
external data in a scratch folder, then runs the CLI in a child process per case and
reads the child's peak RSS (``ru_maxrss``). Targets (issue 7): peak <= 1.3 x weights +
300 MB with calibration, <= 1.1 x weights + 200 MB with ``--no-calibrate``.

    .venv/bin/python -m bench.harness.large_model --gib 1          # quick
    .venv/bin/python -m bench.harness.large_model --gib 4.6        # the issue's size

Writes nothing into the repository; the scratch folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIDE = 8192
LAYER_BYTES = SIDE * SIDE * 4


def build(folder: Path, layers: int) -> Path:
    """Writes the model; the weights are written one at a time (never all in memory)."""
    path = folder / "large.onnx"
    data = folder / "large.onnx.data"
    nodes, inits = [], []
    rng = np.random.default_rng(0)
    offset = 0
    with open(data, "wb") as f:
        for k in range(layers):
            w = (rng.standard_normal((SIDE, SIDE), dtype=np.float32) / SIDE**0.5).astype(np.float32)
            f.write(w.tobytes())
            t = numpy_helper.from_array(np.zeros((1,), np.float32), f"w{k}")
            t.ClearField("raw_data")
            t.ClearField("float_data")
            del t.dims[:]
            t.dims.extend([SIDE, SIDE])
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data.name), ("offset", offset), ("length", w.nbytes)):
                entry = t.external_data.add()
                entry.key, entry.value = key, str(value)
            offset += w.nbytes
            inits.append(t)
            src = "x" if k == 0 else f"h{k - 1}"
            out = "y" if k == layers - 1 else f"h{k}"
            nodes.append(helper.make_node("MatMul", [src, f"w{k}"], [out], name=f"mm{k}"))
    graph = helper.make_graph(
        nodes,
        "large",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SIDE])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, path)
    return path


def peak_of(argv: list[str]) -> tuple[int, float, int]:
    """(peak RSS bytes, seconds, exit status) of one command in a fresh child."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
        "time.perf_counter() - t, rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True
    )
    rss, secs, rc = out.stdout.split()
    return int(rss), float(secs), int(rc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="weights in GiB (default 1)")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--scratch", default=None, help="scratch folder (default: a temp dir)")
    args = parser.parse_args()
    layers = max(1, round(args.gib * 2**30 / LAYER_BYTES))
    mixprec = str(Path(sys.executable).with_name("mixprec"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mixprec-large-", dir=args.scratch) as tmp:
        folder = Path(tmp)
        t = time.perf_counter()
        model = build(folder, layers)
        weights = layers * LAYER_BYTES
        print(
            f"built {layers} x 256 MiB = {weights / 1e9:.2f} GB in {time.perf_counter() - t:.0f} s"
        )
        cases = {
            "calibrate": ([], 1.3, 300e6),
            "no-calibrate": (["--no-calibrate"], 1.1, 200e6),
        }
        for case, (extra, factor, margin) in cases.items():
            out = folder / f"out-{case}.onnx"
            argv = [
                mixprec,
                "convert",
                str(model),
                "-o",
                str(out),
                "--dtype",
                args.dtype,
                "--external-data",
                "-q",
                *extra,
            ]
            rss, secs, rc = peak_of(argv)
            target = factor * weights + margin
            rows.append(
                {
                    "case": case,
                    "weights_bytes": weights,
                    "peak_rss_bytes": rss,
                    "target_bytes": int(target),
                    "met": rc == 0 and rss <= target,
                    "seconds": round(secs, 1),
                    "exit": rc,
                }
            )
            print(
                f"{case:>13}: peak {rss / 1e9:.2f} GB (target <= {target / 1e9:.2f} GB, "
                f"{'met' if rss <= target else 'MISSED'}), {secs:.0f} s, exit {rc}"
            )
            for p in folder.glob("out-*"):
                p.unlink()
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
