"""Two models of kinds the bench's own lacked, with their inputs and their users' own
post-processing as the probe (issue 43's held-out kinds; pinned in corpus.tsv):

* **nudenet 3.4.2's 320n.onnx**, a YOLOv8n detector: ``images [N, 3, 320, 320]`` ->
  ``output0 [N, 22, 2100]`` (4 box coordinates in pixels beside 18 class scores in
  [0, 1]). Inputs: 320x320 crops of real photographs (matplotlib's Grace Hopper,
  scikit-learn's China and flower), RGB / 255, the calibration and eval crops drawn from
  different seeds. Probe: nudenet's own post-processing (score >= 0.2, per-class NMS at
  IoU 0.45), detections matched by class at IoU >= 0.5, F1 against FP32's.
* **basic-pitch 0.4.0's nmp.onnx** (Spotify), a note transcriber: 2 s of audio at
  22.05 kHz ``[N, 43844, 1]`` -> note ``[N, 172, 88]``, onset ``[N, 172, 88]`` and
  contour ``[N, 172, 264]``, each a Sigmoid. Inputs: windows of the two singing-voice
  clips its sdist ships (vocadito_14 to calibrate, vocadito_10 to evaluate), resampled
  from 44.1 kHz. Probe: basic-pitch's own thresholds (frames at 0.3, onsets at 0.5),
  decision F1 against FP32's, and the contour's argmax bin per frame.
"""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

from bench.harness.common import corpus_dir
from bench.harness.evaluate import decision_f1

__all__ = ["PEERS", "peer_inputs", "probe"]

PEERS = ("nudenet_yolov8n", "basic_pitch")
_WINDOW = 43844
_NOTE, _ONSET, _CONTOUR = (f"StatefulPartitionedCall:{k}" for k in (1, 2, 0))


def path_of(name: str) -> Path:
    local = {"nudenet_yolov8n": "nudenet_320n.onnx", "basic_pitch": "basic_pitch_nmp.onnx"}
    return corpus_dir() / local[name]


def _photos() -> list[np.ndarray]:
    import matplotlib
    from PIL import Image
    from sklearn.datasets import load_sample_images

    hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return [np.asarray(Image.open(hopper).convert("RGB")), *load_sample_images().images]


def _crops(seed: int, count: int) -> np.ndarray:
    """``count`` 320x320 crops (scaled 0.5-1.0 of the shorter side) of the photos."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos = _photos()
    out = []
    for k in range(count):
        photo = photos[k % len(photos)]
        h, w = photo.shape[:2]
        side = int(min(h, w) * rng.uniform(0.5, 1.0))
        y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
        crop = Image.fromarray(photo[y : y + side, x : x + side]).resize((320, 320))
        out.append(np.asarray(crop, dtype=np.float32).transpose(2, 0, 1) / 255.0)
    return np.stack(out)


def _audio(name: str) -> np.ndarray:
    """A clip at 22.05 kHz (44.1 kHz halved by averaging pairs), mono, in [-1, 1]."""
    with wave.open(str(corpus_dir() / name)) as clip:
        frames = clip.readframes(clip.getnframes())
        channels, width = clip.getnchannels(), clip.getsampwidth()
    samples = np.frombuffer(frames, dtype={2: np.int16, 4: np.int32}[width]).astype(np.float32)
    samples = samples.reshape(-1, channels).mean(axis=1) / float(2 ** (8 * width - 1))
    samples = samples[: len(samples) // 2 * 2].reshape(-1, 2).mean(axis=1)
    return samples


def _windows(name: str, hop: int) -> np.ndarray:
    audio = _audio(name)
    starts = range(0, max(len(audio) - _WINDOW, 0) + 1, hop)
    return np.stack([audio[s : s + _WINDOW] for s in starts])[:, :, None].astype(np.float32)


def peer_inputs(name: str, split: str) -> list[dict[str, np.ndarray]]:
    """Calibration samples (``split="calib"``) or the eval samples, one batch each."""
    if name == "nudenet_yolov8n":
        images = _crops(11 if split == "calib" else 23, 32 if split == "calib" else 16)
        return [{"images": images[k : k + 4]} for k in range(0, len(images), 4)]
    clip = "vocadito_14.wav" if split == "calib" else "vocadito_10.wav"
    windows = _windows(clip, _WINDOW // 4)
    return [{"serving_default_input_2:0": windows[k : k + 2]} for k in range(0, len(windows), 2)]


def _detections(head: np.ndarray) -> list[np.ndarray]:
    """nudenet's own decoding: per image, rows ``x1 y1 x2 y2 score class`` kept at score
    >= 0.2 and by per-class NMS at IoU 0.45."""
    found = []
    for rows in np.swapaxes(head, 1, 2):
        scores = rows[:, 4:]
        cls = scores.argmax(axis=1)
        best = scores.max(axis=1)
        keep = best >= 0.2
        cx, cy, w, h = rows[keep, :4].T
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2, best[keep], cls[keep]], 1)
        boxes = boxes[np.argsort(-boxes[:, 4])]
        kept: list[np.ndarray] = []
        for box in boxes:
            if all(k[5] != box[5] or _iou(k, box) <= 0.45 for k in kept):
                kept.append(box)
        found.append(np.array(kept).reshape(-1, 6))
    return found


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return float(w * h / max(union, 1e-12))


def _f1(ref: list[np.ndarray], got: list[np.ndarray]) -> tuple[float, int]:
    hits = total = 0
    for want, have in zip(ref, got, strict=True):
        used: set[int] = set()
        for box in have:
            match = next((i for i, r in enumerate(want) if i not in used and r[5] == box[5]
                          and _iou(r, box) >= 0.5), None)  # fmt: skip
            if match is not None:
                used.add(match)
                hits += 1
        total += len(want) + len(have)
    return (1.0 if total == 0 else 2 * hits / total), total


def probe(name: str, ref: list[dict], got: list[dict]) -> str:
    """The probe's agreement of ``got`` with ``ref`` (FP32's outputs on the eval samples)."""
    if name == "nudenet_yolov8n":
        f1, count = _f1(
            [d for r in ref for d in _detections(r["output0"])],
            [d for g in got for d in _detections(g["output0"])],
        )
        return f"detections F1 {f1:.3f} ({count} detections)"
    cat = lambda outs, key: np.concatenate([o[key] for o in outs])  # noqa: E731
    frames = decision_f1(cat(ref, _NOTE), cat(got, _NOTE), 0.3)
    onsets = decision_f1(cat(ref, _ONSET), cat(got, _ONSET), 0.5)
    bins = float(np.mean(cat(ref, _CONTOUR).argmax(-1) == cat(got, _CONTOUR).argmax(-1)))
    return f"note frames F1 {frames:.3f}, onsets F1 {onsets:.3f}, contour bins {bins:.3f}"
