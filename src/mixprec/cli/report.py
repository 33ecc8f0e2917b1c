"""``mixprec report IN.onnx [--dtype fp16|bf16|int8] -o report.html``: paint (for int8:
plan) without writing a model and draw the page (the page itself: :mod:`mixprec.report`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from mixprec.api.convert import annotate
from mixprec.api.quantize import plan_int8
from mixprec.cli.options import (
    add_policy_args,
    calibration_data,
    convert_kwargs,
    dtype_of,
    load_feeds,
    progress,
)
from mixprec.cli.writing import check_output_args, write_outputs
from mixprec.core.jsonio import json_text
from mixprec.io.models import check_output_path
from mixprec.pipeline.report import Report

__all__ = ["add_report_parser", "cmd_report"]


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
    r = sub.add_parser(
        "report",
        help="draw the painted graph as one HTML page (no model written)",
        description="Paint (for int8: plan) without writing a model and draw the graph as "
        "one self-contained HTML page.",
    )
    r.add_argument("model", help="FP32 ONNX model")
    r.add_argument("-o", "--output", required=True, metavar="FILE.html", help="the page")
    add_policy_args(r)  # --dtype also takes int8 here
    r.add_argument(
        "--model-explorer", metavar="FILE.json", help="also write Model Explorer node data"
    )
    return r


def _int8_plan(args: argparse.Namespace, calibration_data: Any, say: Any) -> tuple[Any, Report]:
    """The FP32 model annotated with the INT8 plan (every node the plan allows)."""
    return plan_int8(
        args.model,
        calibration_data,
        progress=say,
        exclude_nodes=tuple(args.exclude or ()),
        shapes=dict(args.shape),
        fold_batchnorm=not args.no_fold_batchnorm,
    )


def run_report(
    args: argparse.Namespace, options: dict[str, Any], calibration_data: Any, say: Any
) -> int:
    """``mixprec report``: paint or plan, draw, print where the page went."""
    check_output_path(args.output)
    check_output_args(args)
    if dtype_of(args) == "int8":
        model, report = _int8_plan(args, calibration_data, say)
    else:
        result = annotate(
            args.model, args.dtype, calibration_data=calibration_data, progress=say, **options
        )
        model, report = result.model, result.report
    written = write_outputs(args, model, report, converted=False)
    if args.json:
        print(json_text({"report": written[0], "written": written, **report.to_dict()}, indent=2))
    else:
        if not args.quiet:
            print(report.format_summary())
        for path in written:
            print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    feeds = load_feeds(args.inputs, args.model)
    say = progress(args.quiet or args.json)
    return run_report(args, convert_kwargs(args), calibration_data(args, feeds), say)
