"""``mixprec quantize --weights int4 --genai``: ``genai_config.json`` and the tokenizer files
beside the output, and a real round trip through onnxruntime-genai (the ``test`` extra): the
tiny KV-cache decoder of ``tests/llm_models.py`` with a byte-level BPE ``tokenizer.json``
trained here, quantized to int4, generates in onnxruntime-genai exactly the greedy tokens a
plain ONNX Runtime loop gives on the same written model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from helpers import run_ort
from llm_models import DecoderConfig, greedy_decode, tiny_decoder
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.io.genai import GENAI_CONFIG, decoder_layout, genai_config, tokenizer_facts

tokenizers = pytest.importorskip("tokenizers", reason="the [llm] extra (tokenizers) is missing")

TEXT = (
    "the quick brown fox jumps over the lazy dog. a tiny model reads a tiny text and "
    "writes it again, token by token, with its cache of keys and values. "
)
EOS = "<|endoftext|>"


def _tokenizer(folder: Path, *, config: bool = True) -> int:
    """A byte-level BPE ``tokenizer.json`` (GPT-2 style) trained on TEXT, and its
    ``tokenizer_config.json``; the vocabulary size."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=[EOS],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT * 8], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        settings = {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": EOS,
            "eos_token": EOS,
            "model_max_length": 256,
        }
        (folder / "tokenizer_config.json").write_text(json.dumps(settings), encoding="utf-8")
    return int(tok.get_vocab_size())


def _folder(tmp_path: Path, *, config: bool = True) -> tuple[Path, DecoderConfig]:
    """``src/`` with the decoder (vocabulary = the tokenizer's), its tokenizer and text."""
    src = tmp_path / "src"
    src.mkdir()
    cfg = DecoderConfig(vocab=_tokenizer(src, config=config), layers=2)
    onnx.save(tiny_decoder(cfg, seed=3), str(src / "model.onnx"))
    (src / "calib.txt").write_text(TEXT * 6, encoding="utf-8")
    return src / "model.onnx", cfg


def test_the_layout_is_read_from_the_graph(tmp_path: Path) -> None:
    model, cfg = _folder(tmp_path)
    layout = decoder_layout(onnx.load(str(model)))
    assert (layout.layers, layout.kv_heads, layout.head_size) == (2, cfg.kv_heads, cfg.head_dim)
    assert (layout.hidden_size, layout.vocab_size) == (cfg.hidden, cfg.vocab)
    assert layout.inputs == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert layout.outputs["present_value_names"] == "present.%d.value"
    facts = tokenizer_facts(model.parent)
    assert facts.eos_token_id == facts.bos_token_id == 0  # EOS is the first special token
    assert facts.context_length == 256


def test_what_cannot_be_inferred_names_its_option(tmp_path: Path) -> None:
    model, _ = _folder(tmp_path, config=False)
    with pytest.raises(MixprecError, match="give --eos-token-id ID"):
        genai_config(model, model.parent, filename="m.onnx")
    with pytest.raises(MixprecError, match="give --context-length N"):
        genai_config(model, model.parent, filename="m.onnx", eos_token_id=0)
    config = genai_config(model, model.parent, filename="m.onnx", eos_token_id=0, context_length=64)
    assert config["model"]["context_length"] == config["search"]["max_length"] == 64
    assert config["model"]["type"] == "decoder"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--context-length", "9"], "--context-length only apply with --genai"),
        (["--genai", "--tokenizer", "nowhere.json"], "does not exist"),
    ],
)
def test_bad_genai_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    model, _ = _folder(tmp_path)
    out = tmp_path / "out.onnx"
    assert main(["quantize", str(model), "-o", str(out), "--weights", "int4", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert list(tmp_path.iterdir()) == [tmp_path / "src"]


def test_a_decoder_without_a_kv_cache_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = """<ir_version: 8, opset_import: ["" : 17]>
    g (int64[1, 4] input_ids) => (float[1, 4, 8] logits) <float[8, 8] table>
    { logits = Gather(table, input_ids) }"""
    proto = onnx.parser.parse_model(text)
    proto.graph.initializer.append(
        onnx.numpy_helper.from_array(np.eye(8, dtype=np.float32), "table")
    )
    del proto.graph.value_info[:]
    _tokenizer(tmp_path)
    onnx.save(proto, str(tmp_path / "lm.onnx"))
    out = tmp_path / "out.onnx"
    assert (
        main(
            ["quantize", str(tmp_path / "lm.onnx"), "-o", str(out), "--weights", "int4", "--genai"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a decoder with a KV cache" in err[0], err
    assert not out.exists() and not (tmp_path / GENAI_CONFIG).exists()


def _ort_greedy(model: Path, cfg: DecoderConfig, prompt: list[int], steps: int) -> list[int]:
    return greedy_decode(
        lambda feeds: run_ort(model, feeds, optimize=True), cfg, np.array(prompt), steps
    )


def test_onnxruntime_genai_generates_what_a_greedy_ort_loop_does(tmp_path: Path) -> None:
    og = pytest.importorskip(
        "onnxruntime_genai", reason="onnxruntime-genai (the test extra) is not installed"
    )
    model, cfg = _folder(tmp_path)
    out_dir = tmp_path / "genai"
    out_dir.mkdir()
    out = out_dir / "model.int4.onnx"
    argv = ["quantize", str(model), "-o", str(out), "--weights", "int4", "-q"]
    argv += ["--calibration-data", str(model.parent / "calib.txt"), "--genai"]
    assert main(argv) == 0
    written = sorted(p.name for p in out_dir.iterdir())
    assert written == [GENAI_CONFIG, "model.int4.onnx", "tokenizer.json", "tokenizer_config.json"]
    modes = {(out_dir / n).stat().st_mode for n in (GENAI_CONFIG, "tokenizer.json")}
    assert len(modes) == 1  # the copies get the umask's mode, as the config does
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "MatMulNBits" in ops
    config = json.loads((out_dir / GENAI_CONFIG).read_text())
    assert config["model"]["decoder"]["filename"] == "model.int4.onnx"

    genai_model = og.Model(str(out_dir))
    tokenizer = og.Tokenizer(genai_model)
    prompt = [int(t) for t in tokenizer.encode("the quick brown fox")]
    assert (
        prompt
        == tokenizers.Tokenizer.from_file(str(out_dir / "tokenizer.json"))
        .encode("the quick brown fox")
        .ids
    )
    steps = 12
    params = og.GeneratorParams(genai_model)
    params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
    generator = og.Generator(genai_model, params)
    generator.append_tokens(prompt)
    generated: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        generated.append(int(generator.get_next_tokens()[0]))
    expected = _ort_greedy(out, cfg, prompt, steps)
    # genai stops early only at EOS (token 0); compare up to there
    assert generated == expected[: len(generated)]
    assert len(generated) == steps or generated[-1] == 0
    assert 0 not in expected[: len(generated) - 1]
    assert isinstance(tokenizer.decode(generated), str)
