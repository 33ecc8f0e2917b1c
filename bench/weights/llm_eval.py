"""Language-model measurements for an ONNX decoder with a KV cache, in ONNX Runtime (CPU,
2 intra-op threads, spinning off), as the weight-only part of the bench uses them.

The decoder contract is bench/exporters/smollm2.py's: inputs ``input_ids``,
``attention_mask`` and ``past_key_values.{i}.key/value`` [batch, kv_heads, past, head_dim];
outputs ``logits`` and ``present.{i}.key/value``. The first step feeds a past of length 0.

Text (gensim 4.4.0's test data, corpus.tsv): calibration comes from ``lee_background.cor``
(300 Lee news documents), held-out evaluation from ``lee.cor`` (the 50 other Lee
documents: no 8-word sequence in common with the background corpus) and the two Wikipedia
paragraphs ``para2para_text1/2.txt``, about 10.8k tokens in all.

* quality on :data:`WINDOWS` evenly spaced, non-overlapping windows of :data:`WINDOW`
  held-out tokens, each run from an empty cache: perplexity (exp of the mean negative
  log-likelihood of tokens 2..256 of each window), KL(P_fp32 || P_model) of the next-token
  distributions (mean over the same positions, nats) and top-1 next-token agreement with
  FP32. FP32's log-probabilities are kept once in a float32 memmap, not recomputed.
* greedy continuations: from the first :data:`GREEDY_PROMPT` tokens of each window,
  :data:`GREEDY_TOKENS` greedy tokens with the cache; the share of windows whose whole
  continuation is FP32's, and the mean share of tokens before the first that differs.
* speed of FP32 and every model in one loop (:func:`speed_loop`): decode tokens/s at
  batch 1 with the cache (:data:`NEW_TOKENS` greedy steps after a
  :data:`PROMPT_TOKENS`-token prompt, all models in lockstep, 1 / the median step time),
  and the latency of a 256-token prefill (median of :data:`PREFILL_RUNS` rounds).
* file size with external data, and a greedy sample of :data:`SAMPLE_TOKENS` tokens from
  a fixed chat prompt (stopping at ``<|im_end|>``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from bench.harness.common import text_dir

THREADS = 2
WINDOW = 256
WINDOWS = 12
PROMPT_TOKENS = 64
NEW_TOKENS = 64
PREFILL_RUNS = 3
SAMPLE_TOKENS = 40
GREEDY_PROMPT = 32
GREEDY_TOKENS = 24
CALIBRATION_FILES = ("lee_background.cor",)
HELDOUT_FILES = ("lee.cor", "para2para_text1.txt", "para2para_text2.txt")
SAMPLE_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and what is it famous "
    "for?<|im_end|>\n<|im_start|>assistant\n"
)
END_TOKEN = "<|im_end|>"


def read_documents(names: Sequence[str]) -> list[str]:
    """Non-empty lines (one document each) of the named text files, in order; utf-8, or
    latin-1 where a file is not utf-8 (lee.cor has one pound sign in latin-1)."""
    docs: list[str] = []
    for name in names:
        raw = (text_dir() / name).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        docs += [line.strip() for line in text.splitlines() if line.strip()]
    return docs


def load_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def token_stream(tokenizer: Any, names: Sequence[str], special: bool = True) -> np.ndarray:
    """The files' documents, joined by blank lines, as one int64 token array (with the
    tokenizer's special tokens, such as a BOS, where ``special``)."""
    text = "\n\n".join(read_documents(names))
    return np.asarray(tokenizer.encode(text, add_special_tokens=special).ids, np.int64)


def windows(tokens: np.ndarray, count: int | None = None, length: int = WINDOW,
            bos: int | None = None) -> list[np.ndarray]:
    """``count`` (default :data:`WINDOWS`) non-overlapping windows of ``length`` tokens,
    evenly spaced; with ``bos``, each window is that token and ``length - 1`` text tokens
    (a model trained to start every sequence with its BOS, as Gemma)."""
    count = WINDOWS if count is None else count
    text = length - (bos is not None)
    fit = len(tokens) // text
    picks = np.linspace(0, fit - 1, min(count, fit)).round().astype(int)
    head = [] if bos is None else [bos]
    return [np.asarray([*head, *tokens[i * text:(i + 1) * text]], np.int64)
            for i in sorted(set(picks.tolist()))]


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    # FP32 and a quantized model are timed alternately on 2 cores: spinning threads of one
    # would steal the cores of the other (BENCH_ORT_SPIN=1: ORT's default, for a model
    # timed alone, as decode_loop.py's docstring says)
    spin = "1" if os.environ.get("BENCH_ORT_SPIN") == "1" else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass
