"""``mixprec tune``: the command line of :func:`mixprec.tune`.

Exit status 0 when the budget is met (the model is written), 1 when it is not (nothing
is written; one line on stderr says why), 2/3 for errors as in the other commands.
With ``--json`` stdout holds one JSON object and nothing else.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mixprec.api.tune import tune
from mixprec.cli.options import (
    EXIT_VALIDATION_FAILED,
    FORMS,
    add_quiet_arg,
    add_shape_arg,
    progress,
)
from mixprec.cli.writing import checked_output
from mixprec.core.jsonio import json_text
from mixprec.inputs.feeds import iter_calibration_npz
from mixprec.io.models import load_model
from mixprec.tune.targets import FLOAT_MODES

__all__ = ["add_tune_parser", "cmd_tune"]


def _budget(text: str) -> float | str:
    """A number, or ``N%`` (a relative drop, for callables; refused later otherwise)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_tune_parser(sub: Any) -> argparse.ArgumentParser:
    t = sub.add_parser(
        "tune", help="the most low-precision/INT8 model that meets an accuracy budget"
    )
    t.add_argument("model", help="FP32 ONNX model")
    t.add_argument("-o", "--output", required=True, help="where to write the tuned model")
    t.add_argument("--dtype", default="fp16", help="fp16 (default), bf16 or int8")
    t.add_argument(
        "--inputs",
        required=True,
        metavar="PATH",
        help=f"samples the metric is measured on: {FORMS}",
    )
    t.add_argument(
        "--calibration-data",
        metavar="PATH",
        help="calibration samples, same forms (default: the --inputs samples)",
    )
    t.add_argument(
        "--metric",
        default="rel-l2",
        metavar="NAME|MODULE:FUNCTION",
        help="comparison with the FP32 outputs: rel-l2 (default), max-abs, top1, cosine; or "
        "your own FUNCTION(fp32_outputs, outputs[, labels]) with --metric-budget, as "
        "quantize's --metric (labels: the --inputs arrays that are not model inputs)",
    )
    t.add_argument(
        "--metric-budget",
        type=float,
        default=None,
        metavar="S",
        help="with --metric MODULE:FUNCTION: the lowest accepted score",
    )
    t.add_argument(
        "--budget",
        type=_budget,
        default=None,
        help="bound on the metric: the largest rel-l2/max-abs, the smallest top1/cosine "
        "(default: rel-l2 1e-2 fp16, 8e-2 bf16, 1e-1 int8; top1 0.99)",
    )
    t.add_argument("--max-evaluations", type=int, default=None, metavar="N")
    t.add_argument(
        "--mode",
        choices=FLOAT_MODES,
        default="emulated",
        help="emulated (default): fp16/bf16 candidates run in float32 with every low "
        "tensor rounded; ort: fp16 as is on ONNX Runtime's CPU provider; openvino: as is "
        "in OpenVINO (bf16 on real bf16 kernels where the CPU has them)",
    )
    add_shape_arg(t)
    t.add_argument("--log-dir", help="write tune.json and tune.png (metric vs MAC share) here")
    t.add_argument("--external-data", action="store_true", help="write weights to OUTPUT.data")
    t.add_argument("--json", action="store_true", help="one JSON object on stdout")
    add_quiet_arg(t)
    t.set_defaults(validate=False, keep_failed=False)
    return t


def cmd_tune(args: argparse.Namespace) -> int:
    out = checked_output(args)
    original = load_model(args.model)
    samples = list(iter_calibration_npz(args.inputs, original, labels=True))
    calibration = (
        iter_calibration_npz(args.calibration_data, original) if args.calibration_data else None
    )
    options: dict[str, Any] = {}
    if args.shape:
        options["shapes"] = dict(args.shape)
    result = tune(
        args.model,
        args.dtype,
        samples,
        metric=args.metric,
        budget=args.budget,
        metric_budget=args.metric_budget,
        calibration_data=calibration,
        max_evaluations=args.max_evaluations,
        mode=args.mode,
        progress=progress(args.quiet or args.json),
        log_dir=args.log_dir,
        **options,
    )
    if result.passed:
        result.save(out, external_data=args.external_data)
    if args.json:
        data = result.to_dict()
        data["output"] = str(out) if result.passed else None
        print(json_text(data, indent=2))
    else:
        if not args.quiet:
            print(result.format_summary())
        if result.passed:
            print(f"wrote {out}")
    if result.passed:
        return 0
    sys.stdout.flush()
    print(f"mixprec: tune: budget {result.message}; {out} not written", file=sys.stderr)
    return EXIT_VALIDATION_FAILED
