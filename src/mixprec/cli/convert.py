"""``mixprec convert``: its arguments and its command (see :func:`mixprec.convert`)."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.api.convert import convert
from mixprec.cli.options import (
    add_policy_args,
    add_runtime_args,
    calibration_data,
    convert_kwargs,
    load_feeds,
    progress,
)
from mixprec.cli.writing import add_output_args, checked_output, validate_and_write

__all__ = ["add_convert_parser", "cmd_convert"]


def add_convert_parser(sub: Any) -> argparse.ArgumentParser:
    c = sub.add_parser("convert", help="convert a model")
    c.add_argument("model", help="FP32 ONNX model")
    c.add_argument("-o", "--output", required=True, help="where to write the converted model")
    add_policy_args(c)
    c.add_argument(
        "--log-dir", help="write graphs before/after and paint buckets here; env MIXPREC_LOG_PATH"
    )
    c.add_argument(
        "--validate",
        action="store_true",
        help="compare with the FP32 model in onnxruntime before writing; a model out of "
        "tolerance is not written (an existing OUTPUT is left as it was) and the exit "
        "status is 1",
    )
    c.add_argument("--rtol", type=float, default=None, help="validation tolerance (rel. L2)")
    c.add_argument(
        "--no-check",
        action="store_true",
        help="bf16: skip the check every bf16 conversion gets without --validate (one more "
        "run of both models; a model that misses the tolerance is written and the last "
        "line says so)",
    )
    c.add_argument(
        "--keep-failed",
        action="store_true",
        help="with --validate: write a model that fails validation to OUTPUT's name with "
        "'.failed' before the suffix (e.g. out.failed.onnx), for inspection",
    )
    c.add_argument(
        "--external-data", action="store_true", help="write weights to OUTPUT.data beside the model"
    )
    add_output_args(c)
    add_runtime_args(c, "--validate")
    return c


def cmd_convert(args: argparse.Namespace) -> int:
    out = checked_output(args)
    feeds = load_feeds(args.inputs, args.model)
    result = convert(
        args.model,
        args.dtype,
        calibration_data=calibration_data(args, feeds),
        log_dir=args.log_dir,
        progress=progress(args.quiet or args.json),
        **convert_kwargs(args),
    )
    return validate_and_write(args, result, feeds, out)
