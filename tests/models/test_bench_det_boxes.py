"""The bench's box-level PP-OCR det score (bench/harness/det_boxes.py): rapidocr's text boxes from
a probability map, one-to-one IoU matching and the hmean, the metric function the
mixprec-metric row passes to ``mixprec quantize --metric``, and ocr_text.DetSet's scores.
numpy only: these run in mixprec's own environment too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.harness import det_boxes, ocr_text


def _two_lines() -> np.ndarray:
    prob = np.zeros((64, 128), np.float32)
    prob[10:20, 10:60] = 0.9  # rows 10-19, columns 10-59
    prob[40:48, 20:80] = 0.8
    return prob


def test_two_separated_blobs_make_two_unclipped_boxes() -> None:
    boxes = det_boxes.text_boxes(_two_lines())
    assert len(boxes) == 2
    # the 2x2 dilation grows the first region to rows 10-20, columns 10-60: a 50 x 10 box
    # through the extreme pixels' centres; unclip distance 50 * 10 * 1.6 / 120 = 6.67
    assert boxes[0] == (3.0, 3.0, 67.0, 27.0)
    # second: 60 x 8, distance 60 * 8 * 1.6 / 136 = 5.65
    assert boxes[1] == pytest.approx((14.0, 34.0, 86.0, 54.0))


def test_regions_are_8_connected_and_small_or_faint_ones_dropped() -> None:
    mask = np.zeros((12, 12), bool)
    mask[1:4, 1:4] = True
    mask[4:7, 4:7] = True  # touches the first only at a corner: one region
    mask[9, 9] = True
    assert det_boxes.regions(mask).tolist() == [[1, 1, 6, 6], [9, 9, 9, 9]]
    prob = np.zeros((40, 80), np.float32)
    prob[5:7, 5:70] = 0.9  # 2 rows (3 with the dilation): shorter side 2 < min_size 3
    prob[20:30, 5:70] = 0.35  # above thresh 0.3, box score 0.35 < box_thresh 0.5
    assert det_boxes.text_boxes(prob) == []
    assert len(det_boxes.text_boxes(prob, box_thresh=0.3)) == 1
    assert det_boxes.text_boxes(np.zeros((8, 8), np.float32)) == []


def test_matching_is_one_to_one_at_iou_half() -> None:
    assert det_boxes.iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert det_boxes.iou((0, 0, 10, 10), (10, 0, 20, 10)) == 0.0
    truth = [(0, 0, 100, 20)]
    # two found boxes over one line: one match, the other a false positive
    found = [(0, 0, 100, 20), (2, 0, 100, 20)]
    assert det_boxes.matches(found, truth) == 1
    got = det_boxes.hmean([found], [truth])
    assert got["precision"] == 0.5 and got["recall"] == 1.0
    assert got["hmean"] == pytest.approx(2 / 3)
    assert det_boxes.hmean([[]], [[]])["hmean"] == 1.0
    assert det_boxes.hmean([[]], [truth])["hmean"] == 0.0


def test_a_shifted_map_matches_by_iou() -> None:
    prob = _two_lines()
    ref = det_boxes.text_boxes(prob)
    near = det_boxes.text_boxes(np.roll(prob, (2, 3), axis=(0, 1)))
    far = det_boxes.text_boxes(np.roll(prob, 30, axis=1))
    assert det_boxes.hmean([near], [ref])["hmean"] == 1.0
    assert det_boxes.hmean([far], [ref])["hmean"] == 0.0
    # the metric function: per-sample output dicts, batch and channel axes kept
    fp32 = [{det_boxes.OUTPUT: prob[None, None]}, {det_boxes.OUTPUT: prob[None, None]}]
    int8 = [
        {det_boxes.OUTPUT: np.roll(prob, 2, axis=0)[None, None]},
        {det_boxes.OUTPUT: np.roll(prob, 30, axis=1)[None, None]},
    ]
    assert det_boxes.box_hmean(fp32, fp32) == 1.0
    assert det_boxes.box_hmean(fp32, int8) == pytest.approx(0.5)  # 2 of 4 boxes match


class _Session:
    """Stands in for an ORT session: each run returns the next map."""

    def __init__(self, maps: list[np.ndarray]) -> None:
        self.maps = iter(maps)

    def run(self, names: list[str], feeds: dict[str, Any]) -> list[np.ndarray]:
        assert names == [ocr_text.DET_OUTPUT] and feeds["x"].shape == (1, 3, 64, 128)
        return [next(self.maps)[None, None]]


def test_det_set_scores_against_the_lines_and_fp32() -> None:
    prob = _two_lines()
    lines = tuple(tuple(int(v) for v in b) for b in det_boxes.text_boxes(prob))
    pages = ocr_text.DetPages(
        np.zeros((2, 3, 64, 128), np.float32), ((), ()), ((), ()), (lines, lines)
    )
    found = ocr_text.DetSet(pages)
    fp32 = found.predict(_Session([prob, prob]))
    assert found.score(fp32, fp32)["accuracy"] == 1.0
    missed = prob.copy()
    missed[40:48] = 0.0  # the second line of the second page is gone
    got = found.score(found.predict(_Session([prob, missed])), fp32)
    assert got["lines"] == 4 and got["boxes"] == 3 and got["recall"] == 0.75
    assert got["accuracy"] == pytest.approx(6 / 7) and got["agreement"] == pytest.approx(6 / 7)
    assert 0.0 < got["pixel_f1"] < 1.0