class Decoder:
    """One ORT session of a KV-cache decoder and its cache layout."""

    session: ort.InferenceSession
    past: list[str]
    present: list[str]
    kv_heads: int
    head_dim: int

    @classmethod
    def open(cls, path: Path) -> Decoder:
        sess = session(path)
        past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
        present = [f"present.{p.name.removeprefix('past_key_values.')}" for p in past]
        outputs = {o.name for o in sess.get_outputs()}
        missing = [n for n in ["logits", *present] if n not in outputs]
        if not past or missing:
            raise ValueError(f"not a KV-cache decoder: no past inputs or missing {missing}")
        heads, dim = past[0].shape[1], past[0].shape[3]
        return cls(sess, [p.name for p in past], present, int(heads), int(dim))

    def empty(self, batch: int = 1) -> dict[str, np.ndarray]:
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return {name: np.zeros(shape, np.float32) for name in self.past}

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Logits [len, vocab] of one sequence from an empty cache."""
        feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64),
                 **self.empty()}
        return self.session.run(["logits"], feeds)[0][0]

    def start(self, prompt: np.ndarray) -> Stream:
        """A greedy decoding of ``prompt``: its prefill run (from an empty cache)."""
        feeds = {"input_ids": prompt[None], "attention_mask": np.ones((1, len(prompt)), np.int64),
                 **self.empty()}
        return Stream(self, self.session.run(["logits", *self.present], feeds), len(prompt))

    def greedy(self, prompt: np.ndarray, steps: int, stop: int | None = None) -> list[int]:
        """Up to ``steps`` greedy tokens after ``prompt`` with the cache (ending at ``stop``)."""
        stream = self.start(prompt)
        tokens = [stream.pick()]
        while len(tokens) < steps and tokens[-1] != stop:
            stream.feed(tokens[-1])
            tokens.append(stream.pick())
        return tokens


@dataclass
class Stream:
    """One greedy decoding in progress: the last outputs (logits, present) and the length
    of the sequence so far."""

    decoder: Decoder
    out: list[np.ndarray]
    length: int

    def pick(self) -> int:
        return int(np.argmax(self.out[0][0, -1]))

    def feed(self, token: int) -> float:
        """Runs one step with ``token`` and the cache; the seconds the run took."""
        self.length += 1
        feeds = {"input_ids": np.array([[token]], np.int64),
                 "attention_mask": np.ones((1, self.length), np.int64)}
        feeds.update(zip(self.decoder.past, self.out[1:], strict=True))
        begin = time.perf_counter()
        self.out = self.decoder.session.run(["logits", *self.decoder.present], feeds)
        return time.perf_counter() - begin


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class Reference:
    """FP32's next-token log-probabilities on the windows, in a float32 memmap."""

    def __init__(self, fp32: Decoder, texts: list[np.ndarray], folder: Path) -> None:
        self.texts = texts
        self.path = folder / "fp32_logprobs.f32"
        self.times: list[float] = []
        nll: list[float] = []
        self.data: np.memmap | None = None
        for k, ids in enumerate(texts):
            begin = time.perf_counter()
            logp = _log_softmax(fp32.logits(ids)[:-1])
            self.times.append(time.perf_counter() - begin)
            if self.data is None:
                shape = (len(texts), logp.shape[0], logp.shape[1])
                self.data = np.memmap(self.path, np.float32, "w+", shape=shape)
            self.data[k] = logp
            nll.append(-float(logp[np.arange(len(ids) - 1), ids[1:]].astype(np.float64).sum()))
        self.nll = float(np.sum(nll)) / sum(len(t) - 1 for t in texts)
        self.greedy = [fp32.greedy(ids[:GREEDY_PROMPT], GREEDY_TOKENS) for ids in texts]

    def quality(self) -> dict[str, Any]:
        return {"perplexity": float(np.exp(self.nll)), "kl": 0.0, "top1_agreement": 1.0,
                "tokens_scored": sum(len(t) - 1 for t in self.texts),
                "windows": len(self.texts), "greedy_same": 1.0, "greedy_prefix": 1.0}

    def greedy_agreement(self, model: Any) -> dict[str, float]:
        """The share of windows whose greedy continuation is FP32's, and the mean share of
        its tokens before the first that differs."""
        same = prefix = 0.0
        for ids, want in zip(self.texts, self.greedy, strict=True):
            got = model.greedy(ids[:GREEDY_PROMPT], GREEDY_TOKENS)
            pairs = enumerate(zip(got, want, strict=True))
            first = next((i for i, (a, b) in pairs if a != b), len(want))
            same += float(first == len(want))
            prefix += first / len(want)
        return {"greedy_same": same / len(self.texts), "greedy_prefix": prefix / len(self.texts)}

    def compare(self, model: Decoder) -> dict[str, Any]:
        """Perplexity, mean KL(FP32 || model) and top-1 agreement on the same windows."""
        assert self.data is not None
        nll = kl = agree = 0.0
        for k, ids in enumerate(self.texts):
            logq = _log_softmax(model.logits(ids)[:-1])
            logp = np.asarray(self.data[k])
            nll -= float(logq[np.arange(len(ids) - 1), ids[1:]].astype(np.float64).sum())
            kl += float((np.exp(logp) * (logp - logq)).sum(dtype=np.float64))
            agree += float((logp.argmax(-1) == logq.argmax(-1)).sum())
        count = sum(len(t) - 1 for t in self.texts)
        return {"perplexity": float(np.exp(nll / count)), "kl": kl / count,
                "top1_agreement": agree / count, "tokens_scored": count,
                "windows": len(self.texts), **self.greedy_agreement(model)}

    def close(self) -> None:
        self.data = None
        self.path.unlink(missing_ok=True)


