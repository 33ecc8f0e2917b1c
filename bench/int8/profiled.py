"""The speed plan's placement from ONNX Runtime's per-kernel profile, on the bench models
(issue 43, part 4): which layers the profile finds no faster in INT8, which placement the
plan then chooses, and the ratios to FP32 of 'all' and of the profiled placement, in two
runs of ``mixprec.quantize`` each (the guard off: speed only; calibration as the INT8
part's).

    .venv-bench/bin/python -m bench.int8.profiled [MODEL,MODEL ...]

Writes bench/results/<date>-int8-profiled.{json,md}.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import mixprec
from bench.harness.common import RESULTS_DIR, cpu_summary
from bench.harness.models import MODELS, int8_calibration

RUNS = 2


def _row(name: str, run: int, seconds: float, plan: dict[str, Any]) -> dict[str, Any]:
    ratio = plan.get("ratio", {})
    label = next((k for k in ratio if " but " in k), None)
    chosen = plan.get("chosen", "fp32")
    return {
        "model": name,
        "run": run,
        "seconds": round(seconds, 1),
        "chosen": chosen,
        "chosen_ratio": round(ratio.get(chosen, 1.0), 3),
        "all": round(ratio["all"], 3) if "all" in ratio else None,
        "profiled": round(ratio[label], 3) if label else None,
        "slower_layers": {k: round(v, 2) for k, v in (plan.get("profiled") or {}).items()},
    }


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"# INT8 placement from ONNX Runtime's profile ({time.strftime('%Y-%m-%d')})",
        "",
        f"CPU: {cpu_summary()}. Command: `.venv-bench/bin/python -m bench.int8.profiled`: "
        "`mixprec.quantize(model, calibration, guard=False)` (speed auto) twice per model; "
        "ratios are the plan's paired medians to FP32 in ONNX Runtime.",
        "",
        "| model | run | chosen | its ratio | 'all' | profiled | layers the profile keeps float |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        layers = len(r["slower_layers"])
        chosen = "profiled" if " but " in r["chosen"] else r["chosen"]
        lines.append(
            f"| {r['model']} | {r['run']} | {chosen} | {r['chosen_ratio']} | {r['all']} "
            f"| {r['profiled'] if r['profiled'] is not None else '-'} | {layers} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    wanted = set(argv[0].split(",")) if argv else {m.name for m in MODELS}
    rows = []
    for spec in (m for m in MODELS if m.name in wanted):
        calibration = int8_calibration(spec)
        for run in range(RUNS):
            start = time.perf_counter()
            result = mixprec.quantize(str(spec.path()), calibration, guard=False)
            plan = (result.report.quantization or {}).get("speed") or {}
            rows.append(_row(spec.name, run, time.perf_counter() - start, plan))
            print(json.dumps(rows[-1]), flush=True)
    stem = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-int8-profiled"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    stem.with_suffix(".md").write_text(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
