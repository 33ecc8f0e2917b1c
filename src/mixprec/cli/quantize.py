"""``mixprec quantize``: its arguments and its command (see :func:`mixprec.quantize`)."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.api.quantize import quantize
from mixprec.cli.genai import add_genai_args, plan_genai, write_genai
from mixprec.cli.options import (
    add_accept_unconfirmed,
    add_input_args,
    add_output_kind,
    add_quiet_arg,
    add_runtime_args,
    calibration_data,
    load_feeds,
    progress,
    runtime_of,
    shape_arg,
)
from mixprec.cli.weight_only import add_weight_args, check_weight_args, cmd_weights
from mixprec.cli.writing import add_output_args, checked_output, validate_and_write
from mixprec.core.errors import MixprecError
from mixprec.int8.config import DEFAULT_SMOOTH
from mixprec.int8.params import METHODS

__all__ = ["add_quantize_parser", "cmd_quantize"]


def add_quantize_parser(sub: Any) -> argparse.ArgumentParser:
    q = sub.add_parser(
        "quantize",
        help="INT8 post-training quantization (static Q/DQ or dynamic), or weight-only "
        "INT4/INT8 (--weights)",
    )
    q.add_argument("model", help="FP32 ONNX model")
    q.add_argument("-o", "--output", required=True, help="where to write the INT8 model")
    q.add_argument(
        "--method",
        choices=METHODS,
        default="mse",
        help="activation ranges: mse (default: the clip of least squared quantization "
        "error), min/max, KL-divergence threshold, or 99.999th percentile",
    )
    q.add_argument(
        "--activation-type",
        choices=("auto", "u8", "s8"),
        default="auto",
        help="auto: uint8 activations, int8 weights (7-bit on x86 CPUs without VNNI)",
    )
    q.add_argument("--per-tensor", action="store_true", help="one weight scale per tensor")
    q.add_argument(
        "--mode",
        choices=("auto", "static", "dynamic"),
        default="auto",
        help="static: calibrated Q/DQ; dynamic: MatMul/Gemm weights INT8 here, activations "
        "per call at run time (no calibration needed); auto (default): dynamic when "
        "weighted MatMul/Gemm hold >= 80%% of the Conv/MatMul/Gemm MACs",
    )
    q.add_argument("--dynamic", action="store_true", help="same as --mode dynamic")
    q.add_argument(
        "--bias-correction",
        action="store_true",
        help="fold the mean output shift of weight rounding into Conv/Gemm biases",
    )
    q.add_argument(
        "--rounding",
        choices=("nearest", "learned"),
        default="nearest",
        help="INT8 weight rounding: nearest (default), or learned: AdaRound per layer on "
        "inputs captured from the first calibration samples (slower; static mode)",
    )
    q.add_argument(
        "--equalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cross-layer equalization before calibration: rescale Conv/Gemm channel pairs "
        "so both weights use their INT8 grid alike (default: on with --per-tensor)",
    )
    smooth = q.add_mutually_exclusive_group()
    smooth.add_argument(
        "--smooth",
        nargs="?",
        const="auto",
        default=None,
        metavar="ALPHA|auto",
        help="SmoothQuant: divide the outlier channels of MatMul/Gemm inputs, the weights "
        "multiplied to match; auto (the default with calibration data) searches alpha per "
        "input and smooths where it lowers the INT8 error; ALPHA in (0, 1) fixes it",
    )
    smooth.add_argument("--no-smooth", dest="smooth", action="store_const", const="off")
    q.add_argument(
        "--fallback",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="precision of the nodes left out of INT8 (fp16/bf16: painted around the "
        "integer kernels, as convert paints)",
    )
    q.add_argument(
        "--speed",
        choices=("auto", "off"),
        default="auto",
        help="auto: time candidate INT8 placements here against the input model and keep "
        "the fastest (the model stays as given unless one is clearly faster); off: quantize "
        "every node the plan allows",
    )
    q.add_argument(
        "--latency-shape",
        action="append",
        type=shape_arg,
        default=[],
        metavar="NAME=D0,D1,...",
        help="input shape the speed plan times at, e.g. your serving batch (repeatable; "
        "default: --shape, else the calibration sample's shape)",
    )
    q.add_argument(
        "--exclude", action="append", default=[], metavar="REGEX", help="node kept float"
    )
    q.add_argument("--no-fold-batchnorm", action="store_true")
    add_input_args(q)
    q.add_argument("--log-dir", help="write graphs and the report here")
    _add_check_args(q)
    q.add_argument("--external-data", action="store_true", help="write weights to OUTPUT.data")
    q.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    add_quiet_arg(q)
    add_output_args(q)
    add_runtime_args(q, "the speed plan and the accuracy guard (the deployment's)")
    _add_weight_only_args(q)
    return q


def _add_weight_only_args(q: argparse.ArgumentParser) -> None:
    """``--weights`` and its options, and ``--genai`` (which needs it)."""
    add_weight_args(q)
    add_genai_args(q)


def _add_check_args(p: argparse.ArgumentParser) -> None:
    """--validate, --keep-failed and the accuracy guard's options."""
    p.add_argument("--validate", action="store_true", help="compare with FP32 before writing")
    p.add_argument("--rtol", type=float, default=None, help="validation tolerance (rel. L2)")
    p.add_argument(
        "--keep-failed",
        action="store_true",
        help="keep a model that fails the accuracy guard or --validate, as OUTPUT.failed.onnx",
    )
    p.add_argument(
        "--eval-data",
        metavar="PATH",
        help="samples the accuracy guard checks the INT8 model on (forms as "
        "--calibration-data; arrays that are not model inputs are labels for --metric); "
        "default: a seeded random half of the calibration samples (at most 64, or enough "
        "for 300 rows), held out",
    )
    p.add_argument(
        "--max-drop",
        type=float,
        default=None,
        metavar="X",
        help="the guard's accepted top-1 drop: agreement with FP32 >= 1-X on class scores "
        "(default 0.01)",
    )
    p.add_argument(
        "--max-rel-l2",
        type=float,
        default=None,
        metavar="Y",
        help="the guard's bound on the relative L2 error of other outputs (default 0.1)",
    )
    p.add_argument(
        "--min-cosine",
        type=float,
        default=None,
        metavar="C",
        help="the guard's bound on embeddings (pooled, normalized, named like one, or rows "
        "of 8+ features without class structure): cosine to FP32 of each row >= C "
        "(default 0.99; the share of such rows >= 1 - --max-drop)",
    )
    add_output_kind(p)
    add_accept_unconfirmed(p, "the input is written unchanged")
    p.add_argument(
        "--metric",
        metavar="MODULE:FUNCTION",
        default=None,
        help="the guard judges by your own function instead of the per-output checks: "
        "FUNCTION(fp32_outputs, int8_outputs[, labels]) gets one dict of outputs per held-out "
        "sample (labels: one dict per sample of its arrays that are not model inputs) and "
        "returns a score, higher is better (MODULE importable, or FILE.py)",
    )
    p.add_argument(
        "--metric-budget",
        type=float,
        default=None,
        metavar="S",
        help="with --metric: the lowest accepted score",
    )
    p.add_argument(
        "--no-guard",
        action="store_true",
        help="skip the accuracy guard (warns: the INT8 model is not checked against FP32)",
    )


