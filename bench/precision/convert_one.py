"""Run ONE converter on ONE model; meant to run in its own subprocess (see bench.main).

    python -m bench.precision.convert_one CONVERTER DTYPE IN.onnx OUT.onnx RESULT.json
        [--calib FILE.npz] [--calib-dir DIR] [--shape NAME=D0,D1,...]...

Converters (inputs and outputs of the model stay float32 in every case):
  mixprec         `python -m mixprec convert IN -o OUT --dtype D --json --inputs FILE.npz`
  mixprec-nocal   the same with --no-calibrate (and no --inputs)
  onnxconverter-common   onnxconverter_common.float16.convert_float_to_float16(keep_io_types)
  ort-float16     onnxruntime.transformers.float16.convert_float_to_float16(keep_io_types)
  modelopt        modelopt.onnx.autocast.convert_to_mixed_precision(keep_io_types,
                  calibration_data=DIR of .npz, providers=["cpu"])

The mixprec CLI runs in this process through runpy (exactly what `python -m mixprec`
executes) after its package has been imported, so that `convert_s` covers the same span
for every converter: reading IN, converting, writing OUT; interpreter start-up and
library imports are reported separately (`import_s`). Peak RSS is the process's VmHWM
(/proc/self/status) at the end; the parent also samples it while waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import runpy
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.common import vm_hwm_mb

CONVERTERS = ("mixprec", "mixprec-nocal", "onnxconverter-common", "ort-float16", "modelopt")
FP16_ONLY = ("onnxconverter-common", "ort-float16")


class Unavailable(Exception):
    """The converter cannot be imported or does not exist in this environment."""


def measure_and_write(
    build: Callable[[], Callable[[], dict[str, Any]]],
    out: str,
    result_path: str,
    result: dict[str, Any],
    what: str,
) -> int:
    """Import (``build``), run and time one tool writing ``out``; every outcome, failures
    included, goes to ``result_path`` as JSON with the process's peak RSS."""
    start = time.perf_counter()
    try:
        run = build()
        result["import_s"] = time.perf_counter() - start
        result["rss_after_import_mb"] = vm_hwm_mb()
        Path(out).unlink(missing_ok=True)
        begin = time.perf_counter()
        result.update(run())
        result["convert_s"] = time.perf_counter() - begin
        if not Path(out).is_file():
            raise RuntimeError(f"{what} reported success but wrote no model")
        result["status"] = "ok"
    except Unavailable as exc:
        result.update(status="unavailable", error=str(exc))
    except BaseException as exc:  # every failure is a result to report
        result.update(status="error", error=f"{type(exc).__name__}: {exc}"[:3000],
                      traceback=traceback.format_exc()[-4000:])
    result["vm_hwm_mb"] = vm_hwm_mb()
    Path(result_path).write_text(json.dumps(result, indent=2, default=str))
    return 0


def run_mixprec_cli(argv: list[str], needs: str = "mixprec CLI") -> Callable[[], dict[str, Any]]:
    """A callable that runs ``python -m mixprec ARGV`` in this process (runpy) and returns
    its parsed ``--json`` report; raises Unavailable if mixprec or its CLI cannot be imported.
    """
    try:
        import mixprec
    except ImportError as exc:
        raise Unavailable(f"mixprec not importable: {exc}") from exc
    if importlib.util.find_spec("mixprec.cli.main") is None:
        raise Unavailable(f"{needs} not available yet (no mixprec.cli.main)")
    try:
        import mixprec.cli.main  # import cost stays out of convert_s
    except Exception as exc:
        raise Unavailable(f"{needs} not available yet: {exc}") from exc

    def run() -> dict[str, Any]:
        out, err = io.StringIO(), io.StringIO()
        old_argv = sys.argv
        sys.argv = argv
        code: Any = 0
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                runpy.run_module("mixprec", run_name="__main__", alter_sys=False)
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.argv = old_argv
        info: dict[str, Any] = {"argv": ["python", "-m", *argv], "exit_code": code,
                                "version": getattr(mixprec, "__version__", "?")}
        text = out.getvalue().strip()
        try:
            report = json.loads(text) if text else None
            if isinstance(report, dict):
                # per-node entries stay in mixprec's own --json output, not in the bench row
                report["nodes"] = len(report.get("nodes") or [])
            info["report"] = report
        except json.JSONDecodeError:
            info["stdout_tail"] = text[-2000:]
        if code not in (0, None):
            tail = (err.getvalue().strip() or text)[-1500:]
            raise RuntimeError(f"mixprec exited with {code}: {tail}")
        return info

    return run


def _mixprec(args: argparse.Namespace, calibrate: bool) -> Callable[[], dict[str, Any]]:
    argv = ["mixprec", "convert", args.model, "-o", args.out, "--dtype", args.dtype, "--json"]
    if calibrate and args.calib:
        argv += ["--inputs", args.calib]
    if not calibrate:
        argv.append("--no-calibrate")
    for shape in args.shape:
        argv += ["--shape", shape]
    return run_mixprec_cli(argv)


def _onnx_loader_converter(convert: Callable[..., Any], args: argparse.Namespace):
    import onnx

    def run() -> dict[str, Any]:
        model = onnx.load(args.model)
        converted = convert(model, keep_io_types=True)
        onnx.save(converted, args.out)
        return {}

    return run


def _onnxconverter_common(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        from onnxconverter_common.float16 import convert_float_to_float16
    except ImportError as exc:
        raise Unavailable(f"onnxconverter-common not importable: {exc}") from exc
    return _onnx_loader_converter(convert_float_to_float16, args)


def _ort_float16(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError as exc:
        raise Unavailable(f"onnxruntime.transformers not importable: {exc}") from exc
    return _onnx_loader_converter(convert_float_to_float16, args)


def _modelopt(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    try:
        import onnx
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except Exception as exc:
        raise Unavailable(f"nvidia-modelopt AutoCast not importable: {exc}") from exc

    def run() -> dict[str, Any]:
        converted = convert_to_mixed_precision(
            onnx_path=args.model,
            low_precision_type=args.dtype,
            keep_io_types=True,
            calibration_data=args.calib_dir,
            providers=["cpu"],
        )
        onnx.save(converted, args.out)
        return {"calibration_data": args.calib_dir}

    return run


def build(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    if args.converter in FP16_ONLY and args.dtype != "fp16":
        raise Unavailable(f"{args.converter} converts to fp16 only")
    if args.converter == "mixprec":
        return _mixprec(args, calibrate=True)
    if args.converter == "mixprec-nocal":
        return _mixprec(args, calibrate=False)
    if args.converter == "onnxconverter-common":
        return _onnxconverter_common(args)
    if args.converter == "ort-float16":
        return _ort_float16(args)
    if args.converter == "modelopt":
        return _modelopt(args)
    raise Unavailable(f"unknown converter {args.converter}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one converter on one model.")
    parser.add_argument("converter", choices=CONVERTERS)
    parser.add_argument("dtype", choices=("fp16", "bf16"))
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("result")
    parser.add_argument("--calib", help="calibration inputs, one .npz")
    parser.add_argument("--calib-dir", help="folder holding that .npz (for ModelOpt)")
    parser.add_argument("--shape", action="append", default=[], help="NAME=D0,D1,...")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"converter": args.converter, "dtype": args.dtype,
                              "model": args.model, "out": args.out}
    return measure_and_write(lambda: build(args), args.out, args.result, result, "converter")


if __name__ == "__main__":
    raise SystemExit(main())
