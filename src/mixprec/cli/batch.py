"""``mixprec batch``: its arguments and its command (see :func:`mixprec.batch`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from mixprec.batch.engines import ENGINES
from mixprec.batch.run import batch
from mixprec.cli.options import add_policy_args, convert_kwargs, dtype_of

__all__ = ["add_batch_parser", "cmd_batch"]


def add_batch_parser(sub: Any) -> argparse.ArgumentParser:
    b = sub.add_parser(
        "batch",
        help="convert, quantize or tune a whole model zoo",
        description="Every model of SRC (.onnx files, folders searched recursively, TOML "
        "manifests) in its own worker process; OUTDIR/results.jsonl gets one row per model "
        "as it finishes and OUTDIR/index.html is the zoo page. Data beside a model NAME.onnx "
        "is used by convention: NAME.calib.npz or NAME.calib/ (calibration), NAME.inputs.npz "
        "or NAME.inputs/ (validation), NAME.eval.npz or NAME.eval/ (INT8 guard). Exit 0 when "
        "every model is ok, 1 when some failed or errored, 2 for usage errors, 130 interrupted.",
    )
    b.add_argument("sources", nargs="+", metavar="SRC", help="model, folder or manifest.toml")
    b.add_argument("-o", "--output", required=True, metavar="OUTDIR", help="output folder")
    add_policy_args(b)  # --dtype (here also int8), the lists, --inputs, --json, -q ...
    b.add_argument("--validate", action="store_true", help="compare each model with FP32")
    b.add_argument("--rtol", type=float, default=None, help="validation tolerance (rel. L2)")
    b.add_argument("--eval-data", metavar="PATH", help="INT8 accuracy guard's samples")
    b.add_argument("--tune", action="store_true", help="tune each model to --budget")
    b.add_argument("--budget", default=None, help="tune: the bound on --metric")
    b.add_argument("--metric", default="rel-l2", help="tune: rel-l2, max-abs, top1, cosine")
    b.add_argument("--external-data", action="store_true", help="weights beside each model")
    b.add_argument("--workers", type=int, default=None, help="models at a time (default: cores)")
    b.add_argument("--engine", choices=ENGINES, default="local", help="local pool or Ray tasks")
    b.add_argument("--ray-address", default=None, help="Ray cluster (auto, ray://host:port)")
    b.add_argument("--resume", action="store_true", help="skip models already ok in OUTDIR")
    b.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds per model")
    return b


def _policy(args: argparse.Namespace) -> dict[str, Any]:
    """The policy options given on the command line (those left at their default are not
    passed, so that quantize and tune see only what they were asked for)."""
    plain = argparse.ArgumentParser()
    add_policy_args(plain)
    defaults = convert_kwargs(plain.parse_args([]))
    return {k: v for k, v in convert_kwargs(args).items() if v != defaults.get(k)}


def _say(row: dict[str, Any], done: int, total: int) -> None:
    width = len(str(total))
    what = row.get("error") or (
        f"low MACs {row['low_mac_share']:.0%}" if row.get("low_mac_share") is not None else ""
    )
    print(
        f"[{done:{width}}/{total}] {row['status']:<7} {row['model']}  "
        f"{row.get('seconds', 0):.1f}s  {what}",
        flush=True,
    )


def cmd_batch(args: argparse.Namespace) -> int:
    result = batch(
        args.sources,
        args.output,
        workers=args.workers,
        engine=args.engine,
        ray_address=args.ray_address,
        resume=args.resume,
        timeout=args.timeout,
        progress=None if (args.quiet or args.json) else _say,
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
        policy=_policy(args),
    )
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=1, default=str)
        print()
    print(result.summary(), file=sys.stderr if args.json else sys.stdout, flush=True)
    return result.exit_code
