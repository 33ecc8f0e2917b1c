"""The ``--log-dir`` folder: graphs before/after, the paint buckets, and on failure the
error with its traceback (``error.txt``) beside the CLI's full log (``mixprec.log``)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import traceback
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx.printer
import onnx_ir as ir

from mixprec.core.errors import MixprecError
from mixprec.core.limits import INLINE_LIMIT
from mixprec.core.version import __version__
from mixprec.io.external import input_files
from mixprec.io.models import write_text
from mixprec.io.protos import iter_proto_tensors
from mixprec.pipeline.report import Report

__all__ = ["ERROR_FILE", "LOG_FILE", "write_error_file", "write_log_dir"]

#: Written by the CLI into ``--log-dir`` when a command fails.
ERROR_FILE = "error.txt"
#: Every log record of a CLI run, tracebacks included (the terminal gets one line each).
LOG_FILE = "mixprec.log"


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


def _write(folder: Path, name: str, data: bytes | str, protected: frozenset[str]) -> None:
    """Write ``folder/name`` atomically (:func:`mixprec.io.models.write_text`; its errors
    are named by :func:`write_log_dir`)."""
    path = folder / name
    if os.path.realpath(path) in protected:
        raise MixprecError(
            f"--log-dir {folder}: {name} is a file the input model reads; refusing to write "
            "over it (choose another log folder)"
        )
    write_text(path, data, wrap=False)


def write_log_dir(folder: Path, before: onnx.ModelProto, after: ir.Model, report: Report) -> None:
    """Write before.onnx/.txt, after.onnx/.txt, paint_buckets.json/.txt and report.json.

    Each file is written atomically. Never writes over a file the input model was read
    from.

    Raises:
        MixprecError: the folder cannot be created or written (full disk, read-only,
            a file in the way), or one of its files is an input of the model.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MixprecError(f"--log-dir {folder}: cannot create ({exc.strerror or exc})") from None
    protected = input_files(after)
    name = ""
    try:
        after_proto = ir.to_proto(after)
        for name, proto in (("before", before), ("after", after_proto)):
            if proto.ByteSize() <= INLINE_LIMIT:
                _write(folder, f"{name}.onnx", proto.SerializeToString(), protected)
            _write(folder, f"{name}.txt", _text(_strip_weights(proto)), protected)
        name = "paint_buckets"
        buckets: dict[str, dict[str, list[str]]] = {
            "low": defaultdict(list),
            "fp32": defaultdict(list),
        }
        for n in report.nodes:  # INT8 reports add "int8"
            buckets.setdefault(n.precision, defaultdict(list))[n.op_type].append(n.name)
        data = {
            "final_lists": report.policy,
            "buckets": {
                k: {op: sorted(v) for op, v in sorted(d.items())} for k, d in buckets.items()
            },
            "nodes": [vars(n) for n in report.nodes],
        }
        _write(folder, "paint_buckets.json", json.dumps(data, indent=2), protected)
        lines = [f"target: {report.target}"]
        for cls in ("allow", "deny", "infer", "clear"):
            ops = report.policy.get(cls, [])
            lines.append(f"{cls.upper()} list: {', '.join(ops) if isinstance(ops, list) else ops}")
        lines.append("")
        lines += [
            f"{n.precision:4s} {n.op_type:20s} {n.name:40s} [{n.step}] {n.reason}"
            for n in report.nodes
        ]
        _write(folder, "paint_buckets.txt", "\n".join(lines) + "\n", protected)
        name = "report"
        _write(folder, "report.json", report.to_json(), protected)
    except OSError as exc:
        raise MixprecError(
            f"--log-dir {folder}: cannot write its {name} files ({exc.strerror or exc})"
        ) from None


def write_error_file(
    folder: str | os.PathLike[str], argv: Sequence[str], exc: BaseException
) -> Path | None:
    """Write ``folder/error.txt``: the command line, versions and ``exc``'s full traceback.

    Creates ``folder`` if needed. This runs on the failure path, so it never raises: on
    any problem it returns ``None`` instead of the file's path.
    """
    try:
        path = Path(folder) / ERROR_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = [
            f"command: {shlex.join(['mixprec', *argv])}",
            f"cwd: {os.getcwd()}",
            f"mixprec {__version__}, onnx {onnx.__version__}, onnx_ir {ir.__version__}, "
            f"python {platform.python_version()} ({sys.platform})",
            f"error: {type(exc).__name__}: {exc}",
            f"stage: {getattr(exc, 'stage', None) or '-'}",
            "",
            "".join(traceback.format_exception(exc)),
        ]
        path.write_text("\n".join(lines))
        return path
    except Exception:  # the failure path must not fail: the caller still reports exc
        return None
