"""The ``--log-dir`` folder: graphs before/after and the paint buckets."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import onnx
import onnx.printer
import onnx_ir as ir

from mixprec._errors import MixprecError
from mixprec._protos import iter_proto_tensors
from mixprec._report import Report

__all__ = ["write_log_dir"]


def _text(proto: onnx.ModelProto) -> str:
    try:
        return onnx.printer.to_text(proto)
    except Exception as exc:  # printer limits (huge tensors, odd attributes)
        return f"# onnx.printer could not render this graph: {exc}\n"


def _strip_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without tensor payloads, so the text form stays readable."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for t in iter_proto_tensors(m.graph):
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
            t.ClearField(field)
    return m


def write_log_dir(folder: Path, before: onnx.ModelProto, after: ir.Model, report: Report) -> None:
    """Write before.onnx/.txt, after.onnx/.txt, paint_buckets.json/.txt and report.json."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MixprecError(f"--log-dir {folder}: cannot create ({exc.strerror})") from None
    after_proto = ir.to_proto(after)
    for name, proto in (("before", before), ("after", after_proto)):
        if proto.ByteSize() < 2**31 - 2**26:
            onnx.save(proto, str(folder / f"{name}.onnx"))
        (folder / f"{name}.txt").write_text(_text(_strip_weights(proto)))
    buckets: dict[str, dict[str, list[str]]] = {"low": defaultdict(list), "fp32": defaultdict(list)}
    for n in report.nodes:
        buckets[n.precision][n.op_type].append(n.name)
    data = {
        "final_lists": report.policy,
        "buckets": {k: {op: sorted(v) for op, v in sorted(d.items())} for k, d in buckets.items()},
        "nodes": [vars(n) for n in report.nodes],
    }
    (folder / "paint_buckets.json").write_text(json.dumps(data, indent=2))
    lines = [f"target: {report.target}"]
    for cls in ("allow", "deny", "infer", "clear"):
        ops = report.policy.get(cls, [])
        lines.append(f"{cls.upper()} list: {', '.join(ops) if isinstance(ops, list) else ops}")
    lines.append("")
    lines += [
        f"{n.precision:4s} {n.op_type:20s} {n.name:40s} [{n.step}] {n.reason}" for n in report.nodes
    ]
    (folder / "paint_buckets.txt").write_text("\n".join(lines) + "\n")
    (folder / "report.json").write_text(report.to_json())
