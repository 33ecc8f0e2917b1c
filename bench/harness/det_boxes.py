"""Text boxes from a DB text probability map as rapidocr makes them, and box-level F1.

Self-contained (numpy only, no other bench module): int8.py copies this file as the metric
module of the ``mixprec-metric`` row, which mixprec's CLI imports in its own environment.

``text_boxes`` follows rapidocr-onnxruntime 1.4.4's det post-processing (DBPostProcess with
its config.yaml: thresh 0.3, box_thresh 0.5, unclip_ratio 1.6, use_dilation, score_mode
fast, min_size 3; then TextDetector.filter_tag_det_res), with one simplification: its boxes
are minimum-area rectangles (cv2.minAreaRect) and the unclip is a polygon offset
(pyclipper), here they are axis-aligned. The bench renders horizontal lines, whose regions'
minimum-area rectangles are axis-aligned, and the offset of an axis-aligned rectangle,
boxed again, is the rectangle grown by the offset distance on every side. Step by step:

1. ``map > 0.3``, dilated by a 2x2 kernel (cv2.dilate's anchor: a pixel is set when it or
   its upper, left or upper-left neighbour is);
2. 8-connected regions (cv2.findContours' outer contours; the holes RETR_LIST also lists
   are not boxes here);
3. the region's box through its extreme pixels' centres, (x0, y0, x1, y1); dropped when
   its shorter side is under min_size (3);
4. box score = mean probability over the pixels of that box (score_mode "fast"); kept when
   at least box_thresh (0.5);
5. unclip: distance = area * 1.6 / perimeter of the box, the box grown by that on every
   side; dropped when its shorter side is under min_size + 2; rounded, clipped to the
   image; dropped when a side is 3 px or less.

``hmean`` matches found boxes to reference boxes one to one, greedily by IoU (highest
first), a pair counting when its IoU is at least 0.5 (the ICDAR-style detection measure),
and returns precision, recall and their harmonic mean summed over all pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

THRESH = 0.3
BOX_THRESH = 0.5
UNCLIP_RATIO = 1.6
MIN_SIZE = 3
MIN_IOU = 0.5
#: PP-OCRv4 det's output: the 1x1xHxW text probability map.
OUTPUT = "sigmoid_0.tmp_0"

Box = tuple[float, float, float, float]  # x0, y0, x1, y1


def dilate(mask: np.ndarray) -> np.ndarray:
    """cv2.dilate with a 2x2 kernel of ones at its default anchor (1, 1)."""
    out = mask.copy()
    out[1:, :] |= mask[:-1, :]
    out[:, 1:] |= out[:, :-1].copy()
    return out


def regions(mask: np.ndarray) -> np.ndarray:
    """Bounding boxes of the 8-connected regions of a boolean HxW mask, as an int array of
    (column min, row min, column max, row max) rows (pixel indices, inclusive), in the
    order of each region's first run (row-major)."""
    h, w = mask.shape
    padded = np.zeros((h, w + 2), dtype=np.int8)
    padded[:, 1:-1] = mask
    step = np.diff(padded, axis=1)
    rows, starts = np.nonzero(step == 1)
    _, ends = np.nonzero(step == -1)  # exclusive; row-major order pairs them with starts
    if len(rows) == 0:
        return np.zeros((0, 4), dtype=np.int64)
    parent = np.arange(len(rows))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    first = np.searchsorted(rows, np.arange(h + 1))  # runs of row r: first[r]:first[r + 1]
    for r in range(1, h):
        above = slice(first[r - 1], first[r])
        if above.start == above.stop:
            continue
        up_starts, up_ends = starts[above], ends[above]
        for i in range(first[r], first[r + 1]):
            # runs above that touch this one, diagonals included: start <= end, end >= start
            lo = above.start + int(np.searchsorted(up_ends, starts[i], side="left"))
            hi = above.start + int(np.searchsorted(up_starts, ends[i], side="right"))
            for j in range(lo, hi):
                a, b = root(i), root(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    labels = np.array([root(i) for i in range(len(rows))])
    uniq, index = np.unique(labels, return_inverse=True)
    boxes = np.empty((len(uniq), 4), dtype=np.int64)
    boxes[:, 0:2] = np.iinfo(np.int64).max
    boxes[:, 2:4] = np.iinfo(np.int64).min
    np.minimum.at(boxes[:, 0], index, starts)
    np.minimum.at(boxes[:, 1], index, rows)
    np.maximum.at(boxes[:, 2], index, ends - 1)
    np.maximum.at(boxes[:, 3], index, rows)
    return boxes


def text_boxes(prob: np.ndarray, thresh: float = THRESH, box_thresh: float = BOX_THRESH,
               unclip_ratio: float = UNCLIP_RATIO) -> list[Box]:
    """rapidocr's text boxes (x0, y0, x1, y1) from an HxW probability map (module doc)."""
    prob = np.asarray(prob, dtype=np.float32)
    if prob.ndim != 2:
        raise ValueError(f"a 2-D probability map, got shape {prob.shape}")
    h, w = prob.shape
    found: list[Box] = []
    for c0, r0, c1, r1 in regions(dilate(prob > thresh)):
        bw, bh = float(c1 - c0), float(r1 - r0)
        if min(bw, bh) < MIN_SIZE:
            continue
        if float(prob[r0:r1 + 1, c0:c1 + 1].mean()) < box_thresh:
            continue
        distance = bw * bh * unclip_ratio / (2.0 * (bw + bh))
        if min(bw, bh) + 2 * distance < MIN_SIZE + 2:
            continue
        x0, x1 = (float(np.clip(np.round(v), 0, w - 1)) for v in (c0 - distance, c1 + distance))
        y0, y1 = (float(np.clip(np.round(v), 0, h - 1)) for v in (r0 - distance, r1 + distance))
        if int(x1 - x0) <= 3 or int(y1 - y0) <= 3:
            continue
        found.append((x0, y0, x1, y1))
    return found


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Intersection over union of two (x0, y0, x1, y1) rectangles."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def matches(found: Sequence[Sequence[float]], truth: Sequence[Sequence[float]],
            min_iou: float = MIN_IOU) -> int:
    """Pairs of one found and one true box with IoU >= ``min_iou``, each box in one pair at
    most, chosen greedily from the highest IoU down."""
    pairs = sorted(((iou(f, t), i, j) for i, f in enumerate(found) for j, t in enumerate(truth)),
                   reverse=True)
    used_f: set[int] = set()
    used_t: set[int] = set()
    for value, i, j in pairs:
        if value < min_iou:
            break
        if i not in used_f and j not in used_t:
            used_f.add(i)
            used_t.add(j)
    return len(used_f)


