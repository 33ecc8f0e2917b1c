"""Small torch modules for the mixprec.torch tests, seeded and with trained-like statistics."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ResidualCNN(nn.Module):
    """Conv-BN-ReLU stem, two residual blocks with BatchNorm, pooling, a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(16, 16, 3, padding=1),
                nn.BatchNorm2d(16),
                nn.ReLU(),
                nn.Conv2d(16, 16, 3, padding=1),
                nn.BatchNorm2d(16),
            )
            for _ in range(2)
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean(dim=(2, 3)))


class Encoder(nn.Module):
    """A 2-layer TransformerEncoder over a padded batch; ``padding_mask`` True = padding."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x, src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


class Recurrent(nn.Module):
    """An LSTM returning the last step's scores and its final state, nested as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size=8, hidden_size=16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1]), (h, c)


class DictOut(nn.Module):
    """Returns a dict with a nested list, as many model zoos do."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(12, 24), nn.Tanh())
        self.classifier = nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        feats = self.features(x)
        return {"logits": self.classifier(feats), "extra": [feats, feats.norm(dim=-1)]}


def batchnorm_statistics(module: nn.Module, seed: int) -> None:
    """Give every BatchNorm non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.weight.data.copy_(torch.rand(n, generator=g) * 0.5 + 0.75)
            m.bias.data.copy_(torch.randn(n, generator=g) * 0.1)
