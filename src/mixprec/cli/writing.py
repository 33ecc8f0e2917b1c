"""What the commands that write share: the ``-o`` checks before any work, ``--validate``
before writing, the write, the report outputs (``--report``, ``--model-explorer``,
``--annotate-model``) and the summary, which ``-q`` leaves out."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import onnx_ir as ir

from mixprec.api.validate import validate
from mixprec.checks.outputs import reading_lines
from mixprec.cli.options import EXIT_VALIDATION_FAILED, runtime_of
from mixprec.core.errors import MixprecError
from mixprec.core.graphs import iter_nodes
from mixprec.core.jsonio import json_text
from mixprec.io.models import check_output_path, write_text
from mixprec.pipeline.report import NodeReport, Report
from mixprec.report.graph_view import PRECISION_LABELS, build_views, inferred_dtypes, node_precision
from mixprec.report.html import write_report_html

__all__ = [
    "add_output_args",
    "annotate_model",
    "check_output_args",
    "checked_output",
    "failed_path",
    "model_explorer_data",
    "validate_and_write",
    "write_outputs",
]

#: ``metadata_props`` keys written by ``--annotate-model``.
PRECISION_KEY = "mixprec.precision"
REASON_KEY = "mixprec.reason"

#: Model Explorer node data: one number per precision and the page's colours.
_EXPLORER_VALUE = {
    "fp32": 32, "fp16": 16, "bf16": 16, "int8": 8, "int4": 4, "int": 0, "cast": 1, "qdq": 2
}  # fmt: skip
_EXPLORER_COLOR = {
    "fp32": "#e8eef7",
    "fp16": "#c9f0c9",
    "bf16": "#c8ecec",
    "int8": "#f5d7f0",
    "int4": "#e2d4f7",
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


def check_output_args(args: argparse.Namespace) -> None:
    """Fail before any work when a report output cannot be written."""
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


def checked_output(args: argparse.Namespace) -> Path:
    """``-o`` checked before any work: a writable folder, not the input, and
    ``--keep-failed`` only with a check (``--validate``, or quantize's accuracy guard)."""
    guarded = not getattr(args, "no_guard", True)  # quantize's accuracy guard
    if args.keep_failed and not (args.validate or guarded):
        raise MixprecError("--keep-failed needs --validate")
    out = check_output_path(args.output)  # the text as given: "new.onnx/" is a folder
    check_output_args(args)
    if Path(args.model).exists() and out.exists() and out.resolve() == Path(args.model).resolve():
        raise MixprecError(f"{out}: output would overwrite the input model")
    return out


def validate_and_write(args: argparse.Namespace, result: Any, feeds: Any, out: Path) -> int:
    """``--validate`` (before writing), the write, the report, and the exit status."""
    validation = None
    if args.validate:
        # The model in memory is what save() writes: check it first, write it only if it passes.
        validation = validate(
            args.model,
            result.model,
            inputs=feeds,
            shapes=dict(args.shape) or result.report.input_shapes,
            rtol=args.rtol,
            runtime=runtime_of(args),
        )
        result.report.validation = {**validation.to_dict(), "table": validation.format_table()}
    elif result.report.target == "bfloat16" and not getattr(args, "no_check", False):
        validation = _quick_check(args, result, feeds)
    guard = result.report.guard
    guard_passed = guard is None or bool(guard.get("passed"))
    passed = (validation is None or validation.passed or not args.validate) and guard_passed
    if args.annotate_model:
        annotate_model(result.model, result.report)
    kept = None
    if passed:
        result.save(out, external_data=args.external_data)
    elif args.keep_failed:
        kept = failed_path(out)
        result.save(kept, external_data=args.external_data)
    written = write_outputs(args, result.model, result.report, converted=True)
    if args.json:
        data = result.report.to_dict()
        data["output"] = str(out) if passed else None
        data["reports"] = written
        if kept is not None:
            data["failed_output"] = str(kept)
        print(json_text(data, indent=2))
    else:
        if not args.quiet:
            print(result.report.format_summary())
        if passed:
            print(f"wrote {out}" + _checked(args, validation))
        for path in written:
            print(f"wrote {path}")
        if passed and guard is not None:
            for line in [] if args.quiet else reading_lines(guard.get("checks") or []):
                print(line)
            print(f"mixprec: {guard['summary']}")
    if passed and validation is not None and not validation.passed:
        # bf16 without --validate: written, and the last line says it misses
        sys.stdout.flush()
        print(
            f"mixprec: warning: the bf16 model misses the tolerance on its check "
            f"({_worst(validation)}; {_where(validation)}): see --validate; --exclude or "
            "mixprec tune keep sensitive nodes FP32",
            file=sys.stderr,
            flush=True,
        )
    if passed:
        return 0
    sys.stdout.flush()  # the verdict is the last line, also where stdout and stderr interleave
    if not guard_passed:
        assert guard is not None
        line = f"mixprec: {guard['summary']}: {out} not written"
    else:
        line = f"mixprec: validation FAILED ({_worst(validation)}): {out} not written"
    if kept is not None:
        line += f"; the failed model is in {kept}"
    print(line, file=sys.stderr, flush=True)
    return EXIT_VALIDATION_FAILED


def _checked(args: argparse.Namespace, validation: Any) -> str:
    if validation is None:
        return ""
    if args.validate:
        return " (validated: passed)"
    return f" (bf16 check {'passed' if validation.passed else 'FAILED'}, {_where(validation)})"


def _quick_check(args: argparse.Namespace, result: Any, feeds: Any) -> Any:
    """The check every bf16 conversion gets without ``--validate`` (one more run of each
    model on the samples given, else one generated sample): bf16 accuracy differs by
    model, and a model that misses must say so. ``None`` when the check cannot run."""
    try:
        validation = validate(
            args.model,
            result.model,
            inputs=feeds[:4] if feeds else None,
            shapes=dict(args.shape) or result.report.input_shapes,
            rtol=args.rtol,
            runtime=runtime_of(args),
        )
    except MixprecError as e:
        result.report.notes.append(f"bf16 check skipped: {e}")
        return None
    result.report.validation = {**validation.to_dict(), "table": validation.format_table()}
    verdict = "passed" if validation.passed else "FAILED"
    result.report.notes.append(f"bf16 check ({_where(validation)}): {verdict}")
    return validation


def _where(validation: Any) -> str:
    """Which engine checked: ``checked in OpenVINO 2026.4.1`` or ``emulated in FP32``."""
    if validation.kind == "emulated":
        return "emulated in FP32"
    label = validation.runtime.get("label", validation.kind)
    return f"checked in {label} {validation.runtime.get('version', '')}".rstrip()


def failed_path(out: Path) -> Path:
    """``out.onnx`` -> ``out.failed.onnx``: where ``--keep-failed`` writes a failed model."""
    return out.with_name(f"{out.stem}.failed{out.suffix or '.onnx'}")


def _worst(validation: Any) -> str:
    """Why validation failed, by its worst output: ``output 'y': rel L2 0.12 > rtol 0.01``."""
    failed = [o for o in validation.outputs if not o.passed]
    if not failed:
        rows = [c for c in validation.checks if not c.passed]
        if rows:  # the whole tensors held, but rows of answers changed
            more = f"; {len(rows)} readings failed" if len(rows) > 1 else ""
            return f"output {rows[0].output!r}: {rows[0].measured()}{more}"
        return "no output compared"
    worst = max(failed, key=lambda o: o.rel_l2_error)
    reasons = []
    if math.isfinite(worst.rel_l2_error) and worst.rel_l2_error > validation.rtol:
        reasons.append(f"rel L2 {worst.rel_l2_error:.3g} > rtol {validation.rtol:.3g}")
    if worst.note:
        reasons.append(worst.note)
    more = f"; {len(failed)} of {len(validation.outputs)} outputs failed" if len(failed) > 1 else ""
    return f"output {worst.name!r}: {'; '.join(reasons) or 'out of tolerance'}{more}"
