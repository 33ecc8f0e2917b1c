"""Language models through weight-only quantization: ``.txt`` data tokenized into decoder
windows (a word-level ``tokenizer.json`` built here with the tokenizers package), the
next-token guard (KL, agreement and perplexity recomputed here in numpy from ONNX
Runtime runs of the FP32 and the written model), its repair by sensitivity on a decoder
built so that 4 bits ruin two of its layers, and exit 1 where the repair cannot help
(the ruin is in the 8-bit lm_head, which the repair leaves alone). Every model is the
tiny KV-cache decoder of ``tests/llm_models.py`` (a few hundred KB)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import mixprec
from helpers import run_ort
from llm_models import DecoderConfig, greedy_decode, tiny_decoder
from mixprec.checks.greedy import PROMPT as GREEDY_PROMPT
from mixprec.checks.guard_samples import WINDOWS_HELD_OUT_SHARE, held_out_indices
from mixprec.cli.main import main
from mixprec.core.errors import MixprecError
from mixprec.inputs.text import TextSamples, find_tokenizer
from mixprec.repair.language_guard import next_token_stats
from mixprec.weights import mixed_bits
from mixprec.weights.config import WeightsConfig

tokenizers = pytest.importorskip("tokenizers", reason="the [llm] extra (tokenizers) is missing")

CFG = DecoderConfig()
WORDS = [f"w{i}" for i in range(250)]


def _tokenizer(path: Path) -> Path:
    """A word-level tokenizer: word ``wK`` is token K + 1, anything else 0."""
    vocab = {"[UNK]": 0, **{w: k + 1 for k, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _text(path: Path, words: int, seed: int) -> Path:
    """Words drawn with a Zipf-like skew (a few common words, as in text)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(WORDS) + 1)
    path.write_text(" ".join(rng.choice(WORDS, words, p=p / p.sum())), encoding="utf-8")
    return path


def _folder(tmp_path: Path, model: onnx.ModelProto) -> Path:
    """The model, its tokenizer.json beside it, calib.txt and eval.txt."""
    onnx.save(model, str(tmp_path / "model.onnx"))
    _tokenizer(tmp_path / "tokenizer.json")
    _text(tmp_path / "calib.txt", 2400, seed=1)
    _text(tmp_path / "eval.txt", 600, seed=2)
    return tmp_path / "model.onnx"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _numpy_guard(fp32: Path | onnx.ModelProto, model: Path, windows: list[dict]) -> dict:
    """KL(FP32 || model), top-1 agreement and both perplexities over the windows, in
    float64 from ONNX Runtime's logits (at a deployment's optimizations, as the guard
    runs them): what the guard must report."""
    kl = agree = nll32 = nll = n = 0.0
    for feeds in windows:
        p = _log_softmax(run_ort(fp32, feeds, optimize=True)["logits"][0, :-1])
        q = _log_softmax(run_ort(model, feeds, optimize=True)["logits"][0, :-1])
        ids = feeds["input_ids"][0, 1:]
        kl += float((np.exp(p) * (p - q)).sum())
        agree += float((p.argmax(-1) == q.argmax(-1)).sum())
        nll32 -= float(p[np.arange(len(ids)), ids].sum())
        nll -= float(q[np.arange(len(ids)), ids].sum())
        n += len(ids)
    return {
        "kl": kl / n,
        "agreement": agree / n,
        "perplexity_fp32": float(np.exp(nll32 / n)),
        "perplexity": float(np.exp(nll / n)),
    }


def _ruined(layers: tuple[str, ...], norm: str, outlier: float) -> onnx.ModelProto:
    """The decoder with a huge weight in rows 0 and 32 of each named weight, rows whose
    input channel ``norm`` zeroes (its gain is 0 there): FP32's outputs do not see them,
    but they set the 4-bit (and 8-bit) scale of their whole block, and every other weight
    of those blocks rounds to 0."""
    model = tiny_decoder(CFG, seed=3)
    inits = {t.name: t for t in model.graph.initializer}
    for name in (*layers, norm):
        array = numpy_helper.to_array(inits[name]).copy()
        if name == norm:
            array[[0, 32]] = 0.0
        else:
            array[[0, 32], :] = outlier
        inits[name].CopyFrom(numpy_helper.from_array(array, name))
    return model


# --- text -> feeds ---------------------------------------------------------------------------


