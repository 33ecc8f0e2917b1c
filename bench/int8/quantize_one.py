"""Run ONE INT8 quantizer on ONE model; meant to run in its own subprocess (see int8.py).

    python -m bench.int8.quantize_one TOOL IN.onnx OUT.onnx RESULT.json --calib-dir DIR

DIR holds the calibration samples, one feed dict per .npz file, read in name order.
Tools:
  mixprec
      the default command: `python -m mixprec quantize IN -o OUT --calibration-data DIR --json`
      (range method mse, accuracy guard on, speed plan on)
  mixprec-minmax / -entropy / -percentile
      `python -m mixprec quantize IN -o OUT --calibration-data DIR --method M --json`
      (defaults otherwise: mode auto, activations auto, per-channel, speed auto)
  mixprec-minmax-bc
      mixprec-minmax with `--bias-correction` (measured on/off)
  mixprec-per-tensor / mixprec-per-tensor-cle
      the default command with `--per-tensor --no-equalize` / `--per-tensor --equalize`
      (cross-layer equalization measured on/off where it applies: per-tensor weights)
  mixprec-dynamic
      `python -m mixprec quantize IN -o OUT --calibration-data DIR --dynamic --json`
      (MatMul/Gemm weights per column offline, activations at run time; the samples only
      give the shapes)
  ort-s8s8   onnxruntime.quantization.quantize_static, its documented default (QDQ, QInt8
             activations and weights, MinMax) with per_channel=True, on the output of
             onnxruntime.quantization.shape_inference.quant_pre_process
  ort-u8s8   the same with activation_type=QuantType.QUInt8
  ort-dynamic onnxruntime.quantization.quantize_dynamic with its defaults (QInt8 weights,
             per tensor), no calibration
  nncf       nncf.quantize(onnx model, nncf.Dataset(samples)), ONNX backend, default preset
  mixprec-optimize
      `python -m mixprec optimize IN -o OUT --calibration-data DIR --threads 2 --json`
      (the bench's --optimize part, optimize.py; not one of the INT8 part's TOOLS)

Per-channel DequantizeLinear (its `axis`) needs ai.onnx opset 13. mixprec raises the opset
itself; ORT's quantize_static and NNCF do not (ORT writes `axis` into an opset-12 graph,
which neither the checker nor ORT loads), so for them a model below opset 13 is first
converted with onnx.version_converter.convert_version(model, 13), inside the timed span,
as a user would have to.

As in convert_one.py, `convert_s` covers reading IN, calibrating and quantizing, writing
OUT (ORT's pre-processing included); imports are reported apart (`import_s`); peak RSS is
the process's VmHWM. The mixprec CLI runs in this process through runpy, which is what
`python -m mixprec` executes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.precision.convert_one import Unavailable, measure_and_write, run_mixprec_cli

TOOLS = ("mixprec", "mixprec-metric", "mixprec-minmax", "mixprec-minmax-bc", "mixprec-entropy",
         "mixprec-percentile", "mixprec-dynamic", "mixprec-per-tensor", "mixprec-per-tensor-cle",
         "ort-s8s8", "ort-u8s8", "ort-dynamic", "nncf")


def samples(folder: str) -> Iterator[dict[str, Any]]:
    """The calibration feeds, one per .npz file, loaded one at a time."""
    import numpy as np

    for path in sorted(Path(folder).glob("*.npz")):
        with np.load(path) as data:
            yield {k: data[k] for k in data.files}


PER_CHANNEL_OPSET = 13


def opset13(model_path: str, folder: str) -> tuple[str, dict[str, Any]]:
    """``model_path``, or a copy converted to opset 13 in ``folder`` if it is below."""
    import onnx

    model = onnx.load(model_path)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= PER_CHANNEL_OPSET:
        return model_path, {}
    converted = onnx.version_converter.convert_version(model, PER_CHANNEL_OPSET)
    path = str(Path(folder) / "opset13.onnx")
    onnx.save(converted, path)
    return path, {"opset_upgraded": f"{opset} -> {PER_CHANNEL_OPSET} (onnx.version_converter)"}


def _mixprec(args: argparse.Namespace, method: str) -> Callable[[], dict[str, Any]]:
    special = {"dynamic": ["--dynamic"],
               "minmax-bc": ["--method", "minmax", "--bias-correction"],
               "per-tensor": ["--per-tensor", "--no-equalize"],
               "per-tensor-cle": ["--per-tensor", "--equalize"]}
    mode = special.get(method, ["--method", method] if method else [])
    if method == "metric":  # the defaults, judged by the model's own decisions (--metric)
        if not args.metric:
            raise Unavailable(
                "no task metric for this model (bench/harness/models.py decisions, text_map)")
        mode = ["--metric", args.metric, "--metric-budget", str(args.metric_budget)]
    argv = ["mixprec", "quantize", args.model, "-o", args.out, "--calibration-data",
            args.calib_dir, *mode, "--json"]
    return run_mixprec_cli(argv, "mixprec CLI")


def _ort_dynamic(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.quantization not importable: {exc}") from exc

    def run() -> dict[str, Any]:
        out = str(Path(args.out).resolve())
        source = str(Path(args.model).resolve())
        # it may write temporary models into the current directory: keep them in a temp one
        with tempfile.TemporaryDirectory(prefix="bench-ort-") as folder, contextlib.chdir(folder):
            quantize_dynamic(source, out, weight_type=QuantType.QInt8)
        return {"options": {"weight_type": "QInt8", "per_channel": "False"}}

    return run


def _ort(args: argparse.Namespace, unsigned: bool) -> Callable[[], dict[str, Any]]:
    try:
        from onnxruntime.quantization import (
            CalibrationDataReader,
            CalibrationMethod,
            QuantFormat,
            QuantType,
            quantize_static,
        )
        from onnxruntime.quantization.shape_inference import quant_pre_process
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.quantization not importable: {exc}") from exc

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = samples(str(Path(args.calib_dir).resolve()))

        def get_next(self) -> dict[str, Any] | None:
            return next(self.feeds, None)

    options = {"quant_format": QuantFormat.QDQ, "per_channel": True,
               "activation_type": QuantType.QUInt8 if unsigned else QuantType.QInt8,
               "weight_type": QuantType.QInt8, "calibrate_method": CalibrationMethod.MinMax}

    def run() -> dict[str, Any]:
        out = str(Path(args.out).resolve())
        with tempfile.TemporaryDirectory(prefix="bench-ort-") as folder:
            source, notes = opset13(args.model, folder)
            source = str(Path(source).resolve())
            pre = str(Path(folder).resolve() / "pre.onnx")
            reader = Reader()  # opens the calibration folder before the chdir
            # quant_pre_process and quantize_static write temporary models (and their
            # external data) into the current directory: keep them in the temp folder.
            with contextlib.chdir(folder):
                try:
                    quant_pre_process(source, pre)
                except Exception as exc:
                    # ORT's symbolic shape inference gives up on some models ("Incomplete
                    # symbolic shape inference"); ORT's documented way on is to skip that
                    # step, as a user would
                    notes["pre_process"] = f"skip_symbolic_shape=True ({type(exc).__name__})"
                    quant_pre_process(source, pre, skip_symbolic_shape=True)
                quantize_static(pre, out, reader, **options)
        return {"options": {k: str(v) for k, v in options.items()}, **notes}

    return run


def _nncf(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        import nncf
        import onnx
    except Exception as exc:
        raise Unavailable(f"nncf not importable: {exc}") from exc

    def run() -> dict[str, Any]:
        quantized, notes = nncf_onnx(args.model, list(samples(args.calib_dir)))
        onnx.save(quantized, args.out)
        return {"version": nncf.__version__, **notes}

    return run


def nncf_onnx(model_path: str, data: list[dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
    """nncf.quantize on the ONNX model (ONNX backend, default preset) over ``data``, the
    model raised to opset 13 first where below (:func:`opset13`): the quantized model and
    the notes on that conversion."""
    import nncf
    import onnx

    with tempfile.TemporaryDirectory(prefix="bench-nncf-") as folder:
        source, notes = opset13(model_path, folder)
        model = onnx.load(source)
    return nncf.quantize(model, nncf.Dataset(data), subset_size=len(data)), notes


#: the --optimize part's tool (optimize.py): run here the same way, not in the INT8 part
OPTIMIZE = "mixprec-optimize"


def _optimize(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    argv = ["mixprec", "optimize", args.model, "-o", args.out, "--calibration-data",
            args.calib_dir, "--threads", "2", "--json"]
    for shape in args.shape:
        argv += ["--shape", shape]
    if args.accept_unconfirmed:
        argv.append("--accept-unconfirmed")
    if args.eval_data:
        argv += ["--eval-data", args.eval_data]
    return run_mixprec_cli(argv, "mixprec optimize")


def build(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    if args.tool == OPTIMIZE:
        return _optimize(args)
    if args.tool == "mixprec" or args.tool.startswith("mixprec-"):
        return _mixprec(args, "" if args.tool == "mixprec" else args.tool.removeprefix("mixprec-"))
    if args.tool == "ort-dynamic":
        return _ort_dynamic(args)
    if args.tool in ("ort-s8s8", "ort-u8s8"):
        return _ort(args, unsigned=args.tool == "ort-u8s8")
    if args.tool == "nncf":
        return _nncf(args)
    raise Unavailable(f"unknown tool {args.tool}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one INT8 quantizer on one model.")
    parser.add_argument("tool", choices=(*TOOLS, OPTIMIZE))
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("result")
    parser.add_argument("--calib-dir", required=True, help="folder of one-sample .npz files")
    parser.add_argument("--metric", help="mixprec-metric: MODULE:FUNCTION for --metric")
    parser.add_argument("--metric-budget", type=float, default=0.99)
    parser.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                        help="mixprec-optimize: the serving shape of an input (repeatable)")
    parser.add_argument("--accept-unconfirmed", action="store_true",
                        help="mixprec-optimize: take passes too few held-out rows confirm")
    parser.add_argument("--eval-data", help="mixprec-optimize: held-out samples (a folder)")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"tool": args.tool, "model": args.model, "out": args.out}
    return measure_and_write(lambda: build(args), args.out, args.result, result, "quantizer")


if __name__ == "__main__":
    sys.exit(main())
