"""``mixprec batch``: its arguments and its command (see :func:`mixprec.batch`)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from typing import Any

from mixprec.batch.run import ENGINES, batch
from mixprec.cli.options import add_policy_args, convert_kwargs, dtype_of
from mixprec.core.errors import MixprecError
from mixprec.core.jsonio import json_text
from mixprec.runtime.engine import runtime_names

__all__ = ["add_batch_parser", "cmd_batch"]


def add_batch_parser(sub: Any) -> argparse.ArgumentParser:
    b = sub.add_parser(
        "batch",
        help="convert, quantize, tune or optimize a whole model zoo",
        description="Every model of SRC (.onnx files, folders searched recursively, TOML "
        "manifests) in its own worker process; OUTDIR/results.jsonl gets one row per model "
        "as it finishes and OUTDIR/index.html is the zoo page. Data beside a model NAME.onnx "
        "is used by convention: NAME.calib.npz or NAME.calib/ (calibration), NAME.inputs.npz "
        "or NAME.inputs/ (validation), NAME.eval.npz or NAME.eval/ (INT8 guard). An INT8 model "
        "with none of these (calibrated and checked on generated inputs only) is 'unchecked'. "
        "Exit 0 when every model is ok, 1 when some failed, errored, timed out or are "
        "unchecked (see --allow-unchecked), 2 for usage errors, 130 interrupted.",
    )
    b.add_argument("sources", nargs="+", metavar="SRC", help="model, folder or manifest.toml")
    b.add_argument("-o", "--output", required=True, metavar="OUTDIR", help="output folder")
    add_policy_args(b)  # --dtype (here also int8), the lists, --inputs, --json, -q ...
    b.add_argument("--validate", action="store_true", help="compare each model with FP32")
    b.add_argument("--rtol", type=float, default=None, help="validation tolerance (rel. L2)")
    b.add_argument(
        "--runtime",
        choices=runtime_names(),
        default=None,
        help="the engine checks and INT8 speed plans run in (default: ort; bf16 is checked "
        "in openvino where this CPU computes bf16)",
    )
    b.add_argument("--eval-data", metavar="PATH", help="INT8 accuracy guard's samples")
    b.add_argument("--tune", action="store_true", help="tune each model to --budget")
    b.add_argument(
        "--optimize",
        action="store_true",
        help="run each model through mixprec optimize (every precision in every runtime, "
        "guarded and timed; needs calibration data: NAME.calib.npz or --calibration-data); "
        "writes NAME.optimized.onnx with its mixprec.runtime fields, and the zoo page shows "
        "each model's chosen candidate, runtime and ratio (--runtime: that runtime's "
        "candidates only)",
    )
    b.add_argument(
        "--candidates",
        metavar="LIST",
        default=None,
        help="with --optimize: the candidates to try (comma-separated; default all)",
    )
    b.add_argument("--budget", default=None, help="tune: the bound on --metric")
    b.add_argument("--metric", default="rel-l2", help="tune: rel-l2, max-abs, top1, cosine")
    b.add_argument("--external-data", action="store_true", help="weights beside each model")
    b.add_argument("--workers", type=int, default=None, help="models at a time (default: cores)")
    b.add_argument("--engine", choices=ENGINES, default="local", help="local pool or Ray tasks")
    b.add_argument("--ray-address", default=None, help="Ray cluster (auto, ray://host:port)")
    b.add_argument("--resume", action="store_true", help="skip models already ok in OUTDIR")
    b.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds per model, from when its worker starts on it",
    )
    b.add_argument(
        "--allow-unchecked",
        action="store_true",
        help="exit 0 even if some INT8 models were checked on no real data (status "
        "'unchecked': no calibration, eval or validation samples; their models are written)",
    )
    return b


def _policy(args: argparse.Namespace) -> dict[str, Any]:
    """The policy options given on the command line (those left at their default are not
    passed, so that quantize and tune see only what they were asked for)."""
    plain = argparse.ArgumentParser()
    add_policy_args(plain)
    defaults = convert_kwargs(plain.parse_args([]))
    return {k: v for k, v in convert_kwargs(args).items() if v != defaults.get(k)}


class _Progress:
    """One line per finished model on stdout (``-q``: none; ``--json``: the row as a JSON
    line), and on a terminal a bar on stderr with the counts so far and an ETA."""

    def __init__(self, quiet: bool, as_json: bool) -> None:
        self.quiet, self.as_json = quiet, as_json
        self.bar = sys.stderr.isatty() and not quiet
        self.start = time.monotonic()
        self.counts: Counter[str] = Counter()
        self.ran = 0

    def __call__(self, row: dict[str, Any], done: int, total: int) -> None:
        self.counts[row["status"]] += 1
        self.ran += 0 if row.get("resumed") else 1
        if self.bar:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
        if self.as_json:
            print(json_text(row, sort_keys=True), flush=True)
        elif not self.quiet:
            print(_line(row, done, total), flush=True)
        if self.bar and done < total:
            print(self._bar(done, total), end="", file=sys.stderr, flush=True)

    def _bar(self, done: int, total: int) -> str:
        filled = round(20 * done / total)
        counts = "  ".join(f"{s} {n}" for s, n in sorted(self.counts.items()))
        elapsed = time.monotonic() - self.start
        eta = ""
        if self.ran:
            left = elapsed / self.ran * (total - done)
            eta = f"  ETA {int(left // 60)}m{int(left % 60):02d}s"
        return f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total}  {counts}{eta}"


def _line(row: dict[str, Any], done: int, total: int) -> str:
    width = len(str(total))
    if row.get("resumed"):
        what = "resumed: unchanged since its last ok run"
    elif row.get("optimize") and not row.get("error"):
        what = _chosen(row["optimize"])
    else:
        share = row.get("low_mac_share")
        what = row.get("error") or ("" if share is None else f"low MACs {share:.0%}")
    seconds = row.get("seconds", 0)
    return f"[{done:{width}}/{total}] {row['status']:<7} {row['model']}  {seconds:.1f}s  {what}"


def _optimize_args(args: argparse.Namespace) -> None:
    """``--optimize`` chooses the precision per model: no ``--dtype``, no ``--tune``."""
    if args.candidates is not None and not args.optimize:
        raise MixprecError("--candidates needs --optimize")
    if args.optimize and dtype_of(args) is not None:
        raise MixprecError("--optimize chooses the precision per model: drop --dtype")


def _chosen(summary: dict[str, Any]) -> str:
    """``fp32-openvino in openvino, 0.62x ORT FP32`` (or the input unchanged)."""
    if summary.get("unchanged"):
        return f"{summary['winner']}: the input unchanged"
    ratio = summary.get("ratio")
    versus = "" if ratio is None else f", {ratio:.2f}x ORT FP32"
    return f"{summary['winner']} in {summary['runtime']}{versus}"


def cmd_batch(args: argparse.Namespace) -> int:
    _optimize_args(args)
    result = batch(
        args.sources,
        args.output,
        workers=args.workers,
        engine=args.engine,
        ray_address=args.ray_address,
        resume=args.resume,
        timeout=args.timeout,
        progress=_Progress(args.quiet, args.json),
        allow_unchecked=args.allow_unchecked,
        dtype=dtype_of(args) or "float16",
        validate=args.validate,
        rtol=args.rtol,
        tune=args.tune,
        budget=args.budget,
        metric=args.metric,
        calibration_data=args.calibration_data,
        inputs=args.inputs,
        eval_data=args.eval_data,
        external_data=args.external_data,
        runtime=args.runtime,
        policy=_policy(args),
        optimize=args.optimize,
        candidates=args.candidates,
    )
    if args.json:  # the last JSON line: the batch as a whole
        whole = {k: v for k, v in result.to_dict().items() if k != "rows"}
        print(json_text({"batch": whole}), flush=True)
    print(result.summary(), file=sys.stderr if args.json else sys.stdout, flush=True)
    return result.exit_code
