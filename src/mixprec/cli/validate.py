"""``mixprec validate``: compare a converted model with its FP32 original (exit 1 when out
of tolerance; see :func:`mixprec.validate`)."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.api.validate import validate
from mixprec.cli.options import (
    EXIT_VALIDATION_FAILED,
    add_input_args,
    add_quiet_arg,
    add_runtime_args,
    load_feeds,
    runtime_of,
)
from mixprec.core.jsonio import json_text
from mixprec.core.ops import DEFAULT_ATOL

__all__ = ["add_validate_parser", "cmd_validate"]


def add_validate_parser(sub: Any) -> argparse.ArgumentParser:
    v = sub.add_parser("validate", help="compare a converted model with the original")
    v.add_argument("original")
    v.add_argument("converted")
    add_input_args(v, calibration=False)
    v.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="max relative L2 error per output (default per dtype)",
    )
    v.add_argument(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        help="max abs error accepted where the reference is near zero (default %(default)g)",
    )
    v.add_argument("--mode", choices=("auto", "ort", "emulated"), default="auto")
    add_runtime_args(
        v,
        "the converted model (the FP32 original runs in onnxruntime); default: the runtime "
        "its metadata names (mixprec.runtime, written by mixprec optimize)",
    )
    v.add_argument("--json", action="store_true")
    add_quiet_arg(v)
    return v


def cmd_validate(args: argparse.Namespace) -> int:
    feeds = load_feeds(args.inputs, args.original)
    # no runtime named: the one the converted model's metadata names (else the default)
    given = (args.runtime, args.inference_precision, args.provider, args.performance_hint)
    named = given != (None, None, None, "latency")
    report = validate(
        args.original,
        args.converted,
        inputs=feeds,
        shapes=dict(args.shape) or None,
        rtol=args.rtol,
        atol=args.atol,
        mode=args.mode,
        runtime=runtime_of(args) if named else None,
        threads=args.threads,
    )
    if args.json:
        print(json_text(report.to_dict(), indent=2))
    else:
        print(report.format_table())
    return 0 if report.passed else EXIT_VALIDATION_FAILED
