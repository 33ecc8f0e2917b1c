"""``mixprec inspect`` (the painting or the INT8 plan, nothing written) and ``mixprec lists``
(the default op lists and rules)."""

from __future__ import annotations

import argparse
from typing import Any

from mixprec.api.convert import inspect
from mixprec.api.quantize import plan_int8
from mixprec.cli.options import (
    LISTS,
    add_policy_args,
    calibration_data,
    convert_kwargs,
    dtype_of,
    load_feeds,
    progress,
)
from mixprec.core.errors import MixprecError
from mixprec.core.output_kinds import classify_outputs
from mixprec.core.policy import RULES, OpClass, default_policy
from mixprec.io.models import load_model
from mixprec.runtime.cpu import cpu_features
from mixprec.runtime.engines import ENGINES

__all__ = ["add_inspect_parser", "add_lists_parser", "cmd_inspect", "cmd_lists"]


def add_inspect_parser(sub: Any) -> argparse.ArgumentParser:
    i = sub.add_parser(
        "inspect",
        help="show the painting (or, with --dtype int8, the INT8 plan) without writing a model",
    )
    i.add_argument("model")
    add_policy_args(i)
    i.add_argument("--all-nodes", action="store_true", help="list every node's decision")
    i.add_argument(
        "--dynamic", action="store_true", help="with --dtype int8: the dynamic INT8 plan"
    )
    return i


def add_lists_parser(sub: Any) -> argparse.ArgumentParser:
    lists = sub.add_parser("lists", help="print the default op lists and rules")
    lists.add_argument("--dtype", default="fp16")
    lists.add_argument("--markdown", action="store_true")
    return lists


def cmd_inspect(args: argparse.Namespace) -> int:
    feeds = load_feeds(args.inputs, args.model)
    if dtype_of(args) == "int8":
        for name in LISTS:
            for kind in ("add", "remove"):
                if getattr(args, f"{name}_{kind}", None):
                    raise MixprecError(
                        f"--{name}-{kind} is an fp16/bf16 list; int8 takes --exclude"
                    )
        _, report = plan_int8(
            args.model,
            calibration_data(args, feeds),
            progress=progress(args.quiet or args.json),
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
            calibration_data=calibration_data(args, feeds),
            progress=progress(args.quiet or args.json),
            **convert_kwargs(args),
        )
    if args.json:
        print(report.to_json())
        return 0
    print(report.format_summary())
    print("\n".join(output_lines(args.model)))
    if args.all_nodes:
        for n in report.nodes:
            print(f"  {n.precision:4s}  {n.op_type:22s} {n.name:40s} [{n.step}] {n.reason}")
    print("\n".join(machine_lines()))
    return 0


def output_lines(path: str) -> list[str]:
    """How the accuracy checks read each output, as far as the graph tells
    (:mod:`mixprec.core.output_kinds`; an *other* output is read by its FP32 values
    where it is checked: :mod:`mixprec.core.readings`)."""
    lines = []
    for name, kind in classify_outputs(load_model(path)).items():
        how = kind.reason
        if kind.check == "other" and "regression" in how:
            how += " (checked by its worst channel's rel L2)"
        elif kind.check == "other":
            how += " (read by its values where checked: detections, scores, rows, channels)"
        lines.append(f"read {name!r}: {kind.spec}: {how}")
    return lines


def machine_lines() -> list[str]:
    """What this CPU computes fast and which runtime runs what here (``inspect``, ``lists``)."""
    lines = [f"CPU     {cpu_features().describe()}"]
    for name, engine in ENGINES.items():
        missing = engine.missing()
        if missing is not None:
            lines.append(f"RUNTIME {name}: not installed ({missing})")
            continue
        bf16 = "real bf16 kernels" if engine.computes_bf16() else "bf16 emulated (no bf16 kernels)"
        lines.append(f"RUNTIME {name} {engine.version()}: {bf16}")
    return lines


def cmd_lists(args: argparse.Namespace) -> int:
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
    print("\n".join(machine_lines()))
    return 0
