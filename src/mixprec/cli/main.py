"""Command line: ``mixprec convert | quantize | tune | inspect | report | validate | lists``.

Exit statuses:

* 0: success.
* 1: ``validate`` or ``convert --validate`` found the converted model out of tolerance
  (``convert`` then does not write it).
* 2: a user error (bad input file, option, environment variable, model mixprec cannot
  handle): one line ``mixprec: error: ...`` on stderr.
* 3: an internal error, a bug in mixprec: one line ``mixprec: internal error ...`` that asks
  for a bug report and, with ``--log-dir DIR``, points to ``DIR/error.txt``.
* 130: interrupted (Ctrl-C).

The CLI owns the terminal: every log record and ``warnings.warn`` call, mixprec's or a
library's (onnx_ir, onnx, onnxruntime), becomes one line ``mixprec: warning: ...`` on
stderr, without traceback. ``-q`` hides other libraries' warnings, ``--debug`` shows
tracebacks (of log records and of the error that ended the command) and mixprec's debug
messages. ``--log-dir DIR`` also gets every record in full in ``DIR/mixprec.log`` and, when
the command fails, the traceback and the command line in ``DIR/error.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mixprec.cli.report import add_output_args, add_report_parser
from mixprec.cli.terminal import terminal_logging
from mixprec.core.errors import MixprecError, describe

EXIT_VALIDATION_FAILED = 1
EXIT_ERROR = 2
EXIT_INTERNAL_ERROR = 3
EXIT_INTERRUPTED = 130

_LISTS = ("allow", "deny", "infer", "clear")


def _shape(text: str) -> tuple[str, list[int]]:
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


def _add_input_args(p: argparse.ArgumentParser, calibration: bool = True) -> None:
    data = p.add_mutually_exclusive_group()
    data.add_argument(
        "--inputs", metavar="FILE.npz", help="inputs for calibration/validation (one sample)"
    )
    if calibration:
        data.add_argument(
            "--calibration-data",
            metavar="PATH",
            help="calibration samples: an .npz whose arrays have a leading sample axis, or "
            "a folder of .npz files (one sample each), read one sample at a time",
        )
    _add_shape_arg(p)


def _add_shape_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shape",
        action="append",
        type=_shape,
        default=[],
        metavar="NAME=D0,D1,...",
        help="concrete shape for an input with symbolic dims (repeatable)",
    )


def _add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", help="fp16 (default) or bf16; env MIXPREC_DTYPE")
    for name in _LISTS:
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
    _add_input_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    _add_quiet_arg(p)


_QUIET_HELP = "no progress messages, no warnings from other libraries (onnx, onnxruntime...)"


def _add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help=_QUIET_HELP)


def _add_debug_arg(p: argparse.ArgumentParser, *, top: bool) -> None:
    # The subcommands' copy must not overwrite `mixprec --debug CMD` with its default.
    p.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show tracebacks (of warnings and of the error that ends the command) and "
        "debug messages",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Convert FP32 ONNX models to FP16/BF16 mixed precision or INT8.",
    )
    _add_debug_arg(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a model")
    c.add_argument("model", help="FP32 ONNX model")
    c.add_argument("-o", "--output", required=True, help="where to write the converted model")
    _add_policy_args(c)
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
        "--keep-failed",
        action="store_true",
        help="with --validate: write a model that fails validation to OUTPUT's name with "
        "'.failed' before the suffix (e.g. out.failed.onnx), for inspection",
    )
    c.add_argument(
        "--external-data", action="store_true", help="write weights to OUTPUT.data beside the model"
    )
    add_output_args(c)

    from mixprec.cli.quantize import add_quantize_parser

    q = add_quantize_parser(sub)
    from mixprec.cli.tune import add_tune_parser

    t = add_tune_parser(sub)

    i = sub.add_parser(
        "inspect",
        help="show the painting (or, with --dtype int8, the INT8 plan) without writing a model",
    )
    i.add_argument("model")
    _add_policy_args(i)
    i.add_argument("--all-nodes", action="store_true", help="list every node's decision")
    i.add_argument(
        "--dynamic", action="store_true", help="with --dtype int8: the dynamic INT8 plan"
    )

    v = sub.add_parser("validate", help="compare a converted model with the original")
    v.add_argument("original")
    v.add_argument("converted")
    _add_input_args(v, calibration=False)
    v.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="max relative L2 error per output (default per dtype)",
    )
    v.add_argument(
        "--atol",
        type=float,
        default=1e-3,
        help="max abs error accepted where the reference is near zero",
    )
    v.add_argument("--mode", choices=("auto", "ort", "emulated"), default="auto")
    v.add_argument("--json", action="store_true")
    _add_quiet_arg(v)

    lists = sub.add_parser("lists", help="print the default op lists and rules")
    lists.add_argument("--dtype", default="fp16")
    lists.add_argument("--markdown", action="store_true")
    r = add_report_parser(sub, _add_policy_args)
    for command in (c, q, t, i, v, lists, r):
        _add_debug_arg(command, top=False)
    return parser


def _convert_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for name in _LISTS:
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


def _progress(quiet: bool):
    start = time.perf_counter()

    def say(message: str) -> None:
        if (not quiet and sys.stderr.isatty()) or (not quiet and time.perf_counter() - start > 1.0):
            print(f"[{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    return say


def _load_feeds(path: str | None, model_path: str):
    if path is None:
        return None
    from mixprec.io.feeds import load_inputs_npz
    from mixprec.io.models import load_model

    return load_inputs_npz(path, load_model(model_path))


def _calibration_data(args: argparse.Namespace, feeds: Any):
    """``--calibration-data`` as a lazy stream of samples, else the ``--inputs`` sample."""
    path = getattr(args, "calibration_data", None)
    if path is None:
        return feeds
    from mixprec.io.feeds import iter_calibration_npz
    from mixprec.io.models import load_model

    return iter_calibration_npz(path, load_model(args.model))


def _checked_output(args: argparse.Namespace) -> Path:
    """``-o`` checked before any work: a writable folder, not the input, and
    ``--keep-failed`` only with ``--validate``."""
    from mixprec.cli.report import check_output_args
    from mixprec.io.models import check_output_path

    if args.keep_failed and not args.validate:
        raise MixprecError("--keep-failed needs --validate")
    out = Path(args.output)
    check_output_path(out)
    check_output_args(args)
    if Path(args.model).exists() and out.exists() and out.resolve() == Path(args.model).resolve():
        raise MixprecError(f"{out}: output would overwrite the input model")
    return out


def _cmd_convert(args: argparse.Namespace) -> int:
    from mixprec.api.convert import convert

    out = _checked_output(args)
    feeds = _load_feeds(args.inputs, args.model)
    result = convert(
        args.model,
        args.dtype,
        calibration_data=_calibration_data(args, feeds),
        log_dir=args.log_dir,
        progress=_progress(args.quiet or args.json),
        **_convert_kwargs(args),
    )
    return _validate_and_write(args, result, feeds, out)


def _validate_and_write(args: argparse.Namespace, result: Any, feeds: Any, out: Path) -> int:
    """``--validate`` (before writing), the write, the report, and the exit status."""
    validation = None
    if args.validate:
        from mixprec.api.validate import validate

        # The model in memory is what save() writes: check it first, write it only if it passes.
        validation = validate(
            args.model,
            result.model,
            inputs=feeds,
            shapes=dict(args.shape) or result.report.input_shapes,
            rtol=args.rtol,
        )
        result.report.validation = {**validation.to_dict(), "table": validation.format_table()}
    passed = validation is None or validation.passed
    if args.annotate_model:
        from mixprec.cli.report import annotate_model

        annotate_model(result.model, result.report)
    kept = None
    if passed:
        result.save(out, external_data=args.external_data)
    elif args.keep_failed:
        kept = _failed_path(out)
        result.save(kept, external_data=args.external_data)
    from mixprec.cli.report import write_outputs

    written = write_outputs(args, result.model, result.report, converted=True)
    if args.json:
        data = result.report.to_dict()
        data["output"] = str(out) if passed else None
        data["reports"] = written
        if kept is not None:
            data["failed_output"] = str(kept)
        print(json.dumps(data, indent=2, default=str))
    else:
        print(result.report.format_summary())
        if passed:
            print(f"wrote {out}" + ("" if validation is None else " (validated: passed)"))
        for path in written:
            print(f"wrote {path}")
    if validation is None or passed:
        return 0
    sys.stdout.flush()  # the verdict is the last line, also where stdout and stderr interleave
    line = f"mixprec: validation FAILED ({_worst(validation)}): {out} not written"
    if kept is not None:
        line += f"; the failed model is in {kept}"
    print(line, file=sys.stderr, flush=True)
    return EXIT_VALIDATION_FAILED


def _cmd_quantize(args: argparse.Namespace) -> int:
    from mixprec.cli.quantize import cmd_quantize

    return cmd_quantize(args)


def _cmd_tune(args: argparse.Namespace) -> int:
    from mixprec.cli.tune import cmd_tune

    return cmd_tune(args)


def _failed_path(out: Path) -> Path:
    """``out.onnx`` -> ``out.failed.onnx``: where ``--keep-failed`` writes a failed model."""
    return out.with_name(f"{out.stem}.failed{out.suffix or '.onnx'}")


def _worst(validation: Any) -> str:
    """Why validation failed, by its worst output: ``output 'y': rel L2 0.12 > rtol 0.01``."""
    failed = [o for o in validation.outputs if not o.passed]
    if not failed:
        return "no output compared"
    worst = max(failed, key=lambda o: o.rel_l2_error)
    reasons = []
    if math.isfinite(worst.rel_l2_error) and worst.rel_l2_error > validation.rtol:
        reasons.append(f"rel L2 {worst.rel_l2_error:.3g} > rtol {validation.rtol:.3g}")
    if worst.note:
        reasons.append(worst.note)
    more = f"; {len(failed)} of {len(validation.outputs)} outputs failed" if len(failed) > 1 else ""
    return f"output {worst.name!r}: {'; '.join(reasons) or 'out of tolerance'}{more}"


def _cmd_inspect(args: argparse.Namespace) -> int:
    from mixprec.api.convert import inspect

    feeds = _load_feeds(args.inputs, args.model)
    dtype = (args.dtype or os.environ.get("MIXPREC_DTYPE") or "").strip().lower()
    if dtype == "int8":
        from mixprec.api.quantize import plan_int8

        for name in _LISTS:
            for kind in ("add", "remove"):
                if getattr(args, f"{name}_{kind}", None):
                    raise MixprecError(
                        f"--{name}-{kind} is an fp16/bf16 list; int8 takes --exclude"
                    )
        _, report = plan_int8(
            args.model,
            _calibration_data(args, feeds),
            progress=_progress(args.quiet or args.json),
            exclude_nodes=tuple(args.exclude or ()),
            shapes=dict(args.shape),
            fold_batchnorm=not args.no_fold_batchnorm,
            mode="dynamic" if args.dynamic else "static",
        )
    else:
        if args.dynamic:
            raise MixprecError("--dynamic goes with --dtype int8")
        report = inspect(
            args.model,
            args.dtype,
            calibration_data=_calibration_data(args, feeds),
            progress=_progress(args.quiet or args.json),
            **_convert_kwargs(args),
        )
    if args.json:
        print(report.to_json())
        return 0
    print(report.format_summary())
    if args.all_nodes:
        for n in report.nodes:
            print(f"  {n.precision:4s}  {n.op_type:22s} {n.name:40s} [{n.step}] {n.reason}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from mixprec.cli.report import run_report

    feeds = _load_feeds(args.inputs, args.model)
    progress = _progress(args.quiet or args.json)
    return run_report(args, _convert_kwargs(args), _calibration_data(args, feeds), progress)


def _cmd_validate(args: argparse.Namespace) -> int:
    from mixprec.api.validate import validate

    feeds = _load_feeds(args.inputs, args.original)
    report = validate(
        args.original,
        args.converted,
        inputs=feeds,
        shapes=dict(args.shape) or None,
        rtol=args.rtol,
        atol=args.atol,
        mode=args.mode,
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        print(report.format_table())
    return 0 if report.passed else EXIT_VALIDATION_FAILED


def _cmd_lists(args: argparse.Namespace) -> int:
    from mixprec.core.policy import RULES, OpClass, default_policy

    policy = default_policy(args.dtype)
    if args.markdown:
        print(f"| list | {policy.target} ops |\n|---|---|")
        for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR):
            print(f"| {cls.value.upper()} | {', '.join(sorted(policy.lists[cls]))} |")
        print("\n| rule (domain, op) | behaviour |\n|---|---|")
        for (domain, op), rule in sorted(RULES.items()):
            print(f"| {domain or 'ai.onnx'}::{op} | {rule.note} |")
        return 0
    for cls in (OpClass.ALLOW, OpClass.DENY, OpClass.INFER, OpClass.CLEAR):
        print(f"{cls.value.upper():6s} {', '.join(sorted(policy.lists[cls]))}")
    for (domain, op), rule in sorted(RULES.items()):
        print(f"RULE   {domain or 'ai.onnx'}::{op}: {rule.note}")
    return 0


def _log_dir(args: argparse.Namespace) -> str | None:
    """The log folder of a command that has one (``--log-dir`` or ``MIXPREC_LOG_PATH``)."""
    if not hasattr(args, "log_dir"):
        return None
    if args.log_dir is not None:
        return str(args.log_dir)
    from mixprec.core.config import resolve_log_dir

    try:
        found = resolve_log_dir(None)
    except Exception:  # the command reports a bad environment itself
        return None
    return None if found is None else os.fspath(found)


def _fail(exc: Exception, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Report ``exc`` on one stderr line (a traceback first with ``--debug``)."""
    log_dir = _log_dir(args)
    error_file = None
    if log_dir is not None:
        from mixprec.report.logdir import write_error_file

        error_file = write_error_file(log_dir, argv, exc)
    if args.debug:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, MixprecError):
        print(f"mixprec: error: {describe(exc)}", file=sys.stderr, flush=True)
        return EXIT_ERROR
    text = describe(exc)
    where = f" {text}" if getattr(exc, "stage", None) else f" in {args.command}: {text}"
    hint = " -- please report this bug"
    if error_file is not None:
        hint += f"; details in {error_file}"
    elif not args.debug:
        hint += " (rerun with --debug for the traceback)"
    print(f"mixprec: internal error{where}{hint}", file=sys.stderr, flush=True)
    return EXIT_INTERNAL_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {
        "convert": _cmd_convert,
        "quantize": _cmd_quantize,
        "tune": _cmd_tune,
        "inspect": _cmd_inspect,
        "report": _cmd_report,
        "validate": _cmd_validate,
        "lists": _cmd_lists,
    }
    quiet = bool(getattr(args, "quiet", False))
    with terminal_logging(quiet=quiet, debug=args.debug, log_dir=_log_dir(args)) as terminal:
        try:
            status = handlers[args.command](args)
        except KeyboardInterrupt:
            terminal.failed()
            print("mixprec: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # e.g. `mixprec lists | head`
            sys.stderr.close()
            return 0
        except MemoryError:
            terminal.failed()
            print("mixprec: error: out of memory", file=sys.stderr)
            return EXIT_ERROR
        except Exception as exc:  # MixprecError: exit 2; anything else is a bug: exit 3
            terminal.failed()
            return _fail(exc, args, argv)
        if status == EXIT_VALIDATION_FAILED:
            terminal.failed()  # the verdict is the one line; the warnings are in the log
        return status
