"""Fixtures the optimize tests share: the separable classifier as a file, and its samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from guard_models import separable_classifier, separable_samples


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.onnx"
    onnx.save(separable_classifier(), path)
    return path


@pytest.fixture
def samples() -> list[dict[str, np.ndarray]]:
    return separable_samples(12, rows=16)
