"""Labelled PP-OCR text: real English rendered into the rec and cls lines and det pages.

Text: gensim 4.4.0's test data (corpus.tsv), split as llm_eval.py splits it: eval lines come
from the held-out files (``lee.cor``, ``para2para_text1/2.txt``), calibration lines from
``lee_background.cor`` (300 other Lee news documents), so no line is in both. Fonts: the
DejaVu TTFs that ship inside matplotlib's wheel (nothing is downloaded). Each line gets its
own seeded font, size, ink and paper colour, paper shading, margins, blur and noise, and is
fed as PaddleOCR feeds a detected line: resized to height 48 keeping its aspect ratio (width
at most the model's), normalised to (x / 255 - 0.5) / 0.5, i.e. [-1, 1], and padded on the
right with zeros.

* rec (PP-OCRv4, 1x3x48x320): the words of each line fill a seeded share (70-100%) of the
  320 columns at its own font; read by greedy CTC decoding (blank = index 0, then the
  dictionary from the model's ``character`` metadata, then a space), scored against the
  text: character accuracy (1 - edit distance / length, over all lines), exact lines.
* cls (mobile v2.0, Nx3x48x192): the same kind of lines (other words, other styles, single
  words to 320 columns' worth), squeezed into 192 columns where wider, exactly half of them
  turned 180 degrees; label 1 = turned (the model's class "180"), scored against the label.
* det (PP-OCRv4, 1x3x640x640): whole pages (``render_page``) of text blocks, 12-44 px, in
  their own fonts and inks, some on coloured panels, between picture-like rectangles, fed
  as rapidocr feeds det (``det_input``: BGR, (x / 255 - 0.5) / 0.5, CHW); each line's ink
  box is kept, so ``box_coverage`` can check that a probability map finds the lines, and
  its line box (the ink's left and right, the font's ascender line to its descender line),
  the ground truth of the box-level score: ``DetSet`` makes rapidocr's text boxes from the
  map (det_boxes.py) and scores them as a text detector is scored, precision, recall and
  hmean at IoU >= 0.5, against the line boxes (accuracy) and against FP32's boxes
  (agreement). rapidocr itself would resize such a page to 736x736 (its det
  ``limit_side_len``, type min); the bench keeps 640x640, its latency shape.

Pillow and matplotlib (for its fonts) are imported only to render; CTC decoding and the
scores need numpy alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

HEIGHT = 48
REC_WIDTH = 320
CLS_WIDTH = 192
REC_OUTPUT = "softmax_11.tmp_0"
CLS_OUTPUT = "save_infer_model/scale_0.tmp_1"
DET_OUTPUT = "sigmoid_0.tmp_0"
#: Lines per labelled eval set (rec and cls alike).
EVAL_LINES = 128
#: Batch of the accuracy pass: the shape each model's eval feeds already have.
REC_BATCH = 1
CLS_BATCH = 8
EVAL_FILES = ("lee.cor", "para2para_text1.txt", "para2para_text2.txt")
CALIBRATION_FILES = ("lee_background.cor",)
FONTS = ("DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf",
         "DejaVuSans-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
         "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf", "DejaVuSansMono.ttf",
         "DejaVuSansMono-Bold.ttf")
BLANK = "<blank>"


def font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def rec_charset(model_path: Path | str) -> tuple[str, ...]:
    """PP-OCR rec's CTC classes: blank, the model's ``character`` metadata (one character
    a line), then a space (PaddleOCR's use_space_char)."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    found = [p.value for p in model.metadata_props if p.key == "character"]
    if not found:
        raise ValueError(f"{model_path}: no 'character' metadata")
    return (BLANK, *found[0].split("\n"), " ")


def ctc_decode(probs: np.ndarray, charset: Sequence[str]) -> list[str]:
    """Greedy CTC: argmax per time step, repeats merged, blanks (class 0) dropped.
    ``probs``: (batch, time, classes)."""
    if probs.shape[-1] != len(charset):
        raise ValueError(f"{probs.shape[-1]} classes, {len(charset)} characters")
    out = []
    for best in probs.argmax(-1):
        keep = np.ones(len(best), dtype=bool)
        keep[1:] = best[1:] != best[:-1]
        out.append("".join(charset[i] for i in best[keep] if i != 0))
    return out


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def rec_scores(truth: Sequence[str], got: Sequence[str],
               fp32: Sequence[str]) -> dict[str, Any]:
    """accuracy = character accuracy, 1 - (sum of edit distances) / (sum of lengths);
    line_accuracy = exact lines; agreement = lines decoded exactly as FP32 decodes them.
    Spaces at either end of a decoded line are dropped first (the crop's margins and its
    zero padding often read as a space); spaces inside it count."""
    got = [g.strip(" ") for g in got]
    fp32 = [f.strip(" ") for f in fp32]
    chars = sum(len(t) for t in truth)
    errors = sum(edit_distance(t, g) for t, g in zip(truth, got, strict=True))
    char_accuracy = 1.0 - errors / chars
    return {"accuracy": char_accuracy, "char_accuracy": char_accuracy,
            "line_accuracy": float(np.mean([t == g for t, g in zip(truth, got, strict=True)])),
            "agreement": float(np.mean([f == g for f, g in zip(fp32, got, strict=True)])),
            "lines": len(truth), "chars": chars, "char_errors": errors}


def cls_scores(labels: np.ndarray, got: np.ndarray, fp32: np.ndarray) -> dict[str, Any]:
    """accuracy = orientation against the label; agreement = same class as FP32."""
    return {"accuracy": float(np.mean(got == labels)), "agreement": float(np.mean(got == fp32)),
            "lines": len(labels), "turned": int(np.sum(labels))}


def read_documents(names: Sequence[str]) -> list[str]:
    from bench.weights.llm_eval import read_documents as read

    return read(names)


def _rng(key: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(key.encode()))


@dataclass(frozen=True)
class _Style:
    font: str
    size: int
    ink: tuple[int, int, int]
    paper: tuple[int, int, int]
    shade: float  # left-to-right paper brightness change, as a fraction
    margin_x: int
    margin_top: int
    margin_bottom: int
    blur: float
    noise: float


def _style(rng: np.random.Generator) -> _Style:
    paper = np.clip(rng.uniform(175, 250) + rng.normal(0, 8, 3), 0, 255)
    ink = np.clip(rng.uniform(0, 80) + rng.normal(0, 15, 3), 0, 255)
    size = int(rng.integers(24, 45))
    return _Style(str(rng.choice(FONTS)), size, tuple(int(v) for v in ink),
                  tuple(int(v) for v in paper), float(rng.uniform(-0.12, 0.12)),
                  int(rng.integers(2, 3 + size // 3)), int(rng.integers(1, 2 + size // 6)),
                  int(rng.integers(1, 2 + size // 6)), float(rng.uniform(0.0, 0.8)),
                  float(rng.uniform(0.0, 6.0)))


@functools.cache
def _font(name: str, size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.truetype(str(font_dir() / name), size)


def _extent(text: str, style: _Style) -> tuple[int, int]:
    """Rendered (width, height) of ``text`` in ``style``: the font's full line height
    (ascent + descent), as a detector's box around the line would have it, plus margins."""
    font = _font(style.font, style.size)
    ascent, descent = font.getmetrics()
    width = math.ceil(font.getlength(text)) + 2 * style.margin_x
    return width, ascent + descent + style.margin_top + style.margin_bottom


def _scaled_width(text: str, style: _Style) -> int:
    width, height = _extent(text, style)
    return math.ceil(HEIGHT * width / height)


def render(text: str, style: _Style, rng: np.random.Generator) -> np.ndarray:
    """The line as an HxWx3 uint8 image at its font size."""
    from PIL import Image, ImageDraw, ImageFilter

    width, height = _extent(text, style)
    image = Image.new("RGB", (width, height), style.paper)
    ImageDraw.Draw(image).text((style.margin_x, style.margin_top), text,
                               font=_font(style.font, style.size), fill=style.ink)
    if style.blur > 0.05:
        image = image.filter(ImageFilter.GaussianBlur(style.blur))
    pixels = np.asarray(image, dtype=np.float32)
    pixels = pixels * (1.0 + style.shade * np.linspace(-0.5, 0.5, width))[None, :, None]
    pixels += rng.normal(0.0, style.noise, pixels.shape)
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8)


def ppocr_input(image: np.ndarray, width: int) -> np.ndarray:
    """PaddleOCR's rec/cls preprocessing: resize to height 48 keeping the aspect ratio
    (width at most ``width``), (x / 255 - 0.5) / 0.5, zero padding on the right; 3xHxW."""
    from PIL import Image

    h, w = image.shape[:2]
    resized_w = min(width, math.ceil(HEIGHT * w / h))
    resized = Image.fromarray(image).resize((resized_w, HEIGHT), Image.Resampling.BILINEAR)
    out = np.zeros((3, HEIGHT, width), dtype=np.float32)
    out[:, :, :resized_w] = (np.asarray(resized, dtype=np.float32) / 255.0 - 0.5).transpose(
        2, 0, 1) / 0.5
    return out


def text_lines(split: str, count: int, width: int, key: str,
               fill: tuple[float, float] = (0.7, 1.0)) -> list[tuple[str, _Style]]:
    """``count`` lines of whole words, each with its style: taken in turn from the split's
    documents (eval: EVAL_FILES, else CALIBRATION_FILES), a few words skipped between two
    lines of one document; each as many words as fit a seeded share (``fill``) of
    ``width`` at height 48 (at least one word)."""
    docs = [doc.split() for doc in read_documents(EVAL_FILES if split == "eval"
                                                  else CALIBRATION_FILES)]
    rng = _rng(f"{key}/{split}/text")
    cursor = [int(rng.integers(0, 8)) for _ in docs]
    lines: list[tuple[str, _Style]] = []
    turn = 0
    while len(lines) < count:
        d = turn % len(docs)
        turn += 1
        words = docs[d]
        if cursor[d] >= len(words):
            if turn > 64 * count:
                raise ValueError(f"not enough text for {count} lines")
            continue
        style = _style(rng)
        budget = width * rng.uniform(*fill)
        end = cursor[d] + 1
        while end < len(words) and _scaled_width(" ".join(words[cursor[d]:end + 1]),
                                                 style) <= budget:
            end += 1
        lines.append((" ".join(words[cursor[d]:end]), style))
        cursor[d] = end + int(rng.integers(1, 6))
    return lines


@dataclass(frozen=True)
class LabelledSet:
    """Rendered lines with their ground truth; ``predict`` runs a model on them (in batches
    of ``batch``), ``score`` compares its predictions with the truth and with FP32's."""

    kind: str  # "rec" | "cls"
    images: np.ndarray  # N x 3 x 48 x W, float32 in [-1, 1]
    texts: tuple[str, ...]
    labels: np.ndarray  # cls: 1 = turned 180 degrees; rec: unused (all 0)
    batch: int
    output: str
    charset: tuple[str, ...] = ()

    def predict(self, sess: Any) -> list[Any]:
        """rec: the decoded strings; cls: the argmax classes (0 upright, 1 turned)."""
        found: list[Any] = []
        for start in range(0, len(self.images), self.batch):
            probs = sess.run([self.output], {"x": self.images[start:start + self.batch]})[0]
            found += (ctc_decode(probs, self.charset) if self.kind == "rec"
                      else [int(c) for c in probs.argmax(-1)])
        return found

    def score(self, got: Sequence[Any], fp32: Sequence[Any]) -> dict[str, Any]:
        if self.kind == "rec":
            return rec_scores(self.texts, got, fp32)
        return cls_scores(self.labels, np.asarray(got), np.asarray(fp32))


@functools.cache
def rec_set(split: str, count: int = EVAL_LINES) -> LabelledSet:
    """``count`` rendered lines at 1x3x48x320 each, their text the ground truth (no charset:
    ``labelled_rec`` adds the model's, to decode)."""
    rng = _rng(f"rec/{split}/pixels")
    lines = text_lines(split, count, REC_WIDTH, "rec")
    images = np.stack([ppocr_input(render(text, style, rng), REC_WIDTH) for text, style in lines])
    return LabelledSet("rec", images, tuple(t for t, _ in lines), np.zeros(count, np.int64),
                       REC_BATCH, REC_OUTPUT)


@functools.cache
def labelled_rec(model_path: Path | str) -> LabelledSet:
    """The eval split's rec lines with the model's charset, ready to predict and score."""
    return dataclasses.replace(rec_set("eval"), charset=rec_charset(model_path))


@functools.cache
def cls_set(split: str, count: int = EVAL_LINES) -> LabelledSet:
    """``count`` rendered lines at 3x48x192, exactly half of them (seeded) turned 180
    degrees before resizing; label 1 = turned. The lines fill 30-100% of rec's 320 columns at
    height 48 (single words to long lines), the wider ones squeezed into 192 columns, as
    PaddleOCR squeezes a long detected line for its classifier."""
    rng = _rng(f"cls/{split}/pixels")
    lines = text_lines(split, count, REC_WIDTH, "cls", fill=(0.3, 1.0))
    turned = rng.permutation(count) < count // 2
    images = []
    for (text, style), turn in zip(lines, turned, strict=True):
        image = render(text, style, rng)
        images.append(ppocr_input(image[::-1, ::-1] if turn else image, CLS_WIDTH))
    return LabelledSet("cls", np.stack(images), tuple(t for t, _ in lines),
                       turned.astype(np.int64), CLS_BATCH, CLS_OUTPUT)


# --- PP-OCR det: pages of rendered text ------------------------------------------------

#: Side of a det page (the bench's 1x3x640x640 det input).
PAGE = 640
#: Pages of det's labelled eval set (batch 1 each; the latency feed is the first one).
DET_EVAL_PAGES = 8


@dataclass(frozen=True)
class DetPages:
    """Rendered pages as rapidocr feeds them to det, with each text line's ink box."""

    images: np.ndarray  # N x 3 x PAGE x PAGE, float32 in [-1, 1], BGR channel order
    boxes: tuple[tuple[tuple[int, int, int, int], ...], ...]  # per page: ink (x0, y0, x1, y1)
    texts: tuple[tuple[str, ...], ...]  # per page: the text of each line, in box order
    # per page: each line's box as a labeller draws it around a whole line, whichever letters
    # it has: the ink's left and right, the font's ascender line to its descender line
    lines: tuple[tuple[tuple[int, int, int, int], ...], ...] = ()


def det_input(image: np.ndarray) -> np.ndarray:
    """rapidocr's det preprocessing of an HxWx3 RGB uint8 page at its final size: BGR (its
    LoadImage turns RGB into BGR), (x / 255 - 0.5) / 0.5, HWC -> CHW; float32 3xHxW."""
    bgr = np.asarray(image, dtype=np.float32)[:, :, ::-1]
    return np.ascontiguousarray(((bgr / 255.0 - 0.5) / 0.5).transpose(2, 0, 1))


def _words(split: str, rng: np.random.Generator) -> Iterator[str]:
    """The split's words (eval: EVAL_FILES, else CALIBRATION_FILES), document after
    document from a seeded one on, round and round."""
    docs = read_documents(EVAL_FILES if split == "eval" else CALIBRATION_FILES)
    d = int(rng.integers(len(docs)))
    while True:
        yield from docs[d].split()
        d = (d + 1) % len(docs)


def _colour(rng: np.random.Generator, low: float, high: float, tint: float) -> np.ndarray:
    return np.clip(rng.uniform(low, high) + rng.normal(0.0, tint, 3), 0, 255)


def _shading(rng: np.random.Generator, size: int) -> np.ndarray:
    """A smooth brightness field around 1 (uneven light on a photographed page)."""
    cells = 3
    coarse = rng.uniform(-1.0, 1.0, (cells + 1, cells + 1))
    axis = np.linspace(0, cells, size)
    i0 = np.minimum(axis.astype(int), cells - 1)
    f = axis - i0
    rows = coarse[i0] * (1 - f)[:, None] + coarse[i0 + 1] * f[:, None]
    field = rows[:, i0] * (1 - f)[None, :] + rows[:, i0 + 1] * f[None, :]
    return 1.0 + rng.uniform(0.0, 0.12) * field


def render_page(words: Iterator[str], rng: np.random.Generator,
                size: int = PAGE) -> tuple[np.ndarray, list[tuple[int, int, int, int]],
                                           list[str], list[tuple[int, int, int, int]]]:
    """One page: blocks of text lines one under the other (each block its own font, size
    12-44 px, ink, left margin and width, 1-6 lines of whole words from ``words``), some
    blocks a flat panel of another colour with contrasting text, and now and then a
    picture-like rectangle without text; paper tint, uneven light, blur and noise.
    Returns the HxWx3 RGB uint8 page, each line's ink box (x0, y0, x1, y1), its text and
    its line box (the ink's x0 and x1; y0 the font's ascender line, where the line is drawn,
    y1 = y0 + ascent + descent, the descender line)."""
    from PIL import Image, ImageDraw, ImageFilter

    paper = _colour(rng, 170, 250, 10)
    image = Image.new("RGB", (size, size), tuple(int(v) for v in paper))
    draw = ImageDraw.Draw(image)
    boxes: list[tuple[int, int, int, int]] = []
    line_boxes: list[tuple[int, int, int, int]] = []
    texts: list[str] = []
    y = int(rng.integers(4, 40))
    while y < size - 16:
        if rng.random() < 0.15:  # a picture: smooth colours, no text
            h = int(rng.integers(40, 160))
            x0 = int(rng.integers(0, size // 3))
            x1 = int(rng.integers(x0 + size // 4, size + 1))
            top, bottom = _colour(rng, 20, 235, 40), _colour(rng, 20, 235, 40)
            for row in range(h):
                shade = top + (bottom - top) * row / max(h - 1, 1)
                draw.line([(x0, y + row), (x1, y + row)], fill=tuple(int(v) for v in shade))
            y += h + int(rng.integers(8, 30))
            continue
        font_size = int(np.clip(rng.lognormal(np.log(20), 0.35), 12, 44))
        font = _font(str(rng.choice(FONTS)), font_size)
        spacing = int(font_size * rng.uniform(1.2, 1.7))
        lines = int(rng.integers(1, 7))
        x0 = int(rng.integers(4, size // 4))
        right = int(rng.integers(max(x0 + size // 3, size * 3 // 4), size - 2))
        panel = rng.random() < 0.2
        if panel:  # a flat panel (a banner, a sign): text in a contrasting colour on it
            back = _colour(rng, 0, 255, 60)
            light = float(back.mean()) < 128
            ink = _colour(rng, 200, 255, 15) if light else _colour(rng, 0, 60, 15)
            height = min(lines * spacing + font_size // 2, size - y)
            draw.rectangle([x0 - 4, y - 2, right + 2, y + height],
                           fill=tuple(int(v) for v in back))
        else:
            ink = _colour(rng, 0, 90, 20)
        for _ in range(lines):
            if y + font_size + 4 > size:
                break
            width = (right - x0) * rng.uniform(0.35, 1.0)
            line = next(words)
            while True:
                word = next(words)
                if font.getlength(f"{line} {word}") > width:
                    break
                line = f"{line} {word}"
            if font.getlength(line) > size - x0 - 2:
                continue  # a single word too long for the page
            draw.text((x0, y), line, font=font, fill=tuple(int(v) for v in ink))
            x_a, y_a, x_b, y_b = draw.textbbox((x0, y), line, font=font)
            boxes.append((x_a, y_a, min(x_b, size), min(y_b, size)))
            line_boxes.append((x_a, y, min(x_b, size), min(y + sum(font.getmetrics()), size)))
            texts.append(line)
            y += spacing
        y += int(rng.integers(4, 3 * font_size))
    blur = float(rng.uniform(0.0, 0.9))
    if blur > 0.05:
        image = image.filter(ImageFilter.GaussianBlur(blur))
    pixels = np.asarray(image, dtype=np.float32) * _shading(rng, size)[:, :, None]
    pixels += rng.normal(0.0, rng.uniform(0.0, 6.0), pixels.shape)
    return np.clip(np.rint(pixels), 0, 255).astype(np.uint8), boxes, texts, line_boxes


@functools.cache
def det_pages(split: str, count: int) -> DetPages:
    """``count`` rendered pages of the split's text (``render_page``) at PAGE x PAGE, fed as
    rapidocr feeds det (``det_input``); seeded, the first pages the same for any count."""
    rng = _rng(f"det/{split}/pages")
    words = _words(split, rng)
    images, boxes, texts, lines = [], [], [], []
    for _ in range(count):
        page, page_boxes, page_texts, page_lines = render_page(words, rng)
        images.append(det_input(page))
        boxes.append(tuple(page_boxes))
        texts.append(tuple(page_texts))
        lines.append(tuple(page_lines))
    return DetPages(np.stack(images), tuple(boxes), tuple(texts), tuple(lines))


def box_coverage(prob: np.ndarray, boxes: Sequence[tuple[int, int, int, int]],
                 threshold: float = 0.3) -> dict[str, float]:
    """How a det probability map (HxW) covers the ink boxes of the rendered lines:
    ``coverage`` = share of the box pixels above ``threshold``; ``core`` = the same over
    each box's middle third of rows (DB learns a map shrunk towards a line's centre line);
    ``lines_found`` = share of lines whose core is at least half covered; ``precision`` =
    share of the map's positive pixels inside a box grown by a third of its height."""
    hit = prob > threshold
    inside = np.zeros_like(hit)
    covered = total = core_covered = core_total = found = 0
    for x0, y0, x1, y1 in boxes:
        covered += int(hit[y0:y1, x0:x1].sum())
        total += (y1 - y0) * (x1 - x0)
        third = (y1 - y0) // 3
        core = hit[y0 + third:y1 - third, x0:x1]
        core_covered += int(core.sum())
        core_total += core.size
        found += core.size > 0 and core.mean() >= 0.5
        grow = max(1, (y1 - y0) // 3)
        inside[max(0, y0 - grow):y1 + grow, max(0, x0 - grow):x1 + grow] = True
    positives = int(hit.sum())
    return {"coverage": covered / max(total, 1), "core": core_covered / max(core_total, 1),
            "lines_found": found / max(len(boxes), 1),
            "precision": int((hit & inside).sum()) / positives if positives else 1.0}


@dataclass(frozen=True)
class DetSet:
    """det's labelled eval pages, with ``LabelledSet``'s interface: ``predict`` runs det on
    each page (batch 1) and makes rapidocr's text boxes from its map (det_boxes.py);
    ``score`` scores them as a text detector is scored, box precision, recall and hmean at
    IoU >= 0.5, against the rendered lines' boxes and against FP32's boxes."""

    pages: DetPages
    output: str = DET_OUTPUT
    kind: str = "det"

    def predict(self, sess: Any) -> list[dict[str, Any]]:
        """Per page: ``boxes``, rapidocr's text boxes (x0, y0, x1, y1); ``positive``, the
        map's pixels above rapidocr's threshold (for the pixel F1)."""
        from bench.harness import det_boxes
        found = []
        for image in self.pages.images:
            prob = sess.run([self.output], {"x": image[None]})[0][0, 0]
            found.append({"boxes": det_boxes.text_boxes(prob),
                          "positive": prob > det_boxes.THRESH})
        return found

    def score(self, got: Sequence[dict[str, Any]],
              fp32: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """accuracy = box hmean against the line boxes (precision, recall beside it);
        agreement = box hmean against FP32's boxes; pixel_f1 = F1 of the thresholded map's
        pixels against FP32's, all pages together."""
        from bench.harness import det_boxes
        truth = det_boxes.hmean([g["boxes"] for g in got], self.pages.lines)
        same = det_boxes.hmean([g["boxes"] for g in got], [f["boxes"] for f in fp32])
        both = sum(int(np.sum(g["positive"] & f["positive"])) for g, f in zip(got, fp32,
                                                                                strict=True))
        total = sum(int(g["positive"].sum() + f["positive"].sum()) for g, f in zip(got, fp32,
                                                                                   strict=True))
        return {"accuracy": truth["hmean"], "precision": truth["precision"],
                "recall": truth["recall"], "agreement": same["hmean"],
                "agreement_precision": same["precision"], "agreement_recall": same["recall"],
                "pixel_f1": 1.0 if total == 0 else 2.0 * both / total,
                "pages": len(got), "lines": truth["truth"], "boxes": truth["found"]}


@functools.cache
def det_set(split: str = "eval", count: int = DET_EVAL_PAGES) -> DetSet:
    """``count`` det pages of the split (``det_pages``) with their line boxes, to predict
    and score."""
    return DetSet(det_pages(split, count))
