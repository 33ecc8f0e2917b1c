"""INT8 Q/DQ layouts in OpenVINO under the bf16 hint (issue 43): the same all-INT8 model
laid out as ONNX Runtime fuses it and as OpenVINO does (``mixprec.int8.layout``), beside
OpenVINO's blanket bf16 hint and NNCF's INT8, in one interleaved loop per model.

    .venv-bench/bin/python -m bench.int8.layout [MODEL,MODEL ...]

Variants (every one compiled by OpenVINO for the model's bench shape, hint bf16: a CPU
without bf16 computes f32, and the page says which CPU ran):

  bf16              the FP32 model (the reference, ratio 1.00)
  nncf              nncf.quantize (OpenVINO backend, default preset, the same samples)
  ort-layout        mixprec.quantize(speed="off", runtime="ort"): pairs after each INT8
                    op's output, INT8 chains through the ops without weights
  ov-layout-chains  runtime="openvino", placement "chains": the FakeQuantize layout
  ov-layout         runtime="openvino", placement "weighted": layer inputs only
  nncf-onnx         nncf.quantize on the ONNX model (ONNX backend), as the optimize part's
                    ov-nncf recipe makes it

The guard is off (speed only); calibration is the INT8 part's 16 samples.
Writes bench/results/<date>-int8-layout.{json,md}.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx_ir as ir

import mixprec
from bench.harness.common import RESULTS_DIR, cpu_summary
from bench.harness.evaluate import first_line
from bench.harness.models import MODELS, ModelSpec, int8_calibration
from bench.int8.quantize_one import nncf_onnx
from bench.precision.bf16 import interleaved, ov_runner

DEFAULT_MODELS = ("mtcnn_onet", "mtcnn_rnet", "ppocr_det", "ppocr_cls", "mnist_cnn")
#: variant -> (runtime, placement) of mixprec.quantize
MIXPREC = {
    "ort-layout": ("ort", "chains"),
    "ov-layout-chains": ("openvino", "chains"),
    "ov-layout": ("openvino", "weighted"),
}


def _nncf(spec: ModelSpec, calibration: list[dict[str, Any]], out: Path) -> Path:
    import nncf
    import openvino as ov

    model = ov.Core().read_model(str(spec.path()))
    shapes = {k: v.shape for k, v in spec.make_inputs("eval").items()}
    if all(s[k].shape == shapes[k] for s in calibration for k in shapes):
        model.reshape(shapes)
    quantized = nncf.quantize(model, nncf.Dataset(calibration), subset_size=len(calibration))
    ov.save_model(quantized, str(out))
    return out


def _nncf_onnx(spec: ModelSpec, calibration: list[dict[str, Any]], out: Path) -> Path:
    import onnx

    quantized, _ = nncf_onnx(str(spec.path()), calibration)
    onnx.save(quantized, str(out))
    return out


def _models(spec: ModelSpec, folder: Path) -> dict[str, Path]:
    calibration = int8_calibration(spec)
    paths = {"bf16": spec.path(), "nncf": _nncf(spec, calibration, folder / "nncf.xml")}
    paths["nncf-onnx"] = _nncf_onnx(spec, calibration, folder / "nncf-onnx.onnx")
    for name, (runtime, placement) in MIXPREC.items():
        result = mixprec.quantize(
            str(spec.path()), calibration, speed="off", guard=False,
            runtime=runtime, placement=placement,
        )  # fmt: skip
        paths[name] = folder / f"{name}.onnx"
        ir.save(result.model, paths[name])
    return paths


def measure(spec: ModelSpec) -> dict[str, Any]:
    feeds = spec.make_inputs("eval")
    if spec.latency_batch:
        feeds = {k: v[: spec.latency_batch] for k, v in feeds.items()}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-layout-") as tmp:
        calls = {}
        for name, path in _models(spec, Path(tmp)).items():
            try:  # OpenVINO's LPT throws on some layouts (PP-OCR cls): a row, not a crash
                call = ov_runner(path, "bf16").bind(feeds)
                call()
            except Exception as exc:
                errors[name] = first_line(exc)
                continue
            calls[name] = call
        timing = interleaved(calls, "bf16", shuffle=True)
    ms = timing["ms"]
    return {
        "model": spec.name,
        "ms": {k: round(v, 4) for k, v in ms.items()},
        "ratio": {k: round(v / ms["bf16"], 3) for k, v in ms.items()},
        "errors": errors,
        "rounds": timing["rounds"],
    }


def render(rows: list[dict[str, Any]]) -> str:
    names = ["bf16", "nncf", *MIXPREC]
    lines = [
        f"# INT8 Q/DQ layouts in OpenVINO under the bf16 hint ({time.strftime('%Y-%m-%d')})",
        "",
        f"CPU: {cpu_summary()}. Command: `.venv-bench/bin/python -m bench.int8.layout`. "
        "Ratio = median latency / the FP32 model's under the same hint, in one interleaved "
        "loop per model (every variant compiled by OpenVINO at the bench shape, 2 threads, "
        "hint bf16). All-INT8 models, guard off: speed only.",
        "",
        "| model | " + " | ".join(names) + " | rounds |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        cells = [
            f"{r['ratio'][n]:.2f}x ({r['ms'][n]:.2f} ms)" if n in r["ratio"] else "fails"
            for n in names
        ]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + f" | {r['rounds']} |")
    failed = [f"- {r['model']} {name}: {why}" for r in rows for name, why in r["errors"].items()]
    if failed:
        lines += ["", "OpenVINO could not compile:", *failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    wanted = argv[0].split(",") if argv else list(DEFAULT_MODELS)
    specs = [m for name in wanted for m in MODELS if m.name == name]
    rows = []
    for spec in specs:
        rows.append(measure(spec))
        print(json.dumps(rows[-1]), flush=True)
    stem = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-int8-layout"
    stem.with_suffix(".json").write_text(json.dumps({"cpu": cpu_summary(), "rows": rows}, indent=1))
    stem.with_suffix(".md").write_text(render(rows))
    print(f"wrote {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
