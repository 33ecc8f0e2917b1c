"""Golden results: what each command writes for the bench's models, as hashes, before a
refactoring moves code (issue 44), and a check that it writes the same after.

For each model: ``convert`` to fp16 and to bf16 (calibrated on the model's "calib" split),
INT8 ``quantize`` on the bench's INT8 calibration samples (``speed="off"``, the guard on,
``accept_unconfirmed=True`` so that the INT8 graph itself is recorded, not the input the
default keeps for want of confirming rows), and weight-only INT4 for the models with
MatMul weights (MiniLM). Each result is recorded as the sha256 of its model (serialized
deterministically) and of its decisions (each node's precision and reason, in order),
with the last line and the nodes kept float, so that a difference says where it lies.

INT8 weights depend on the CPU (7-bit weights without VNNI) and every result on the
library versions, so a golden file names its CPU flags and versions, and ``--check``
compares only a file made on the same kind of CPU.

Usage (the bench venv, in bench/):
    .venv-bench/bin/python -m bench.harness.golden record results/golden-avx512.json [MODEL ...]
    .venv-bench/bin/python -m bench.harness.golden check results/golden-avx512.json [MODEL ...]
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnxruntime

import mixprec
from bench.harness.common import cpu_summary
from bench.harness.models import MODELS, int8_calibration, model_by_name
from mixprec.runtime.cpu import cpu_features

#: The models with MatMul weights weight-only quantization applies to.
WEIGHT_ONLY = ("minilm",)
#: The CPU flags that change what INT8 and bf16 write (a golden file holds for them).
KIND_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _record(result: Any) -> dict[str, Any]:
    """A result's hashes and what a difference would be read by."""
    report = result.report
    decisions = [(n.name, n.op_type, n.precision, n.reason) for n in report.nodes]
    proto = result.model_proto.SerializeToString(deterministic=True)
    kept = sorted(n.name for n in report.nodes if n.precision in ("fp32", "float32"))
    guard = report.guard or {}
    return {
        "model_sha256": _digest(proto),
        "decisions_sha256": _digest(json.dumps(decisions).encode()),
        "nodes": len(decisions),
        "kept_float": len(kept),
        "summary": str(guard.get("summary", "")),
    }


def _commands(name: str) -> dict[str, Callable[[], Any]]:
    spec = model_by_name(name)
    path = str(spec.path())
    calib = [spec.make_inputs("calib")]
    commands: dict[str, Callable[[], Any]] = {
        "convert fp16": lambda: mixprec.convert(path, "fp16", calibration_data=calib),
        "convert bf16": lambda: mixprec.convert(path, "bf16", calibration_data=calib),
        "quantize int8": lambda: mixprec.quantize(
            path, int8_calibration(spec), speed="off", accept_unconfirmed=True
        ),
    }
    if name in WEIGHT_ONLY:
        commands["quantize int4"] = lambda: mixprec.quantize(path, calib, weights="int4")
    return commands


def machine() -> dict[str, Any]:
    """The CPU kind and versions a golden file holds for."""
    return {
        "cpu": cpu_summary(),
        "flags": [f for f in KIND_FLAGS if f in cpu_features().flags],
        "versions": {m.__name__: m.__version__ for m in (mixprec, onnx, onnxruntime)},
    }


def golden(names: list[str]) -> dict[str, Any]:
    """Every command's record on the models ``names``."""
    results: dict[str, Any] = {}
    for name in names:
        for command, run in _commands(name).items():
            print(f"golden: {name}: {command}", flush=True)
            results[f"{name} / {command}"] = _record(run())
    return {**machine(), "results": results}


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each result whose hashes changed, with what it was and is (only the keys in both)."""
    lines = []
    for key, was in before["results"].items():
        now = after["results"].get(key)
        if now is None:
            continue
        changed = [k for k in ("model_sha256", "decisions_sha256") if was[k] != now[k]]
        if changed:
            lines.append(
                f"{key}: {', '.join(changed)} changed (kept float {was['kept_float']} -> "
                f"{now['kept_float']}; last line was {was['summary']!r}, now {now['summary']!r})"
            )
    return lines


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ("record", "check"):
        usage = "usage: python -m bench.harness.golden record|check FILE.json [MODEL ...]"
        print(usage, file=sys.stderr)
        return 2
    mode, file = argv[0], Path(argv[1])
    names = argv[2:] or [spec.name for spec in MODELS]
    if mode == "check":  # before any command runs: another kind's file cannot be compared
        before, here = json.loads(file.read_text()), machine()
        if (before["flags"], before["versions"]) != (here["flags"], here["versions"]):
            print(
                f"golden: {file} was made on another CPU kind or versions ({before['cpu']}, "
                f"{before['versions']}): record one here first"
            )
            return 2
    found = golden(names)
    if mode == "record":
        file.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
        print(f"golden: wrote {len(found['results'])} results to {file}")
        return 0
    lines = differences(before, found)
    print("\n".join(lines) or f"golden: the same {len(found['results'])} results as {file}")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
