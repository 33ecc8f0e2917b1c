"""Detection heads read as their users read them: decoded boxes, compared as detections.

A YOLO-style head is one tensor per image of anchors by features: ``[N, 4+C, A]``
(features first, as YOLOv8 exports it), ``[N, A, 4+C]`` or ``[N, A, 5+C]`` (an
objectness score after the box, as YOLOv5 exports it). Each anchor holds a box (centre x,
centre y, width, height) and C class scores. A detection is an anchor whose best class
score (times its objectness) reaches :data:`SCORE`, kept by per-class non-maximum
suppression at :data:`NMS_IOU`. Two sets of detections agree on a detection when a box of
the same class overlaps it at IoU >= :data:`MATCH_IOU`; :func:`detection_f1` is the F1 of
a candidate's detections against the reference's, which is what a user's mAP sees move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "MATCH_IOU",
    "NMS_IOU",
    "SCORE",
    "HeadLayout",
    "decode",
    "detection_f1",
    "head_layout",
]

#: The score a detection must reach (the usual YOLO confidence threshold).
SCORE = 0.25
#: Boxes of one class that overlap this much are one detection (NMS).
NMS_IOU = 0.45
#: A candidate's detection matches a reference one of the same class at this IoU.
MATCH_IOU = 0.5
#: Class counts after which a fifth feature is read as objectness ([N, A, 5+C]).
_WITH_OBJECTNESS = frozenset({1, 20, 80})
#: The most detections per image kept (as YOLO's exports do).
_MOST = 300


@dataclass(frozen=True)
class HeadLayout:
    """How a head's features lie: the feature axis (1 or 2), and whether the fifth
    feature is objectness."""

    axis: int
    objectness: bool

    @property
    def classes_from(self) -> int:
        return 5 if self.objectness else 4

    def describe(self, features: int) -> str:
        """``[N, 4+C, A], 80 classes``."""
        if self.axis == 1:
            order = "[N, 4+C, A]"
        else:
            order = "[N, A, 5+C]" if self.objectness else "[N, A, 4+C]"
        return f"{order}, {features - self.classes_from} classes"


def head_layout(shape: tuple[int, ...], sample: np.ndarray | None = None) -> HeadLayout | None:
    """The layout of a detection head of ``shape`` (one image's output), or None when the
    shape is not one: rank 3, a feature axis of 5 to 1,004 entries (box + at least one
    class) that is the shorter of the last two, and at least twice as many anchors.
    With a ``sample`` of its values, the scores must lie in [0, 1] and the box sizes be
    non-negative, as a decoded head's are."""
    if len(shape) != 3:
        return None
    features, anchors = sorted(shape[1:])
    if not 5 <= features <= 1004 or anchors < 2 * features:
        return None
    axis = 1 if shape[1] == features else 2
    objectness = axis == 2 and features - 5 in _WITH_OBJECTNESS
    layout = HeadLayout(axis, objectness)
    if sample is not None and not _looks_decoded(_rows(sample, layout), layout):
        return None
    return layout


def _rows(head: np.ndarray, layout: HeadLayout) -> np.ndarray:
    """``[N, A, F]`` float64 rows of a head in either layout."""
    rows = np.asarray(head, dtype=np.float64)
    return np.swapaxes(rows, 1, 2) if layout.axis == 1 else rows


def _looks_decoded(rows: np.ndarray, layout: HeadLayout) -> bool:
    finite = rows[np.all(np.isfinite(rows), axis=-1)]
    if finite.size == 0:
        return False
    scores = finite[:, 4:]
    sizes = finite[:, 2:4]
    return bool(scores.min() >= 0.0 and scores.max() <= 1.0 and sizes.min() >= 0.0)


def decode(head: np.ndarray, layout: HeadLayout) -> list[np.ndarray]:
    """Each image's detections as rows ``[x1, y1, x2, y2, score, class]``, after the
    score threshold and per-class NMS, best first."""
    out = []
    for rows in _rows(head, layout):
        rows = rows[np.all(np.isfinite(rows), axis=-1)]
        scores = rows[:, layout.classes_from :]
        if layout.objectness:
            scores = scores * rows[:, 4:5]
        cls = np.argmax(scores, axis=-1) if scores.shape[-1] else np.zeros(len(rows), int)
        best = scores[np.arange(len(rows)), cls] if scores.shape[-1] else np.zeros(len(rows))
        keep = best >= SCORE
        boxes = _corners(rows[keep, :4])
        found = np.concatenate([boxes, best[keep, None], cls[keep, None]], axis=1)
        out.append(_nms(found))
    return out


def _corners(cxcywh: np.ndarray) -> np.ndarray:
    cx, cy, w, h = (cxcywh[:, i] for i in range(4))
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one ``[x1, y1, x2, y2]`` box with each of ``boxes``."""
    x1 = np.maximum(box[0], boxes[:, 0])
    y1 = np.maximum(box[1], boxes[:, 1])
    x2 = np.minimum(box[2], boxes[:, 2])
    y2 = np.minimum(box[3], boxes[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return inter / np.maximum(area + areas - inter, 1e-12)


def _nms(found: np.ndarray) -> np.ndarray:
    """Per-class non-maximum suppression of detection rows, best first."""
    order = np.argsort(-found[:, 4], kind="stable")
    found = found[order]
    kept: list[int] = []
    for i in range(len(found)):
        same = [k for k in kept if found[k, 5] == found[i, 5]]
        if same and np.max(_iou(found[i, :4], found[same, :4])) > NMS_IOU:
            continue
        kept.append(i)
        if len(kept) == _MOST:
            break
    return found[kept]


def _matched(ref: np.ndarray, got: np.ndarray) -> int:
    """Detections of ``got`` that match one of ``ref`` (same class, IoU >= MATCH_IOU),
    each reference detection matched once, best scores first."""
    used = np.zeros(len(ref), bool)
    hits = 0
    for det in got:
        if not len(ref):
            break
        candidates = np.flatnonzero(~used & (ref[:, 5] == det[5]))
        if len(candidates) == 0:
            continue
        overlaps = _iou(det[:4], ref[candidates, :4])
        best = int(np.argmax(overlaps))
        if overlaps[best] >= MATCH_IOU:
            used[candidates[best]] = True
            hits += 1
    return hits


def detection_f1(
    refs: list[np.ndarray], gots: list[np.ndarray], layout: HeadLayout
) -> tuple[float, int]:
    """The F1 of the candidate's detections against the reference's over every image of
    the samples, and the detections counted (the reference's and the candidate's);
    1 where neither finds anything."""
    hits = total = 0
    for ref_head, got_head in zip(refs, gots, strict=True):
        for ref, got in zip(decode(ref_head, layout), decode(got_head, layout), strict=True):
            hits += _matched(ref, got)
            total += len(ref) + len(got)
    return (1.0 if total == 0 else 2.0 * hits / total), total
