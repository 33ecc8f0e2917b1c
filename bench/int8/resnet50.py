"""ResNet-50 INT8 beside ORT U8S8: latency at batch 1, throughput at batch 32 (issue 26).

MXNet's INT8 flow reported 2.73x throughput on ResNet-50. No pretrained ResNet-50 ships in
a PyPI package this project may use, and torchvision's wheel does not import beside the
project's torch, so the architecture is written here in torch (torchvision's layout:
Bottleneck blocks [3, 4, 6, 3], stride on the 3x3 conv) with **random weights**
(seeded). BatchNorm running statistics are set by forward passes over photo-like images
in train mode, so activations have realistic scales; the weights mean nothing, so only
speed is claimed here, never accuracy (the rel L2 column only says the INT8 model still
computes the same function).

    .venv-bench/bin/python -m bench.int8.resnet50  # writes bench/results/<date>-resnet50.md

Steps: export FP32 ONNX (opset 17) -> quantize with mixprec (CLI, defaults: speed plan,
guard) and ORT quantize_static U8S8 (bench/int8/quantize_one.py), each in a child process with
wall time and peak RSS -> time FP32 / mixprec / ORT interleaved at batch 1 (latency) and
batch 32 (throughput), 2 threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.harness.common import (
    REPO_ROOT,
    cpu_summary,
    derived_dir,
    module_command,
    result_row,
    run_measured,
)
from bench.harness.evaluate import THREADS, session
from bench.harness.models import natural_images
from mixprec.core.metrics import rel_l2_error

SEED = 50
CALIB_SAMPLES = 16


def build_resnet50():
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int) -> None:
            super().__init__()
            width, out = planes, planes * 4
            self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            nn.init.zeros_(self.bn3.weight)  # torchvision's zero_init_residual: stable depth
            self.bn3.weight.data += 0.2
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or inplanes != out:
                self.down = nn.Sequential(
                    nn.Conv2d(inplanes, out, 1, stride, bias=False), nn.BatchNorm2d(out)
                )

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            return self.relu(self.bn3(self.conv3(y)) + identity)

    class ResNet50(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                nn.BatchNorm2d(64),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )
            layers, inplanes = [], 64
            for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                for k in range(blocks):
                    layers.append(Bottleneck(inplanes, planes, stride if k == 0 else 1))
                    inplanes = planes * 4
            self.layers = nn.Sequential(*layers)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(2048, 1000)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))

    torch.manual_seed(SEED)
    return ResNet50()


def images(split: str, n: int) -> np.ndarray:
    """Photo-like NCHW images, ImageNet-normalized."""
    rng = np.random.default_rng(SEED + (0 if split == "calib" else 1))
    x = natural_images(rng, n, 224, 224).transpose(0, 3, 1, 2)
    mean = np.array([0.485, 0.456, 0.406], np.float32)[:, None, None]
    std = np.array([0.229, 0.224, 0.225], np.float32)[:, None, None]
    return ((x - mean) / std).astype(np.float32)


def export(path: Path) -> None:
    import torch

    model = build_resnet50()
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None  # cumulative average over the passes below
    with torch.no_grad():
        for k in range(4):
            model(torch.from_numpy(images("calib", 64)[16 * k : 16 * (k + 1)]))
    model.eval()
    torch.onnx.export(
        model,
        (torch.from_numpy(images("calib", 1)),),
        str(path),
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )


def timed(sessions: dict[str, object], feeds: dict[str, np.ndarray], seconds: float) -> dict:
    """Median seconds per run of each session, interleaved rounds (>= 10 rounds)."""
    for s in sessions.values():
        s.run(None, feeds)
    times: dict[str, list[float]] = {k: [] for k in sessions}
    began, rounds = time.perf_counter(), 0
    while rounds < 10 or time.perf_counter() - began < seconds:
        for k, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds)
            times[k].append(time.perf_counter() - t)
        rounds += 1
    return {k: statistics.median(v) for k, v in times.items()}


def quantize(tool: str, src: Path, out: Path, calib: Path, work: Path) -> dict:
    result, log = work / f"{tool}.json", work / f"{tool}.log"
    cmd = [
        *module_command("int8.quantize_one"),
        tool,
        str(src),
        str(out),
        str(result),
        "--calib-dir",
        str(calib),
    ]
    proc = run_measured(cmd, 1800, log)
    return result_row(proc, result, log, 1800, "quantize_one.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="timing per batch size")
    parser.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    work = derived_dir() / "resnet50"
    work.mkdir(parents=True, exist_ok=True)
    src = work / "resnet50.onnx"
    if not src.is_file():
        export(src)
    calib = work / "calib"
    calib.mkdir(exist_ok=True)
    for k, x in enumerate(images("calib", CALIB_SAMPLES)):
        np.savez(calib / f"sample_{k:02d}.npz", x=x[None])
    rows = {}
    for tool in ("mixprec", "ort-u8s8"):
        rows[tool] = quantize(tool, src, work / f"resnet50_{tool}.onnx", calib, work)
    sessions = {"fp32": session(str(src))}
    for tool, row in rows.items():
        if row.get("status") == "ok":
            sessions[tool] = session(str(work / f"resnet50_{tool}.onnx"))
    evals = images("eval", 32)
    ref = sessions["fp32"].run(None, {"x": evals[:8]})[0]
    for tool in rows:
        if tool in sessions:
            got = sessions[tool].run(None, {"x": evals[:8]})[0]
            rows[tool]["rel_l2"] = rel_l2_error(ref, got)
            rows[tool]["top1"] = float(np.mean(got.argmax(1) == ref.argmax(1)))
    lat = timed(sessions, {"x": evals[:1]}, args.seconds)
    thr = timed(sessions, {"x": evals}, args.seconds)
    report(args.results, rows, lat, thr)
    return 0


def report(folder: Path, rows: dict, lat: dict, thr: dict) -> None:
    lines = [
        f"# ResNet-50 INT8, {datetime.date.today()}",
        "",
        f"CPU: {cpu_summary()}; ORT {THREADS} threads. "
        "Command: `.venv-bench/bin/python -m bench.int8.resnet50`.",
        "Random weights (torchvision's architecture written in torch, BatchNorm statistics from "
        "photo-like images): speed only; rel L2 and top-1 say the INT8 model computes the same "
        "function, not that it classifies photos.",
        "",
        "| tool | status | batch 1 ms | latency / FP32 | batch 32 img/s | throughput / FP32 | "
        "rel L2 | top-1 vs FP32 | quantize s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| fp32 | – | {lat['fp32'] * 1e3:.1f} | 1.00 | {32 / thr['fp32']:.1f} | 1.00 "
        "| – | – | – | – |",
    ]
    for tool, row in rows.items():
        if tool not in lat:
            lines.append(
                f"| {tool} | {row.get('status')}: {row.get('error', '')[:80]} |" + " |" * 8
            )
            continue
        lines.append(
            f"| {tool} | ok | {lat[tool] * 1e3:.1f} | {lat[tool] / lat['fp32']:.2f} | "
            f"{32 / thr[tool]:.1f} | {thr['fp32'] / thr[tool]:.2f} | {row['rel_l2']:.2e} | "
            f"{row['top1']:.0%} | {row.get('wall_s', 0):.1f} | {row.get('peak_rss_mb') or 0:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{datetime.date.today()}-resnet50.md"
    out.write_text(text)
    (folder / f"{datetime.date.today()}-resnet50.json").write_text(
        json.dumps(
            {"rows": rows, "latency_s": lat, "throughput_s_per_32": thr}, indent=1, default=str
        )
    )
    print(text)


if __name__ == "__main__":
    sys.exit(main())