def speed_loop(models: dict[str, Decoder], prompt: np.ndarray,
               prefill: np.ndarray) -> dict[str, dict[str, float]]:
    """Decode tokens/s and prefill latency of every model, the first being the reference.

    Decoding runs in lockstep: each of the :data:`NEW_TOKENS` steps runs once per model
    (in alternating order) before the next step, so every model's steps are timed under
    the same machine load; tokens/s = 1 / the median step time. Prefill: one run of
    ``prefill`` per model per round, :data:`PREFILL_RUNS` rounds in alternating order,
    the median. Ratios are to the first model's."""
    names = list(models)
    for dec in models.values():  # warm-up
        dec.greedy(prompt[:8], 2)
    streams = {name: models[name].start(prompt) for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    for k in range(NEW_TOKENS):
        for name in names if k % 2 == 0 else names[::-1]:
            stream = streams[name]
            steps[name].append(stream.feed(stream.pick()))
    prefill_s: dict[str, list[float]] = {name: [] for name in names}
    for k in range(PREFILL_RUNS):
        for name in names if k % 2 == 0 else names[::-1]:
            begin = time.perf_counter()
            models[name].logits(prefill)
            prefill_s[name].append(time.perf_counter() - begin)
    tok_s = {name: 1.0 / statistics.median(v) for name, v in steps.items()}
    pre = {name: statistics.median(v) for name, v in prefill_s.items()}
    ref = names[0]
    return {name: {"decode_tok_s": tok_s[name], "decode_speedup": tok_s[name] / tok_s[ref],
                   "prefill_ms": pre[name] * 1e3, "prefill_ratio": pre[name] / pre[ref]}
            for name in names}


def sample_text(model: Decoder, tokenizer: Any, prompt_text: str = SAMPLE_PROMPT,
                end: str = END_TOKEN) -> str:
    prompt = np.asarray(tokenizer.encode(prompt_text).ids, np.int64)
    tokens = model.greedy(prompt, SAMPLE_TOKENS, stop=tokenizer.token_to_id(end))
    return tokenizer.decode(tokens, skip_special_tokens=False)


def file_size(path: Path) -> int:
    """Bytes of the model file and of every external data file it names."""
    model = onnx.load(str(path), load_external_data=False)
    files: set[str] = set()
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        tensors = list(graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR:
                    tensors.append(attr.t)
                graphs += [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for tensor in tensors:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                files.update(e.value for e in tensor.external_data if e.key == "location")
    return path.stat().st_size + sum((path.parent / f).stat().st_size for f in files)


def calibration_samples(tokenizer: Any, decoder_io: Decoder, count: int = 16,
                        length: int = WINDOW,
                        bos: int | None = None) -> list[dict[str, np.ndarray]]:
    """``count`` feed dicts of ``length`` calibration tokens each (lee_background.cor,
    evenly spaced windows, each after ``bos`` if given), with an empty cache: what
    ``--calibration-data DIR`` reads."""
    stream = token_stream(tokenizer, CALIBRATION_FILES, special=bos is None)
    texts = windows(stream, count, length, bos)
    return [{"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64),
             **decoder_io.empty()} for ids in texts]