def test_text_becomes_windows_of_tokens_with_an_empty_cache(tmp_path: Path) -> None:
    """Each window is the tokenizer's ids in order, a mask of ones and a past of length 0
    with the model's head dims; the FP32 decoder runs on it in ONNX Runtime and gives
    the same logits as the same tokens fed by hand."""
    path = _folder(tmp_path, tiny_decoder(CFG))
    samples = TextSamples(tmp_path / "calib.txt", path, find_tokenizer(path, None), window=64)
    ids = (
        tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        .encode((tmp_path / "calib.txt").read_text())
        .ids
    )
    assert len(ids) == 2400 and len(samples) == 2400 // 64
    windows = list(samples)
    assert len(windows) == len(samples) and list(samples)[1].keys() == windows[1].keys()
    np.testing.assert_array_equal(windows[2]["input_ids"][0], ids[128:192])
    np.testing.assert_array_equal(windows[2]["attention_mask"], np.ones((1, 64), np.int64))
    for name in CFG.past_names():
        assert windows[0][name].shape == (1, CFG.kv_heads, 0, CFG.head_dim)
        assert windows[0][name].dtype == np.float32
    by_hand = {
        "input_ids": np.asarray(ids[:64], np.int64)[None],
        "attention_mask": np.ones((1, 64), np.int64),
        **{n: np.zeros((1, CFG.kv_heads, 0, CFG.head_dim), np.float32) for n in CFG.past_names()},
    }
    np.testing.assert_array_equal(
        run_ort(path, windows[0])["logits"], run_ort(path, by_hand)["logits"]
    )


def test_a_tokenizer_that_starts_text_with_a_bos_starts_every_window_with_it(
    tmp_path: Path,
) -> None:
    """Gemma's tokenizer puts <bos> before text, and the model is lost without it: every
    window starts with that token and holds window - 1 text tokens in order."""
    path = _folder(tmp_path, tiny_decoder(CFG))
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    bos = 7  # a word id the test's text uses: what counts is where it goes
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{WORDS[bos - 1]} $A", special_tokens=[(WORDS[bos - 1], bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    samples = TextSamples(tmp_path / "calib.txt", path, tmp_path / "tokenizer.json", window=64)
    ids = tok.encode((tmp_path / "calib.txt").read_text(), add_special_tokens=False).ids
    assert samples.bos == bos and len(samples) == 2400 // 63
    windows = [w["input_ids"][0] for w in samples]
    assert all(w[0] == bos and len(w) == 64 for w in windows)
    np.testing.assert_array_equal(windows[2][1:], ids[126:189])
    assert "each after the tokenizer's first token 7" in samples.describe()


