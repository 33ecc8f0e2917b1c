"""Peak memory of ``mixprec quantize --weights int4`` on a language model with text data
(issue 37's cap: peak RSS at most 2x the FP32 data file plus 1 GiB), measured as the VmHWM
of a child process that runs the CLI. The models are the KV-cache decoder of
``tests/llm_models.py`` with their weights in an external data file written a weight at a
time through ``np.memmap`` (this process never holds the model):

* under 2 GB (dense, 277 MB): the in-memory path, which held several copies of the model
  (a protobuf copy, its serialized bytes, sessions parsed from them: 5.3 GB for
  SmolLM2-135M's 622 MB) and now keeps the weights mapped;
* over 2 GiB (sparse: each weight real in its first rows, the rest a hole in the file):
  the streamed path, with the language-model guard on text windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from llm_models import DataFile, DecoderConfig, tiny_decoder

tokenizers = pytest.importorskip("tokenizers", reason="the [llm] extra (tokenizers) is missing")

#: Child: quantize with the CLI, then write its own VmHWM (peak resident set, the
#: memory-mapped data file's resident pages included) to argv[1].
_CHILD = """
import sys
from mixprec.cli.main import main
try:
    code = main(sys.argv[2:])
finally:
    status = open("/proc/self/status").read()
    peak = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")]
    open(sys.argv[1], "w").write(peak[0])
sys.exit(code)
"""

#: SmolLM2-135M's size (626 MB of float32), cheap to run: most of it in the embedding and
#: the lm_head (vocabulary 65536, hidden 1024), 2 layers with an MLP of 2816.
MAPPED = DecoderConfig(vocab=65536, hidden=1024, layers=2, heads=16, kv_heads=4, intermediate=2816)
#: 9 layers of hidden 2048, MLP 8192, vocabulary 8192: 2.33 GB of float32.
STREAMED = DecoderConfig(vocab=8192, hidden=2048, layers=9, heads=16, kv_heads=4, intermediate=8192)


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, its model files removed afterwards (pytest keeps recent tmp folders)."""
    yield tmp_path
    for path in tmp_path.glob("*.onnx*"):
        path.unlink()


def _language_model(folder: Path, cfg: DecoderConfig, dense_rows: int | None) -> Path:
    """``lm.onnx`` (+ ``lm.onnx.data``), a word-level ``tokenizer.json`` (word ``wK`` is
    token K + 1) and ``calib.txt`` of Zipf-like words."""
    data = DataFile(folder / "lm.onnx.data", dense_rows=dense_rows)
    onnx.save(tiny_decoder(cfg, seed=37, data=data), str(folder / "lm.onnx"))
    words = [f"w{i}" for i in range(min(cfg.vocab - 1, 500))]
    vocab = {"[UNK]": 0, **{w: k + 1 for k, w in enumerate(words)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, len(words) + 1)
    text = " ".join(rng.choice(words, 400, p=p / p.sum()))
    (folder / "calib.txt").write_text(text, encoding="utf-8")
    return folder / "lm.onnx"


def _peak_of_quantize(model: Path, *args: str) -> tuple[int, float, dict]:
    """The child's VmHWM in bytes, its wall time and its JSON report."""
    out, peak_file = model.parent / "out.onnx", model.parent / "peak"
    argv = [str(model), "-o", str(out), "--weights", "int4", "--json", *args]
    clock = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(peak_file), "quantize", *argv],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    seconds = time.perf_counter() - clock
    assert child.returncode == 0, child.stderr[-2000:]
    return int(peak_file.read_text()) * 1024, seconds, json.loads(child.stdout)


def _check_cap(model: Path, peak: int, seconds: float) -> None:
    size = model.with_name("lm.onnx.data").stat().st_size
    cap = 2 * size + (1 << 30)
    print(f"data {size / 2**30:.2f} GiB, peak RSS {peak / 2**30:.2f} GiB, cap "
          f"{cap / 2**30:.2f} GiB, {seconds:.0f} s")  # fmt: skip
    assert peak <= cap, f"peak RSS {peak / 2**30:.2f} GiB > {cap / 2**30:.2f} GiB"


@pytest.mark.slow
def test_a_language_model_under_2_gb_is_quantized_within_the_cap(folder: Path) -> None:
    """Dense 627 MB decoder, 16-token windows of text: the layer statistics, the guard's
    FP32 reference and the candidate all run from the mapped data file (no weight copied
    into protobuf, one statistics session at a time).
    Measured 2026-11-28 (2 cores shared with other jobs): peak 1.42 GiB, against
    3.31 GiB before (a protobuf copy and sessions each holding the weights); cap 2.17 GiB;
    the guard's figures and the written model's layers the same."""
    model = _language_model(folder, MAPPED, dense_rows=None)
    args = ("--calibration-data", str(folder / "calib.txt"), "--text-window", "16")
    # the random decoder's next-token agreement at int4 (about 0.57) is below int4's
    # default 0.7, and the default size budget has room for one layer: a memory test
    # wants the model written
    args += ("--max-drop", "0.5")
    peak, seconds, report = _peak_of_quantize(model, *args)
    assert not any(n.startswith("streamed:") for n in report["notes"]), report["notes"]
    assert report["guard"] is not None
    _check_cap(model, peak, seconds)


@pytest.mark.slow
def test_a_language_model_over_2_gb_is_quantized_within_the_cap(folder: Path) -> None:
    """Sparse 2.33 GB decoder (64 real rows per weight), streamed, with the guard on
    16-token text windows. The data-free search, as before the streamed path read layer
    statistics: AWQ's exact error ``tr(D^T H D)`` costs K^2 N per evaluation, minutes per
    layer at this decoder's 8192-wide MLP input on 2 cores (tests/weights/test_streamed.py
    runs AWQ streamed over 2 GB on narrow inputs)."""
    model = _language_model(folder, STREAMED, dense_rows=64)
    assert model.with_name("lm.onnx.data").stat().st_size > 2 << 30
    args = ("--calibration-data", str(folder / "calib.txt"), "--text-window", "16")
    args += ("--weight-method", "search")
    peak, seconds, report = _peak_of_quantize(model, *args)
    assert any(n.startswith("streamed:") for n in report["notes"]), report["notes"]
    _check_cap(model, peak, seconds)