def _budget(value: float | None, flag: str) -> float | None:
    """A guard budget checked under the flag's own name (not the API field's)."""
    if value is not None and not 0.0 < value < 1.0:
        raise MixprecError(f"{flag} must lie in (0, 1), got {value:g}")
    return value


def _smooth(value: str | None) -> float | str | None:
    """``--smooth [ALPHA|auto]`` / ``--no-smooth`` as the ``smooth`` option."""
    if value is None:
        return DEFAULT_SMOOTH
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        alpha = float(value)
    except ValueError:
        alpha = -1.0
    if not 0.0 < alpha < 1.0:
        raise MixprecError(f"--smooth takes 'auto' or an alpha in (0, 1), not {value!r}")
    return alpha


def cmd_quantize(args: argparse.Namespace) -> int:
    check_weight_args(args)
    out = checked_output(args)
    genai = plan_genai(args, out)
    feeds = load_feeds(args.inputs, args.model)
    if args.weights is not None:
        status = cmd_weights(args, out, feeds)
        if status == 0 and genai is not None:
            write_genai(genai, out, quiet=args.quiet or args.json)
        return status
    result = quantize(
        args.model,
        calibration_data(args, feeds, labels=True),
        method=args.method,
        activations=args.activation_type,
        per_channel=not args.per_tensor,
        exclude_nodes=tuple(args.exclude),
        shapes=dict(args.shape),
        fold_batchnorm=not args.no_fold_batchnorm,
        log_dir=args.log_dir,
        speed=args.speed,
        latency_shapes=dict(args.latency_shape),
        mode="dynamic" if args.dynamic else args.mode,
        fallback=args.fallback,
        bias_correction=args.bias_correction,
        rounding=args.rounding,
        equalize="auto" if args.equalize is None else args.equalize,
        smooth=_smooth(args.smooth),
        guard=not args.no_guard,
        max_drop=_budget(args.max_drop, "--max-drop"),
        max_rel_l2=_budget(args.max_rel_l2, "--max-rel-l2"),
        min_cosine=_budget(args.min_cosine, "--min-cosine"),
        output_kinds=args.output_kind or {},
        accept_unconfirmed=args.accept_unconfirmed,
        metric=args.metric,
        metric_budget=args.metric_budget,
        eval_data=args.eval_data,
        runtime=runtime_of(args),
        progress=progress(args.quiet or args.json),
    )
    return validate_and_write(args, result, feeds, out)