def test_position_ids_and_a_folder_of_text(tmp_path: Path) -> None:
    """A model with position_ids gets 0..N-1; a folder's .txt files are read in name
    order; a text shorter than a window is one window of all its tokens."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["logits"])],
        "ids",
        [
            helper.make_tensor_value_info(n, TensorProto.INT64, ["b", "s"])
            for n in ("input_ids", "position_ids")
        ],
        [helper.make_tensor_value_info("logits", TensorProto.INT64, ["b", "s"])],
    )
    model = helper.make_model(graph)
    tok = _tokenizer(tmp_path / "tok.json")
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "b.txt").write_text("w3 w4")
    (tmp_path / "texts" / "a.txt").write_text("w1 w2")
    (only,) = list(TextSamples(tmp_path / "texts", model, tok, window=64))
    np.testing.assert_array_equal(only["input_ids"], [[2, 3, 4, 5]])
    np.testing.assert_array_equal(only["position_ids"], [[0, 1, 2, 3]])


def test_text_refusals_are_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """No tokenizer beside the model, a model without input_ids, tokenizers missing:
    one line each, exit 2, nothing written."""
    path = tmp_path / "model.onnx"
    onnx.save(tiny_decoder(CFG), str(path))
    _text(tmp_path / "calib.txt", 300, seed=1)
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--weights", "int4"]
    assert main([*args, "--calibration-data", str(tmp_path / "calib.txt")]) == 2
    assert "needs a tokenizer: no tokenizer.json beside" in capsys.readouterr().err
    with pytest.raises(MixprecError, match="has no such input"):
        TextSamples(tmp_path / "calib.txt", _no_ids_model(), _tokenizer(tmp_path / "t.json"))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # an import of it raises
    code = main(
        [
            *args,
            "--calibration-data",
            str(tmp_path / "calib.txt"),
            "--tokenizer",
            str(tmp_path / "t.json"),
        ]
    )
    assert code == 2 and "pip install 'mixprec[llm]'" in capsys.readouterr().err
    assert not out.exists()


def _no_ids_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "x",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph)


def test_next_token_stats_match_float64_sums() -> None:
    rng = np.random.default_rng(0)
    ref, got = rng.normal(size=(1, 9, 50)), rng.normal(size=(1, 9, 50)).astype(np.float32)
    ids = rng.integers(0, 50, (1, 9))
    stats = next_token_stats(_log_softmax(ref).astype(np.float32), got, ids)
    p, q = _log_softmax(ref)[0, :-1], _log_softmax(got)[0, :-1]
    assert stats["tokens"] == 8
    assert stats["kl"] == pytest.approx(float((np.exp(p) * (p - q)).sum()), rel=1e-5)
    assert stats["agree"] == float((p.argmax(-1) == q.argmax(-1)).sum())
    assert stats["nll"] == pytest.approx(-float(q[np.arange(8), ids[0, 1:]].sum()), rel=1e-5)


# --- the guard, its repair, and exit 1 -------------------------------------------------------


def test_the_repair_promotes_the_most_sensitive_layers_until_the_budget_holds(
    tmp_path: Path, monkeypatch
) -> None:
    """A KL budget that int4 misses and 8 bits meets: the first check misses, the repair
    moves the layers the run's own ranking puts first (recorded by its mixed choice, on
    the calibration windows, never the held-out windows that grade it: ranked on those,
    the order differs) to 8 bits, step by step, and the written model's KL, agreement and
    perplexities on the held-out windows, recomputed here, are the guard's and within
    the budget."""
    path = _folder(tmp_path, tiny_decoder(CFG, seed=3))
    budget = {"guard_kl": 0.004, "guard_drop": 0.5, "guard_perplexity": 0.5}
    # a default size budget with room for every linear layer at 8 bits
    monkeypatch.setattr(mixed_bits, "DEFAULT_RATIO", 0.0)
    monkeypatch.setattr(mixed_bits, "DEFAULT_MOST_LAYERS", 1.0)
    result = mixprec.quantize(
        path, tmp_path / "calib.txt", weights="int4", text_window=64, **budget
    )
    guard = result.report.guard
    assert guard["kind"] == "language model" and guard["passed"]
    assert guard["first"]["kl"] > 0.004 >= guard["kl"] and guard["repair"]
    held = list(TextSamples(tmp_path / "calib.txt", path, tmp_path / "tokenizer.json", window=64))
    held_out = held_out_indices(len(held), share=WINDOWS_HELD_OUT_SHARE)
    checks = [held[k] for k in held_out[:4]]
    # the first candidate's ranking: the same run with a budget it meets at once
    loose = {**budget, "guard_kl": 1.0}
    first = mixprec.quantize(path, tmp_path / "calib.txt", weights="int4", text_window=64, **loose)
    assert not first.report.guard["repair"]
    scores = first.report.quantization["mixed"]["scores"]
    ranked = sorted(scores, key=lambda name: -scores[name])
    config = WeightsConfig(bits=4, method="awq")
    rank = mixed_bits.rank_layers
    on_checks = [s.name for s in rank(onnx.load(str(path)), config, checks, method="awq")]
    assert ranked != on_checks  # the two rankings differ: which windows rank matters
    promoted = guard["promoted"]
    assert set(promoted) == set(ranked[: guard["repaired_with"]["layers"]]) - _mixed(result)
    # the narrowing keeps the passing step with the fewest promoted layers, and a step
    # with fewer layers than that one missed
    chosen = guard["repaired_with"]
    steps = [s for s in guard["repair"] if s["to"] == chosen["to"]]
    assert chosen["layers"] == min(s["layers"] for s in steps if s["passed"])
    assert any(s["layers"] < chosen["layers"] and not s["passed"] for s in steps) or (
        guard["first"]["kl"] > 0.004 and chosen["layers"] == 1
    )
    assert all(p == "int8" and "sensitivity rank" in why for p, why in promoted.values())
    out = tmp_path / "out.onnx"
    result.save(out)
    expect = _numpy_guard(path, out, checks)
    for key in ("kl", "agreement", "perplexity", "perplexity_fp32"):
        assert guard[key] == pytest.approx(expect[key], rel=1e-3, abs=1e-5), key
    assert "repaired by sensitivity" in guard["summary"]


def test_the_repair_stays_within_the_size_budget_and_says_so(tmp_path: Path, capsys) -> None:
    """The default size budget (a tenth of the linear weights and an eighth of the
    linear layers at 8 bits) has room for one of the tiny decoder's 14 layers: the repair
    tries it and no more, and the miss names the budget instead of growing the model."""
    path = _folder(tmp_path, tiny_decoder(CFG, seed=3))
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--weights", "int4", "--text-window", "64"]
    args += ["--calibration-data", str(tmp_path / "calib.txt"), "--max-kl", "0.004"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "language-model guard FAILED" in err and "has room for 1 of 14 int4 layers" in err
    assert not out.exists()
    result = mixprec.quantize(
        path, tmp_path / "calib.txt", weights="int4", text_window=64, guard_kl=0.004
    )
    guard, mixed = result.report.guard, result.report.quantization["mixed"]
    assert [s["layers"] for s in guard["repair"]] == [1]
    assert all(s["to"] == "int8" for s in guard["repair"])
    assert result.report.param_bytes_after <= mixed["budget"]["goal_bytes"]
    # the verdict in the guard's one schema: each next-token figure held to its budget
    checks = {c["kind"]: c for c in guard["checks"]}
    assert set(checks) == {"kl", "next-token", "perplexity-rise"}
    kl = checks["kl"]
    assert (kl["value"], kl["limit"], kl["rows"]) == (guard["kl"], 0.004, guard["tokens"])
    assert not kl["passed"] and f"KL {guard['kl']:.3g} > 0.004 (--max-kl)" in err
    assert checks["next-token"]["value"] == guard["agreement"]
    assert checks["perplexity-rise"]["value"] == pytest.approx(guard["perplexity_rise"])
    for kind, c in checks.items():  # an error holds below its limit, a share above
        holds = c["value"] <= c["limit"] if kind != "next-token" else c["value"] >= c["limit"]
        assert c["passed"] == holds, kind
    failed = err.split("language-model guard FAILED (")[1].split(")); ")[0]
    assert failed.count("(--max-") == sum(not c["passed"] for c in checks.values()), failed


def _mixed(result) -> set[str]:
    """The layers the default mixed choice already put at 8 bits."""
    return set((result.report.quantization or {}).get("mixed", {}).get("int8", []))


def test_a_miss_the_repair_cannot_fix_exits_1_and_writes_nothing(tmp_path: Path, capsys) -> None:
    """Outliers in the lm_head (8 bits by default, outside the repair) in rows its input
    never feeds set every block's scale: round to nearest loses every other weight, the
    logits go flat, every repair step misses, and the command exits 1 with the guard's
    numbers and writes nothing."""
    model = _ruined(("lm_head.weight",), "final_norm.weight", outlier=4000.0)
    path = _folder(tmp_path, model)
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--weights", "int4", "--text-window", "64"]
    args += ["--weight-method", "rtn"]
    assert main([*args, "--calibration-data", str(tmp_path / "calib.txt")]) == 1
    err = capsys.readouterr().err
    assert "language-model guard FAILED" in err and "not written" in err
    assert not out.exists()


def test_a_kv_cache_decoder_through_quantize_with_text(tmp_path: Path, capsys) -> None:
    """The command end to end: .txt calibration and eval data, the tokenizer beside the
    model; the written int4 model keeps the cache signature, decodes with it in ONNX
    Runtime, and the guard's numbers on the eval windows are recomputed here."""
    path = _folder(tmp_path, tiny_decoder(CFG))
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--weights", "int4", "--text-window", "64"]
    args += [
        "--calibration-data",
        str(tmp_path / "calib.txt"),
        "--eval-data",
        str(tmp_path / "eval.txt"),
    ]
    args += ["--max-kl", "0.5", "--max-drop", "0.5", "--max-perplexity-rise", "0.5", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    guard = report["guard"]
    assert guard["eval"] == "eval windows" and guard["windows"] == 4 and guard["passed"]
    assert guard["budget"] == {"max_kl": 0.5, "max_drop": 0.5, "max_ppl_rise": 0.5}
    evals = list(TextSamples(tmp_path / "eval.txt", path, tmp_path / "tokenizer.json", window=64))
    expect = _numpy_guard(path, out, evals[:4])
    for key in ("kl", "agreement", "perplexity", "perplexity_fp32"):
        assert guard[key] == pytest.approx(expect[key], rel=1e-3, abs=1e-5), key
    written = onnx.load(str(out))
    assert {n.op_type for n in written.graph.node} >= {"MatMulNBits"}
    assert [i.name for i in written.graph.input] == [
        i.name for i in onnx.load(str(path)).graph.input
    ]
    tokens = greedy_decode(lambda f: run_ort(written, f), CFG, np.array([5, 9, 2, 7]), 6)
    assert len(tokens) == 6 and all(0 <= t < CFG.vocab for t in tokens)


def test_greedy_continuations_are_read_from_one_run_as_a_decoder_would_decode_them(
    tmp_path: Path,
) -> None:
    """The guard's greedy figures (read from one run of the candidate on FP32's
    continuations) equal what decoding does: FP32 and the written model each decode 16
    tokens with the KV cache in ONNX Runtime from the first 32 tokens of every eval window,
    and the share of windows whose continuations agree, and the mean share of tokens before
    the first difference, are the guard's; they are on the last line."""
    path = _folder(tmp_path, tiny_decoder(CFG, seed=3))
    result = mixprec.quantize(
        path,
        tmp_path / "calib.txt",
        eval_data=tmp_path / "eval.txt",
        weights="int4",
        weight_method="rtn",
        text_window=64,
        guard_kl=5.0,
        guard_drop=0.9,
        guard_perplexity=5.0,
    )
    guard = result.report.guard
    out = tmp_path / "out.onnx"
    result.save(out)
    evals = list(TextSamples(tmp_path / "eval.txt", path, tmp_path / "tokenizer.json", window=64))
    same = prefix = 0.0
    for window in evals[:4]:
        prompt = window["input_ids"][0, :GREEDY_PROMPT]
        want = greedy_decode(lambda f: run_ort(path, f, optimize=True), CFG, prompt, 16)
        got = greedy_decode(lambda f: run_ort(out, f, optimize=True), CFG, prompt, 16)
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), 16)
        same += first == 16
        prefix += first / 16
    assert guard["greedy_windows"] == 4
    assert guard["greedy_same"] == pytest.approx(same / 4)
    assert guard["greedy_prefix"] == pytest.approx(prefix / 4)
    assert 0 < prefix < 4  # int4 RTN on this decoder changes some tokens, not all
    assert f"greedy continuations {round(same)}/4 as FP32's" in guard["summary"]


