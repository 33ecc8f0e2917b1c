"""What the commands share: exit statuses, argument groups, the dtype rule, progress and
input loading. Every command module imports this one; it imports no command."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from mixprec.core.ops import parse_dtype
from mixprec.core.readings import KIND_NAMES
from mixprec.inputs.feeds import iter_calibration_npz
from mixprec.inputs.samples import NpzSamples
from mixprec.io.models import load_model
from mixprec.runtime.engine import PERFORMANCE_HINTS, PRECISIONS, RuntimeOptions, runtime_names
from mixprec.runtime.engines import engine_for, runtime_taking

__all__ = [
    "EXIT_ERROR",
    "EXIT_INTERNAL_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_VALIDATION_FAILED",
    "FORMS",
    "LISTS",
    "add_debug_arg",
    "add_input_args",
    "add_output_kind",
    "add_policy_args",
    "add_quiet_arg",
    "add_runtime_args",
    "add_shape_arg",
    "calibration_data",
    "convert_kwargs",
    "dtype_of",
    "load_feeds",
    "progress",
    "runtime_of",
    "shape_arg",
]

EXIT_VALIDATION_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERNAL_ERROR = 3
EXIT_INTERRUPTED = 130

#: The four op lists, as the ``--LIST-add`` / ``--LIST-remove`` options name them.
LISTS = ("allow", "deny", "infer", "clear")

#: The forms every command's --inputs / --calibration-data / --eval-data take.
FORMS = (
    "an .npz of one sample, an .npz whose arrays have a leading sample axis, or a folder "
    "of .npz files (one sample each)"
)

QUIET_HELP = (
    "print only what was written (no summary table, no progress, no warnings from other "
    "libraries such as onnx or onnxruntime)"
)


def shape_arg(text: str) -> tuple[str, list[int]]:
    name, sep, dims = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=D0,D1,..., got {text!r}")
    try:
        values = [int(d) for d in dims.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"dims must be integers in {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"dims must be positive in {text!r}")
    return name, values


def _ops(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def dtype_of(args: argparse.Namespace) -> str | None:
    """``--dtype`` (else ``MIXPREC_DTYPE``) as its canonical name, parsed by the one rule
    every command follows (:func:`mixprec.core.ops.parse_dtype`); None when neither."""
    name = getattr(args, "dtype", None) or os.environ.get("MIXPREC_DTYPE")
    return None if not name else parse_dtype(name, what="--dtype")


def add_input_args(p: argparse.ArgumentParser, calibration: bool = True) -> None:
    """``--inputs`` (and ``--calibration-data``), ``--shape``."""
    data = p.add_mutually_exclusive_group()
    data.add_argument(
        "--inputs", metavar="PATH", help=f"samples for calibration and checks: {FORMS}"
    )
    if calibration:
        data.add_argument(
            "--calibration-data",
            metavar="PATH",
            help=f"calibration samples, read one at a time: {FORMS}",
        )
    add_shape_arg(p)


def add_shape_arg(
    p: argparse.ArgumentParser,
    help: str = "concrete shape for an input with symbolic dims (repeatable)",
) -> None:
    p.add_argument(
        "--shape",
        action="append",
        type=shape_arg,
        default=[],
        metavar="NAME=D0,D1,...",
        help=help,
    )


def _add_list_args(p: argparse.ArgumentParser) -> None:
    for name in LISTS:
        for kind in ("add", "remove"):
            p.add_argument(
                f"--{name}-{kind}",
                type=_ops,
                action="extend",
                default=None,
                metavar="OPS",
                help=f"comma-separated op types to {kind} {'to' if kind == 'add' else 'from'} "
                f"the {name.upper()} list",
            )


def _add_painter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--exclude",
        action="append",
        default=None,
        metavar="REGEX",
        help="keep nodes whose name matches (exact or regex) in FP32 (repeatable)",
    )
    p.add_argument(
        "--force-all",
        action="store_true",
        default=None,
        help="convert everything the schema allows (unsafe)",
    )
    p.add_argument(
        "--output-fp32",
        type=_ops,
        action="extend",
        default=[],
        metavar="OPS",
        help="op types that compute in low precision but hand FP32 on",
    )
    io = p.add_mutually_exclusive_group()
    io.add_argument(
        "--keep-io-types",
        dest="keep_io_types",
        action="store_true",
        default=True,
        help="keep model inputs/outputs float32 (default)",
    )
    io.add_argument(
        "--no-keep-io-types",
        dest="keep_io_types",
        action="store_false",
        help="let model inputs/outputs become low precision",
    )


def _add_stage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the onnxruntime range run (lists and rules only)",
    )
    p.add_argument(
        "--range-threshold",
        type=float,
        default=None,
        help="activation |x| limit (default: a quarter of the dtype's max)",
    )
    p.add_argument(
        "--no-fold-batchnorm",
        action="store_true",
        help="do not fold BatchNormalization into Conv/Gemm",
    )
    p.add_argument(
        "--no-upgrade-opset", action="store_true", help="bf16: never raise the opset to 22"
    )
    p.add_argument(
        "--clip-weights",
        action="store_true",
        help="clip out-of-range weights instead of keeping consumers FP32",
    )


def add_policy_args(p: argparse.ArgumentParser) -> None:
    """The FP16/BF16 policy and stage options of convert, inspect and report."""
    p.add_argument(
        "--dtype", help="fp16 (default), bf16 (inspect, report: also int8); env MIXPREC_DTYPE"
    )
    _add_list_args(p)
    _add_painter_args(p)
    _add_stage_args(p)
    add_input_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    add_quiet_arg(p)


def add_runtime_args(p: argparse.ArgumentParser, what: str = "checks") -> None:
    """``--runtime``, ``--provider``, ``--threads``, ``--inference-precision``,
    ``--performance-hint``."""
    g = p.add_argument_group("runtime", f"the engine that runs the model for {what}")
    g.add_argument(
        "--runtime",
        choices=runtime_names(),
        default=None,
        help="onnxruntime (ort) or OpenVINO's CPU plugin (openvino, extra [openvino]); "
        "default: ort, except that a bf16 model is checked in openvino where this CPU "
        "computes bf16",
    )
    g.add_argument(
        "--provider",
        default=None,
        metavar="NAME",
        help="where the runtime computes: ort: cpu (default), cuda or tensorrt (from "
        "onnxruntime-gpu, on a machine with a CUDA device); openvino: its device (CPU, "
        "GPU, ...)",
    )
    g.add_argument(
        "--threads", type=int, default=2, metavar="N", help="intra-op threads (0: all cores)"
    )
    g.add_argument(
        "--inference-precision",
        choices=PRECISIONS,
        default=None,
        help="openvino: let it lower FP32 layers by its own rules (default: run the "
        "model's own dtypes, hint f32)",
    )
    g.add_argument(
        "--performance-hint", choices=PERFORMANCE_HINTS, default="latency", help="openvino"
    )


def runtime_of(args: argparse.Namespace) -> RuntimeOptions | None:
    """The runtime options given (None: no ``--runtime``, the default choice).

    Raises:
        MixprecError: one line, when the runtime or its ``--provider`` is not installed
            here (checked now, before any work).
    """
    name = getattr(args, "runtime", None)
    threads = getattr(args, "threads", 2)
    precision = getattr(args, "inference_precision", None)
    performance = getattr(args, "performance_hint", "latency")
    provider = getattr(args, "provider", None)
    defaults = (None, None, "latency", 2, None)
    if (name, precision, performance, threads, provider) == defaults:
        return None
    options = RuntimeOptions(
        name=name or runtime_taking(precision),
        threads=threads,
        precision=precision,
        performance=performance,
        provider=provider,
    )
    if provider is not None:
        engine_for(options)
    return options


def add_output_kind(p: argparse.ArgumentParser) -> None:
    """``--output-kind NAME=KIND``: how the accuracy checks read an output."""
    p.add_argument(
        "--output-kind",
        action="append",
        default=None,
        metavar="NAME=KIND",
        help="read output NAME as KIND instead of the reading mixprec makes of it: "
        f"{', '.join(KIND_NAMES)} (top1, scores, channels and detection take @AXIS); "
        "repeat for more outputs",
    )


def add_accept_unconfirmed(p: argparse.ArgumentParser, loses: str) -> None:
    """``--accept-unconfirmed``: a pass too few held-out rows confirm counts as one."""
    p.add_argument(
        "--accept-unconfirmed",
        action="store_true",
        help="take a result whose checks pass on held-out rows too few to confirm them "
        f"(95%% lower bound under the budget); by default {loses}, and the last line says "
        "how many rows would confirm it",
    )


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)


def add_debug_arg(p: argparse.ArgumentParser, *, top: bool) -> None:
    # The subcommands' copy must not overwrite `mixprec --debug CMD` with its default.
    p.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show tracebacks (of warnings and of the error that ends the command) and "
        "debug messages",
    )


def convert_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The :func:`mixprec.convert` options the policy arguments give."""
    kwargs: dict[str, Any] = {}
    for name in LISTS:
        for kind in ("add", "remove"):
            kwargs[f"{name}_{kind}"] = getattr(args, f"{name}_{kind}")
    kwargs.update(
        exclude_nodes=args.exclude,
        force_all=args.force_all,
        output_fp32_ops=args.output_fp32,
        keep_io_types=args.keep_io_types,
        calibrate=not args.no_calibrate,
        range_threshold=args.range_threshold,
        fold_batchnorm=not args.no_fold_batchnorm,
        upgrade_opset=not args.no_upgrade_opset,
        clip_weights=args.clip_weights,
        shapes=dict(args.shape) or None,
    )
    return kwargs


def progress(quiet: bool) -> Callable[[str], None]:
    """Progress lines on stderr (a terminal, or a command past its first second)."""
    start = time.perf_counter()

    def say(message: str) -> None:
        if (not quiet and sys.stderr.isatty()) or (not quiet and time.perf_counter() - start > 1.0):
            print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def load_feeds(path: str | None, model_path: str) -> list[dict[str, Any]] | None:
    """``--inputs PATH`` (any of :data:`FORMS`) as a list of samples checked against the
    model's inputs (None without it)."""
    if path is None:
        return None
    return list(iter_calibration_npz(path, load_model(model_path)))


def calibration_data(args: argparse.Namespace, feeds: Any, labels: bool = False) -> Any:
    """``--calibration-data`` as samples read one at a time, afresh at each pass (the
    accuracy guard reads them more than once), else the ``--inputs`` samples; ``labels``:
    keep the arrays that are not model inputs (the guard's held-out labels)."""
    path = getattr(args, "calibration_data", None)
    if path is None:
        return feeds
    return NpzSamples(path, load_model(args.model), labels=labels)
