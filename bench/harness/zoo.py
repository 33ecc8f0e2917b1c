"""The zoo bench of ``mixprec batch``: the bench's own models as a zoo folder, converted in
one command with 1 worker, 2 workers, and the Ray engine, in one run on one machine.

    MIXPREC_BENCH_CACHE=... .venv/bin/python -m bench.harness.zoo [--dtype fp16] [--models a,b]

(run ``bash bench/run.sh`` once first: it fetches and derives the models). The zoo folder
holds a link to each model with its eval inputs beside it as ``NAME.inputs.npz`` and its
calibration inputs as ``NAME.calib.npz`` (the batch's own convention), so every model is
validated on realistic inputs. Wall times are of the whole command (interpreter start,
imports and, for Ray, starting a local cluster included). Results: bench/results/<date>-zoo.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.common import BENCH_DIR, cache_dir, cpu_name
from bench.harness.models import MODELS

RESULTS = BENCH_DIR / "results"


def _zoo(folder: Path, names: list[str]) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    done = []
    for spec in MODELS:
        if names and spec.name not in names:
            continue
        source = spec.path()
        if not source.exists():
            print(f"zoo: {spec.name}: {source} missing (run bench/run.sh first)", file=sys.stderr)
            continue
        link = folder / f"{spec.name}.onnx"
        if not link.exists():
            link.symlink_to(source)
        np.savez(folder / f"{spec.name}.inputs.npz", **spec.make_inputs("eval"))
        np.savez(folder / f"{spec.name}.calib.npz", **spec.make_inputs("calib"))
        done.append(spec.name)
    return done


def _run(zoo: Path, out: Path, dtype: str, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "mixprec", "batch", str(zoo), "-o", str(out),
               "--dtype", dtype, "--validate", "-q", *extra]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    last = {}
    for row in rows:
        last[row["model"]] = row
    return {"args": " ".join(extra), "wall": wall, "exit": proc.returncode,
            "summary": proc.stdout.strip().splitlines()[-1:], "rows": last}


def _digest(out: Path, row: dict) -> str | None:
    if row.get("status") != "ok":
        return None
    return hashlib.sha256((out / row["output"]).read_bytes()).hexdigest()[:16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--work", default=str(cache_dir() / "zoo"), help="work folder")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray engine")
    parser.add_argument("--ray-address", default=None, help="also run on this Ray cluster")
    args = parser.parse_args()
    work = Path(args.work)
    zoo = work / "models"
    names = _zoo(zoo, [n for n in args.models.split(",") if n])
    runs = [("local, 1 worker", ["--workers", "1"]), ("local, 2 workers", ["--workers", "2"])]
    if not args.no_ray:
        runs.append(("ray (local cluster started by the command), 2 workers",
                     ["--engine", "ray", "--workers", "2"]))
    if args.ray_address:
        runs.append((f"ray (running head at {args.ray_address}), 2 workers",
                     ["--engine", "ray", "--workers", "2", "--ray-address", args.ray_address]))
    results = []
    for label, extra in runs:
        out = work / f"out-{len(results)}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        print(f"zoo: {label} ...", file=sys.stderr, flush=True)
        result = _run(zoo, out, args.dtype, extra)
        result["label"], result["out"] = label, out
        results.append(result)
        print(f"zoo: {label}: {result['wall']:.1f} s, {result['summary']}", file=sys.stderr)
    resumed = _run(zoo, results[1]["out"], args.dtype, ["--workers", "2", "--resume"])
    resumed["label"] = "local, 2 workers, --resume of the run above"
    _write(args, names, results, resumed)
    return 0


def _write(args, names: list[str], results: list[dict], resumed: dict) -> None:
    date = time.strftime("%Y-%m-%d")
    lines = [f"# mixprec batch zoo bench, {date}", "",
             f"Machine: {cpu_name()}, {len(os.sched_getaffinity(0))} usable cores. "
             f"Command: `.venv/bin/python -m bench.harness.zoo --dtype {args.dtype}` "
             f"(each run: `mixprec batch ZOO -o OUT --dtype {args.dtype} --validate -q` + the "
             "run's options; inputs beside each model by convention).", "",
             "| run | wall s | exit | ok | failed | error | timeout |",
             "|---|---|---|---|---|---|---|"]
    for r in [*results, resumed]:
        counts = {s: sum(1 for row in r["rows"].values() if row["status"] == s)
                  for s in ("ok", "failed", "error", "timeout")}
        lines.append(f"| {r['label']} | {r['wall']:.1f} | {r['exit']} | {counts['ok']} | "
                     f"{counts['failed']} | {counts['error']} | {counts['timeout']} |")
    lines += ["", "Per model (seconds in its worker, status, worst rel L2; outputs compared by "
              "sha256 across the runs):", "",
              "| model | " + " | ".join(r["label"] for r in results) + " | same bytes |",
              "|---|" + "---|" * (len(results) + 1)]
    for name in names:
        cells, digests = [], set()
        for r in results:
            row = r["rows"].get(f"{name}.onnx", {})
            err = (row.get("validation") or {}).get("worst_rel_l2")
            shown = err if err is None or isinstance(err, str) else f"{err:.2g}"  # "inf": str
            err_text = "" if shown is None else f", {shown}"
            cells.append(f"{row.get('seconds', 0):.1f} s {row.get('status', '?')}{err_text}")
            digests.add(_digest(r["out"], row))
        same = "yes" if len(digests) == 1 else "NO"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {same} |")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{date}-zoo.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"zoo: wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
