"""Convert a PyTorch module to FP16 with mixprec.torch, run it, save it and load it back.

pip install -e ".[torch]"
python examples/torch_module.py [OUT_DIR]     # default: ./tiny_cnn_fp16
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import mixprec.torch


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.features(images).mean(dim=(2, 3))
        return {"logits": self.classifier(features), "features": features}


def main(out_dir: str) -> None:
    torch.manual_seed(0)
    model = TinyCNN().eval()
    images = torch.randn(8, 3, 32, 32)

    # Export (batch dimension dynamic), convert to FP16, check against eager PyTorch:
    # raises mixprec.torch.TorchCheckError if an output's relative L2 error exceeds 1e-2.
    fast = mixprec.torch.convert_module(model, (images,), dtype="fp16")
    print(fast)
    print(fast.check.format_table())

    # Call it like the original: same output structure, any batch size.
    batch = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = model(batch)
    got = fast(batch)
    error = (got["logits"] - expected["logits"]).abs().max().item()
    print(f"batch of 3: max abs error of the logits {error:.2e}")

    # A folder with the ONNX model and two JSON files; loading needs no TinyCNN class.
    fast.save(out_dir)
    again = mixprec.torch.load(out_dir)
    assert torch.equal(again(batch)["logits"], got["logits"])
    print(f"saved to {out_dir} and loaded back")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny_cnn_fp16")
