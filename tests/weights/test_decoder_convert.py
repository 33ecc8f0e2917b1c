"""A decoder LLM with a KV cache through ``mixprec convert`` (fp16, bf16): the tiny
Llama-like decoder of ``tests/llm_models.py`` against its own FP32 run in ONNX Runtime,
with a non-empty past, left padding, and an empty past (past dim 0), from inputs mixprec
generates itself and from ``.npz`` calibration files holding a zero-length past."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from helpers import assert_close, run_ort
from llm_models import DecoderConfig, decoder_feeds, greedy_decode, tiny_decoder
from mixprec.cli.main import main
from mixprec.inputs.feeds import make_inputs, resolve_input_shapes
from mixprec.passes.emulate import emulate_low_precision

CFG = DecoderConfig()
#: (batch, sequence, past, left padding of the last row): a decoding step with a cache,
#: a padded batch, and a first step with an empty cache
CASES = [(2, 3, 5, 2), (1, 1, 9, 0), (2, 4, 0, 1)]


def _save(tmp_path: Path, model: onnx.ModelProto, name: str = "decoder.onnx") -> Path:
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _runnable(path: Path, dtype: str) -> onnx.ModelProto:
    """The converted model as ONNX Runtime runs it: bf16 through mixprec's FP32 emulation
    (every bf16 tensor rounded through bf16), as the other bf16 tests do."""
    model = onnx.load(str(path))
    return emulate_low_precision(model) if dtype == "bf16" else model


def _assert_matches_fp32(source: Path, converted: Path, dtype: str) -> None:
    runnable = _runnable(converted, dtype)
    for batch, sequence, past, padding in CASES:
        feeds = decoder_feeds(CFG, batch=batch, sequence=sequence, past=past, padding=padding)
        ref = run_ort(source, feeds)
        got = run_ort(runnable, feeds)
        assert set(got) == set(ref)
        for name, value in ref.items():
            assert_close(value, got[name], dtype, name=f"{name} (past {past}, pad {padding})")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_decoder_converts_from_generated_inputs(tmp_path: Path, dtype: str) -> None:
    """No inputs given: mixprec generates an empty cache, ids and a mask of one length;
    the converted decoder matches FP32 within the dtype's tolerance on every output, with
    a cache of 0, 5 and 9 positions and a left-padded row."""
    source = _save(tmp_path, tiny_decoder(CFG))
    out = tmp_path / f"decoder.{dtype}.onnx"
    assert main(["convert", str(source), "-o", str(out), "--dtype", dtype, "-q"]) == 0
    _assert_matches_fp32(source, out, dtype)


def test_tied_decoder_converts_and_decodes_the_same_tokens(tmp_path: Path) -> None:
    """lm_head = MatMul(h, Transpose(embedding)) on the one table: fp16 matches FP32, and
    greedy decoding with the cache gives FP32's tokens."""
    cfg = DecoderConfig(tied=True)
    source = _save(tmp_path, tiny_decoder(cfg, seed=3))
    out = tmp_path / "tied.fp16.onnx"
    assert main(["convert", str(source), "-o", str(out), "--dtype", "fp16", "-q"]) == 0
    feeds = decoder_feeds(cfg, batch=2, sequence=3, past=4, padding=1)
    ref, got = run_ort(source, feeds), run_ort(out, feeds)
    for name, value in ref.items():
        assert_close(value, got[name], "fp16", name=name)
    prompt = np.array([5, 17, 42, 7], np.int64)
    want = greedy_decode(lambda f: run_ort(source, f), cfg, prompt, 8)
    assert greedy_decode(lambda f: run_ort(out, f), cfg, prompt, 8) == want


def test_decoder_calibrates_on_npz_files_with_an_empty_past(tmp_path: Path) -> None:
    """--calibration-data DIR of .npz samples holding input_ids, attention_mask and
    zero-length past tensors (the first decoding step) is accepted and used."""
    source = _save(tmp_path, tiny_decoder(CFG))
    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(3):
        feeds = decoder_feeds(CFG, batch=1, sequence=6 + i, past=0, seed=10 + i)
        assert feeds["past_key_values.0.key"].shape == (1, CFG.kv_heads, 0, CFG.head_dim)
        np.savez(folder / f"sample_{i}.npz", **feeds)
    out = tmp_path / "decoder.fp16.onnx"
    argv = ["convert", str(source), "-o", str(out), "--dtype", "fp16", "-q"]
    assert main([*argv, "--calibration-data", str(folder)]) == 0
    _assert_matches_fp32(source, out, "fp16")


def test_generated_decoder_inputs_are_an_empty_cache() -> None:
    """The one rule for symbolic dims gives a KV-cache input length 0 and the mask the
    ids' length, and the generated sample runs in ONNX Runtime."""
    model = tiny_decoder(CFG)
    shapes, notes = resolve_input_shapes(model)
    assert shapes["input_ids"][1] == shapes["attention_mask"][1] > 0
    for name in CFG.past_names():
        assert shapes[name] == [1, CFG.kv_heads, 0, CFG.head_dim]
    assert any("KV-cache" in n and "past_key_values.0.key" in n for n in notes)
    feeds, _ = make_inputs(model)
    out = run_ort(model, feeds)
    assert out["logits"].shape == (1, shapes["input_ids"][1], CFG.vocab)
    assert out["present.1.value"].shape[2] == shapes["input_ids"][1]
