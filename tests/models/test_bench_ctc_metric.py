"""The mixprec-metric row's CTC metric for PP-OCR rec (bench/int8/suite.py ``CTC_METRIC``): the
module the bench writes for ``mixprec quantize --metric`` reads per-timestep class scores
as greedy CTC text and scores INT8's characters against FP32's."""

from __future__ import annotations

import importlib.util

import numpy as np

from bench.harness import models
from bench.int8 import suite as int8


def _scores(ids: list[int], classes: int = 6) -> np.ndarray:
    """1 x T x classes one-hot scores for the class ids of each timestep."""
    out = np.full((1, len(ids), classes), 0.01, np.float32)
    out[0, np.arange(len(ids)), ids] = 0.95
    return out


def test_the_ctc_metric_reads_text_as_a_recogniser_user_does(tmp_path):
    ref = int8.write_metric(models.model_by_name("ppocr_rec"), tmp_path)
    path, function = ref.rsplit(":", 1)
    spec = importlib.util.spec_from_file_location("ctc_metric", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    score = getattr(module, function)
    name = module.OUTPUT
    fp32 = [{name: _scores([0, 3, 3, 0, 4, 0, 5, 5])}]  # text 3 4 5
    # blanks moved and repeats split differently: the same text, no loss
    same = [{name: _scores([3, 0, 0, 4, 4, 4, 0, 5])}]
    assert score(fp32, same) == 1.0
    # one character of three read as another: 1/3 lost
    other = [{name: _scores([0, 3, 3, 0, 2, 0, 5, 5])}]
    assert np.isclose(score(fp32, other), 2 / 3)
    # per timestep, 'same' agrees with FP32 on 3 of 8 positions: top-1 would call it a loss
    top1 = np.mean(fp32[0][name].argmax(-1) == same[0][name].argmax(-1))
    assert top1 < 0.5
