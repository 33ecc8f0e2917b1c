"""The bench's labelled PP-OCR lines (bench/harness/ocr_text.py): CTC decoding and the scores, the
rec model's character table, FP32 reading the rendered lines, det's page normalisation and FP32
det finding the lines rendered on its pages (its map and rapidocr's boxes from it).

Rendering needs Pillow, matplotlib's DejaVu fonts and the bench's text corpus (the bench's
own environment, ``.venv-bench``, and ``bench/harness/fetch.py``); those tests are skipped, saying
so, where any of them is missing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.harness import ocr_text

REC = "models/rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx"
CLS = "models/rapidocr-onnxruntime__ch_ppocr_mobile_v2.0_cls_infer.onnx"
DET = "models/rapidocr-onnxruntime__ch_PP-OCRv4_det_infer.onnx"


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


def _needs_rendering() -> None:
    """Skips a test without what rendering text needs: Pillow, matplotlib's fonts and
    the bench's text corpus."""
    pytest.importorskip("PIL")
    pytest.importorskip("matplotlib")
    from bench.harness.common import text_dir

    missing = [n for n in ocr_text.EVAL_FILES if not (text_dir() / n).is_file()]
    if missing:
        pytest.skip(f"bench text corpus missing ({', '.join(missing)}): run bench/harness/fetch.py")


@pytest.mark.slow
def test_fp32_reads_the_rendered_lines(corpus_dir: Path) -> None:
    _needs_rendering()
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


def test_det_input_is_rapidocrs_normalisation() -> None:
    # rapidocr's det: BGR (LoadImage turns RGB into BGR), (x / 255 - 0.5) / 0.5, CHW
    image = np.array([[[0, 51, 255], [255, 255, 255]]], dtype=np.uint8)  # 1x2 RGB
    got = ocr_text.det_input(image)
    assert got.shape == (3, 1, 2) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0, 0], [1.0, 51 / 127.5 - 1.0, -1.0], atol=1e-6)
    np.testing.assert_allclose(got[:, 0, 1], [1.0, 1.0, 1.0])


def test_box_coverage() -> None:
    prob = np.zeros((30, 40), np.float32)
    prob[13:17, 0:20] = 0.9  # the middle rows of the first box
    found = ocr_text.box_coverage(prob, [(0, 10, 20, 20), (20, 10, 40, 20)])
    assert found["coverage"] == pytest.approx(80 / 400)
    assert found["core"] == pytest.approx(80 / 160)  # rows 13-16 of 13-16 and of the 2nd
    assert found["lines_found"] == 0.5 and found["precision"] == 1.0
    prob[0:2, 30:40] = 0.9  # 20 positives far from both boxes
    assert ocr_text.box_coverage(prob, [(0, 10, 20, 20)])["precision"] == pytest.approx(0.8)


@pytest.mark.slow
def test_fp32_det_finds_the_rendered_lines(corpus_dir: Path) -> None:
    _needs_rendering()
    import onnxruntime as ort

    pages = ocr_text.det_pages("eval", 2)
    assert pages.images.shape == (2, 3, 640, 640)
    assert pages.images.min() >= -1.0 and pages.images.max() <= 1.0
    sess = ort.InferenceSession(str(corpus_dir / DET), providers=["CPUExecutionProvider"])
    for image, boxes in zip(pages.images, pages.boxes, strict=True):
        assert len(boxes) >= 5
        prob = sess.run(None, {"x": image[None]})[0][0, 0]
        found = ocr_text.box_coverage(prob, boxes)
        # DB's map is a band shrunk towards each line's centre: the middle rows are covered
        assert found["lines_found"] >= 0.95 and found["core"] >= 0.8, found
        assert found["precision"] >= 0.95, found
    # rapidocr's boxes from FP32's maps find the lines' boxes (bench/harness/det_boxes.py)
    got = ocr_text.DetSet(pages).predict(sess)
    scores = ocr_text.DetSet(pages).score(got, got)
    assert scores["accuracy"] >= 0.95 and scores["lines"] == sum(map(len, pages.lines)), scores
