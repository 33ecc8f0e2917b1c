"""``mixprec optimize``: its arguments and its command (see :func:`mixprec.optimize`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mixprec.api.optimize import optimize
from mixprec.cli.options import (
    FORMS,
    add_accept_unconfirmed,
    add_output_kind,
    add_quiet_arg,
    add_shape_arg,
    progress,
)
from mixprec.core.errors import MixprecError
from mixprec.core.jsonio import json_text
from mixprec.inputs.samples import NpzSamples
from mixprec.io.models import check_output_path, load_model
from mixprec.optimize.candidates import CANDIDATES, RUNTIME_CHOICES
from mixprec.optimize.device import DEVICES, check_device
from mixprec.report.optimize_page import write_optimize_html

__all__ = ["add_optimize_parser", "cmd_optimize"]


def add_optimize_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "optimize",
        help="try every precision in every runtime, guarded and timed here; write the "
        "fastest accurate one with how to run it",
    )
    p.add_argument("model", help="FP32 ONNX model")
    p.add_argument("-o", "--output", required=True, help="where to write the chosen model")
    p.add_argument(
        "--calibration-data",
        metavar="PATH",
        help=f"samples to calibrate INT8 on, check every candidate on (a seeded random half, "
        f"at most 64, or enough for 300 rows, held out) and time at (the first sample's "
        f"shape): {FORMS}. Without "
        "it: generated inputs, no INT8, every candidate held to convert's rel L2",
    )
    p.add_argument(
        "--eval-data",
        metavar="PATH",
        help="samples to check the candidates on instead of the held-out half (arrays "
        "that are not model inputs are labels for --metric)",
    )
    p.add_argument(
        "--metric",
        metavar="MODULE:FUNCTION",
        default=None,
        help="judge candidates by your own function instead of the per-output checks: "
        "FUNCTION(fp32_outputs, outputs[, labels]) returns a score, higher is better",
    )
    p.add_argument(
        "--metric-budget", type=float, default=None, metavar="S", help="with --metric: "
        "the lowest accepted score",
    )  # fmt: skip
    add_output_kind(p)
    add_accept_unconfirmed(p, "such a candidate loses")
    p.add_argument(
        "--runtime",
        choices=RUNTIME_CHOICES,
        default="auto",
        help="auto (default): every runtime installed; ort or openvino: only its candidates "
        "(an error when it is not installed)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEVICE",
        help=f"{'|'.join(DEVICES)}: cpu (default) tries every runtime's CPU candidates; cuda "
        "or tensorrt tries the input, fp16 and bf16 in ONNX Runtime on that provider "
        "(onnxruntime-gpu; an error when it is not installed), timed beside the input there",
    )
    p.add_argument(
        "--threads", type=int, default=2, metavar="N", help="intra-op threads (0: all cores)"
    )
    p.add_argument(
        "--candidates",
        metavar="LIST",
        default=None,
        help=f"comma-separated subset of {','.join(c.name for c in CANDIDATES)} (with "
        "--device cuda: fp32-cuda,fp16-cuda,bf16-cuda; default: all; without the fp32 one "
        "the input is the reference only)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="seconds for timing all candidates (building and checking them not counted); "
        "default about a second each",
    )
    add_shape_arg(
        p,
        help="the serving shape of an input: every candidate (and the INT8 speed plan) is "
        "timed at it, symbolic dims included (repeatable; default: the first calibration "
        "sample's shape)",
    )
    p.add_argument(
        "--report",
        metavar="PAGE.html",
        default=None,
        help="also write an HTML page: the candidate table above the chosen model's graph",
    )
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    add_quiet_arg(p)
    return p


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise MixprecError("--candidates is empty: name at least one candidate")
    return names


def cmd_optimize(args: argparse.Namespace) -> int:
    out = check_output_path(args.output)  # before any work: a writable folder, not the input
    if Path(args.model).exists() and out.exists() and out.resolve() == Path(args.model).resolve():
        raise MixprecError(f"{out}: output would overwrite the input model")
    if args.threads < 0:
        raise MixprecError(f"--threads must be >= 0 (0: all cores), got {args.threads}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise MixprecError(f"--time-budget must be > 0 seconds, got {args.time_budget:g}")
    check_device(args.device)  # before any work: a device whose provider is here
    page = None if args.report is None else check_output_path(args.report)
    if page is not None and page.resolve() in (out.resolve(), Path(args.model).resolve()):
        raise MixprecError(f"{page}: --report would overwrite the model")
    calibration = None
    if args.calibration_data is not None:
        calibration = NpzSamples(args.calibration_data, load_model(args.model), labels=True)
    result = optimize(
        args.model,
        calibration,
        eval_data=args.eval_data,
        runtime=args.runtime,
        device=args.device,
        threads=args.threads,
        candidates=_names(args.candidates),
        metric=args.metric,
        metric_budget=args.metric_budget,
        time_budget=args.time_budget,
        shapes=dict(args.shape) or None,
        progress=progress(args.quiet or args.json),
        output_kinds=args.output_kind,
        accept_unconfirmed=args.accept_unconfirmed,
    )
    files = result.save(out)  # an OpenVINO IR beside it where the winner has marks
    if page is not None:
        write_optimize_html(result, page)
    if args.json:
        written = {"output": str(out), "report": None if page is None else str(page)}
        print(json_text({**result.to_dict(), **written}, indent=2))
        return 0
    for path in files:
        print(f"wrote {path}")
    if page is not None:
        print(f"wrote {page}")
    if not args.quiet:  # the last lines: every candidate, then the winner
        for note in result.notes:
            print(f"note: {note}")
        print(result.format_table())
    print(f"mixprec: {result.summary}")
    return 0