def test_huge_logits_are_a_measured_miss_not_a_crash(tmp_path: Path, capsys) -> None:
    """An lm_head scaled by 1e5: logits of ~1e4, a mean next-token loss far above 709,
    whose exp overflows. Before: ``math.exp`` raised OverflowError before the finite
    check, and the command ended in exit 3 ("internal error"). Now the perplexity is
    inf, the guard misses with that reason, exits 1 and writes nothing."""
    model = tiny_decoder(CFG, seed=3)
    head = next(t for t in model.graph.initializer if t.name == "lm_head.weight")
    head.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(head) * 1e5, head.name))
    path = _folder(tmp_path, model)
    evals = list(TextSamples(tmp_path / "eval.txt", path, tmp_path / "tokenizer.json", window=64))
    with np.errstate(over="ignore"):
        fp32 = _numpy_guard(model, path, evals[:4])  # the model against itself, in numpy
    assert fp32["perplexity_fp32"] == np.inf  # float64 exp overflows too (numpy says inf)
    out = tmp_path / "out.onnx"
    args = ["quantize", str(path), "-o", str(out), "--weights", "int4", "--text-window", "64"]
    args += ["--weight-method", "rtn", "--calibration-data", str(tmp_path / "calib.txt")]
    args += ["--eval-data", str(tmp_path / "eval.txt")]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "language-model guard FAILED" in err and "not written" in err, err
    assert "perplexity inf, not finite" in err, err
    assert "internal error" not in err and not out.exists()
    # --json stays strict JSON: a non-finite figure is a string, never Infinity or NaN
    assert main([*args, "--json"]) == 1
    text = capsys.readouterr().out

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    guard = json.loads(text, parse_constant=refuse)["guard"]
    assert guard["perplexity"] == "inf" and not guard["passed"]
    rise = next(c for c in guard["checks"] if c["kind"] == "perplexity-rise")
    assert rise["value"] in ("inf", "nan") and rise["note"].startswith("perplexity inf")


def _without_cache() -> onnx.ModelProto:
    """The tiny decoder with its past inputs cut out (each Concat of past and new keys
    keeps the new ones alone): a decoder that recomputes the whole sequence per call."""
    model = tiny_decoder(CFG)
    past = {i.name for i in model.graph.input if i.name.startswith("past_key_values")}
    for node in model.graph.node:
        if node.op_type == "Concat" and node.input[0] in past:
            del node.input[0]
    kept = [i for i in model.graph.input if i.name not in past]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_a_decoder_without_a_kv_cache_still_quantizes_with_a_note(tmp_path: Path) -> None:
    path = _folder(tmp_path, _without_cache())
    result = mixprec.quantize(
        path, tmp_path / "calib.txt", weights="int4", text_window=64, max_size=0.5
    )
    assert result.report.guard["kind"] == "language model" and result.report.guard["passed"]
    assert any("without a KV cache" in n for n in result.report.notes), result.report.notes
    ids = np.array([[5, 9, 2, 7, 1]], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    ref, got = run_ort(onnx.load(str(path)), feeds)["logits"], run_ort(result.model_proto, feeds)
    assert np.argmax(got["logits"][0, -1]) == np.argmax(ref[0, -1])
