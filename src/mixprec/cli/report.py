"""``mixprec report`` and the report outputs of ``convert`` / ``quantize``.

``mixprec report IN.onnx [--dtype fp16|bf16|int8] -o report.html`` paints (for int8:
plans) without writing a model and draws the page. ``--report FILE.html``,
``--model-explorer FILE.json`` and ``--annotate-model`` on convert and quantize draw,
export and annotate what was actually done.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.pipeline.report import NodeReport, Report
from mixprec.report.graph_view import PRECISION_LABELS, build_views, inferred_dtypes, node_precision

__all__ = [
    "add_output_args",
    "add_report_parser",
    "annotate_model",
    "check_output_args",
    "model_explorer_data",
    "run_report",
    "write_outputs",
]

#: ``metadata_props`` keys written by ``--annotate-model``.
PRECISION_KEY = "mixprec.precision"
REASON_KEY = "mixprec.reason"

#: Model Explorer node data: one number per precision and the page's colours.
_EXPLORER_VALUE = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int": 0, "cast": 1, "qdq": 2}
_EXPLORER_COLOR = {
    "fp32": "#e8eef7",
    "fp16": "#c9f0c9",
    "bf16": "#c8ecec",
    "int8": "#f5d7f0",
    "int": "#eeeeee",
    "cast": "#ffe2b0",
    "qdq": "#ffd0d0",
}


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--report``, ``--model-explorer`` and ``--annotate-model`` (convert, quantize)."""
    p.add_argument(
        "--report",
        metavar="FILE.html",
        help="write a self-contained HTML page of the converted graph (with validation)",
    )
    p.add_argument(
        "--model-explorer",
        metavar="FILE.json",
        help="write per-node precision as Google Model Explorer node data (JSON overlay)",
    )
    p.add_argument(
        "--annotate-model",
        action="store_true",
        help=f"write {PRECISION_KEY} / {REASON_KEY} into the output nodes' metadata_props",
    )


def add_report_parser(
    sub: Any, add_policy_args: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
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


def check_output_args(args: argparse.Namespace) -> None:
    """Fail before any work when a report output cannot be written."""
    from mixprec.io.models import check_output_path

    for name in ("report", "model_explorer"):
        path = getattr(args, name, None)
        if path:
            check_output_path(path)


def _rows(report: Report | None) -> dict[str, NodeReport]:
    return {r.name: r for r in report.nodes} if report is not None else {}


def annotate_model(model: ir.Model, report: Report | None) -> int:
    """Write each node's precision and reason into its ``metadata_props``; returns the count.

    Inserted Cast and Q/DQ nodes get their kind and why they are there.
    """
    from mixprec.core.graphs import iter_nodes

    rows = _rows(report)
    target = report.target if report is not None else "float16"
    dtypes = inferred_dtypes(model)  # a converted model forgets intermediate types
    done = 0
    for node in iter_nodes(model.graph):
        row = rows.get(node.name or "")
        kind = node_precision(node, row, target, dtypes)
        if row is not None:
            reason = f"[{row.step}] {row.reason}"
        elif kind == "cast":
            reason = "cast inserted or kept by the conversion"
        elif kind == "qdq":
            reason = "quantize/dequantize at an INT8 boundary"
        else:
            reason = "not painted (no float computation)"
        node.metadata_props[PRECISION_KEY] = PRECISION_LABELS[kind]
        node.metadata_props[REASON_KEY] = reason
        done += 1
    return done


def model_explorer_data(model: ir.Model, report: Report | None) -> dict[str, Any]:
    """Per-node precision in Model Explorer's node data format (``ModelNodeData``):
    ``{graph id: {"results": {node key: {"value", "bgColor"}}, "thresholds": [...]}}``.

    Nodes are keyed by their first output tensor name, which Model Explorer matches
    whatever adapter drew the graph; values are bits (32, 16, 8; 0 integer-only; 1 Cast;
    2 Q/DQ) with the page's colours.
    """
    results: dict[str, dict[str, Any]] = {}
    for view in build_views(model, report):
        for node in view.nodes:
            if node.precision == "io":
                continue
            outputs = node.detail.get("outputs") or []
            key = outputs[0]["name"] if outputs and outputs[0]["name"] else node.name
            if not key:
                continue
            results[key] = {
                "value": _EXPLORER_VALUE[node.precision],
                "bgColor": _EXPLORER_COLOR[node.precision],
            }
    thresholds = [
        {"value": v, "bgColor": _EXPLORER_COLOR[k]}
        for k, v in sorted(_EXPLORER_VALUE.items(), key=lambda kv: kv[1])
        if k != "bf16"
    ]
    return {model.graph.name or "main_graph": {"results": results, "thresholds": thresholds}}


def write_outputs(
    args: argparse.Namespace, model: ir.Model, report: Report | None, *, converted: bool
) -> list[str]:
    """Write the page and the Model Explorer overlay the arguments ask for; their paths."""
    from mixprec.io.models import write_text
    from mixprec.report.html import write_report_html

    written = []
    page = getattr(args, "report", None) if converted else args.output
    if page:
        title = f"mixprec {args.command}: {os.path.basename(args.model)}"
        write_report_html(model, page, report=report, title=title, converted=converted)
        written.append(str(page))
    explorer = getattr(args, "model_explorer", None)
    if explorer:
        write_text(explorer, json.dumps(model_explorer_data(model, report), indent=1))
        written.append(str(explorer))
    return written


def _int8_plan(args: argparse.Namespace, calibration_data: Any, say: Any) -> tuple[Any, Report]:
    """The FP32 model annotated with the INT8 plan (every node the plan allows)."""
    from mixprec.api.quantize import plan_int8

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
    from mixprec.api.convert import annotate
    from mixprec.io.models import check_output_path

    check_output_path(args.output)
    check_output_args(args)
    dtype = (args.dtype or os.environ.get("MIXPREC_DTYPE") or "fp16").strip().lower()
    if dtype == "int8":
        model, report = _int8_plan(args, calibration_data, say)
    elif dtype in ("uint8", "i8", "s8", "u8"):
        raise MixprecError(f"--dtype {dtype}: use --dtype int8")
    else:
        result = annotate(
            args.model, args.dtype, calibration_data=calibration_data, progress=say, **options
        )
        model, report = result.model, result.report
    written = write_outputs(args, model, report, converted=False)
    if args.json:
        print(
            json.dumps(
                {"report": written[0], "written": written, **report.to_dict()},
                indent=2,
                default=str,
            )
        )
    else:
        print(report.format_summary())
        for path in written:
            print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")
    return 0