def hmean(found_pages: Iterable[Sequence[Sequence[float]]],
          truth_pages: Iterable[Sequence[Sequence[float]]],
          min_iou: float = MIN_IOU) -> dict[str, Any]:
    """Box precision, recall and hmean (F1) over pages (found vs truth, page by page, the
    counts summed); 1.0 each where neither side has a box."""
    matched = found = truth = 0
    for f, t in zip(found_pages, truth_pages, strict=True):
        matched += matches(f, t, min_iou)
        found += len(f)
        truth += len(t)
    precision = matched / found if found else 1.0 if not truth else 0.0
    recall = matched / truth if truth else 1.0 if not found else 0.0
    total = found + truth
    return {"precision": precision, "recall": recall,
            "hmean": 2.0 * matched / total if total else 1.0,
            "matched": matched, "found": found, "truth": truth}


def maps(outputs: Sequence[dict[str, np.ndarray]], name: str | None = None) -> list[np.ndarray]:
    """Every HxW map of output ``name`` (default OUTPUT) in a list of output dicts (each
    N x 1 x H x W or N x H x W)."""
    found = []
    for out in outputs:
        array = np.asarray(out[OUTPUT if name is None else name])
        found += list(array.reshape(-1, *array.shape[-2:]))
    return found


def box_hmean(fp32_outputs: Sequence[dict[str, np.ndarray]],
              int8_outputs: Sequence[dict[str, np.ndarray]]) -> float:
    """``mixprec quantize --metric`` function: the hmean of the quantized model's text
    boxes against FP32's boxes, over every page of every sample (higher is better); the
    map is output OUTPUT (int8.py's copy of this module sets it after this definition)."""
    return hmean([text_boxes(m) for m in maps(int8_outputs)],
                 [text_boxes(m) for m in maps(fp32_outputs)])["hmean"]
