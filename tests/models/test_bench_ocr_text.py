"""The bench's labelled PP-OCR lines (bench/ocr_text.py): CTC decoding and the scores, the
rec model's character table, and FP32 reading the rendered lines.

Rendering needs Pillow, matplotlib's DejaVu fonts and the bench's text corpus (the bench's
own environment, ``.venv-bench``, and ``bench/fetch.py``); that test is skipped, saying
so, where any of them is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

# Appended, not prepended: bench/ holds modules (common, models, metrics) that must not
# shadow anything the other tests import.
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))

import ocr_text

REC = "models/rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx"
CLS = "models/rapidocr-onnxruntime__ch_ppocr_mobile_v2.0_cls_infer.onnx"


def _one_hot(indices: list[int], classes: int) -> np.ndarray:
    probs = np.zeros((1, len(indices), classes), dtype=np.float32)
    probs[0, np.arange(len(indices)), indices] = 1.0
    return probs


def test_ctc_decode_merges_repeats_and_drops_blanks() -> None:
    charset = (ocr_text.BLANK, "a", "b", " ")
    # a a _ a b b ' ' _ : "aa" needs the blank between them to stay two letters
    assert ocr_text.ctc_decode(_one_hot([1, 1, 0, 1, 2, 2, 3, 0], 4), charset) == ["aab "]
    assert ocr_text.ctc_decode(_one_hot([0, 0, 0], 4), charset) == [""]
    with pytest.raises(ValueError, match="classes"):
        ocr_text.ctc_decode(_one_hot([0], 5), charset)


def test_scores() -> None:
    assert ocr_text.edit_distance("kitten", "sitting") == 3
    assert ocr_text.edit_distance("", "abc") == 3
    truth = ["New York", "the state"]
    # spaces at either end of a decoded line do not count, spaces inside do
    found = ocr_text.rec_scores(truth, [" New York ", "thestate"], ["New York", "the state"])
    assert found["char_errors"] == 1 and found["chars"] == 17
    assert found["accuracy"] == pytest.approx(1 - 1 / 17)
    assert found["line_accuracy"] == 0.5 and found["agreement"] == 0.5
    cls = ocr_text.cls_scores(
        np.array([0, 1, 1, 0]), np.array([0, 1, 0, 0]), np.array([0, 0, 0, 0])
    )
    assert cls["accuracy"] == 0.75 and cls["agreement"] == 0.75 and cls["turned"] == 2


@pytest.mark.slow
def test_rec_charset_matches_the_output(corpus_dir: Path) -> None:
    import onnxruntime as ort

    charset = ocr_text.rec_charset(corpus_dir / REC)
    # blank, the 6623 dictionary characters, a space
    assert len(charset) == 6625 and charset[0] == ocr_text.BLANK and charset[-1] == " "
    sess = ort.InferenceSession(str(corpus_dir / REC), providers=["CPUExecutionProvider"])
    probs = sess.run(None, {"x": np.zeros((1, 3, 48, 320), np.float32)})[0]
    assert probs.shape[-1] == len(charset)


@pytest.mark.slow
def test_fp32_reads_the_rendered_lines(corpus_dir: Path) -> None:
    pytest.importorskip("PIL")
    pytest.importorskip("matplotlib")
    from common import text_dir

    missing = [n for n in ocr_text.EVAL_FILES if not (text_dir() / n).is_file()]
    if missing:
        pytest.skip(f"bench text corpus missing ({', '.join(missing)}): run bench/fetch.py")
    import onnxruntime as ort

    rec = ocr_text.rec_set("eval", 16)
    assert rec.images.shape == (16, 3, 48, 320)
    assert rec.images.min() >= -1.0 and rec.images.max() <= 1.0
    labelled = ocr_text.LabelledSet(
        rec.kind,
        rec.images,
        rec.texts,
        rec.labels,
        rec.batch,
        rec.output,
        ocr_text.rec_charset(corpus_dir / REC),
    )
    got = labelled.predict(
        ort.InferenceSession(str(corpus_dir / REC), providers=["CPUExecutionProvider"])
    )
    assert labelled.score(got, got)["accuracy"] > 0.95, list(zip(rec.texts, got, strict=True))

    cls = ocr_text.cls_set("eval", 32)
    assert int(cls.labels.sum()) == 16
    got = cls.predict(
        ort.InferenceSession(str(corpus_dir / CLS), providers=["CPUExecutionProvider"])
    )
    assert cls.score(got, got)["accuracy"] >= 0.9
