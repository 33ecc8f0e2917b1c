"""Command line: ``mixprec convert | quantize | optimize | tune | inspect | report | validate
| lists | batch``.

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
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mixprec.cli.batch import add_batch_parser, cmd_batch
from mixprec.cli.convert import add_convert_parser, cmd_convert
from mixprec.cli.inspect import add_inspect_parser, add_lists_parser, cmd_inspect, cmd_lists
from mixprec.cli.optimize import add_optimize_parser, cmd_optimize
from mixprec.cli.options import (
    EXIT_ERROR,
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_VALIDATION_FAILED,
    add_debug_arg,
)
from mixprec.cli.quantize import add_quantize_parser, cmd_quantize
from mixprec.cli.report import add_report_parser, cmd_report
from mixprec.cli.terminal import terminal_logging
from mixprec.cli.tune import add_tune_parser, cmd_tune
from mixprec.cli.validate import add_validate_parser, cmd_validate
from mixprec.core.config import resolve_log_dir
from mixprec.core.errors import MixprecError, describe
from mixprec.core.version import __version__
from mixprec.report.logdir import write_error_file

__all__ = ["build_parser", "main"]

#: The subcommands' parsers, in the order ``mixprec --help`` lists them.
_PARSERS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (
    add_convert_parser,
    add_quantize_parser,
    add_optimize_parser,
    add_tune_parser,
    add_inspect_parser,
    add_validate_parser,
    add_lists_parser,
    add_report_parser,
    add_batch_parser,
)
#: The subcommands' commands: each returns the exit status.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "convert": cmd_convert,
    "quantize": cmd_quantize,
    "optimize": cmd_optimize,
    "tune": cmd_tune,
    "inspect": cmd_inspect,
    "report": cmd_report,
    "validate": cmd_validate,
    "lists": cmd_lists,
    "batch": cmd_batch,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="Convert FP32 ONNX models to FP16/BF16 mixed precision or INT8.",
    )
    add_debug_arg(parser, top=True)
    parser.add_argument(
        "--version",
        action="version",
        version=f"mixprec {__version__}",
        help="print mixprec's version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _PARSERS:
        add_debug_arg(add(sub), top=False)
    return parser


def _log_dir(args: argparse.Namespace) -> str | None:
    """The log folder of a command that has one (``--log-dir`` or ``MIXPREC_LOG_PATH``)."""
    if not hasattr(args, "log_dir"):
        return None
    if args.log_dir is not None:
        return str(args.log_dir)
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
    quiet = bool(getattr(args, "quiet", False))
    with terminal_logging(quiet=quiet, debug=args.debug, log_dir=_log_dir(args)) as terminal:
        try:
            status = _COMMANDS[args.command](args)
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
