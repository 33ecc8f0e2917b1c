"""Export a causal LM that transformers loads from a GGUF file to ONNX with a KV cache: the
code export_smollm2.py and export_gemma3.py share.

transformers loads the GGUF file (`from_pretrained(folder, gguf_file=...)`, with the `gguf`
and `accelerate` packages), dequantizing every tensor to float32, with eager attention.
The graph (opset 17, `torch.onnx.export(dynamo=False)`, IR version the lowest the opset
allows, so that ORT 1.31 loads it; weights in external data `model.onnx.data`):

  inputs   input_ids                   int64   [batch, sequence]
           attention_mask              int64   [batch, past_sequence + sequence]
           past_key_values.{i}.key     float32 [batch, kv_heads, past_sequence, head_dim]
           past_key_values.{i}.value   float32 [batch, kv_heads, past_sequence, head_dim]
  outputs  logits                      float32 [batch, sequence, vocab]
           present.{i}.key / .value    float32 [batch, kv_heads, past_sequence + sequence,
                                                head_dim]

No position_ids input: positions are computed in the graph from the attention mask
(cumsum - 1, as transformers' generate does), so left padding works and a caller feeds only
ids, mask and the cache. The first step feeds a past of length 0. Every layer keeps its
whole cache; a model with sliding-window layers (Gemma 3) gets their window from the mask
(a key is seen when query - key < window), not by cropping its cache, so every present
has the same length. Verified against transformers: logits (relative max error) of a
prompt and of one cached step, a left-padded batch against its rows run alone, and greedy
decoding with the cache in ORT against `generate`. The tokenizer is saved beside the model
(tokenizer.json). :func:`main` caches the export with a stamp of the inputs' digests.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

from bench.harness.common import sha256_of

OPSET = 17
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
VERIFY_PROMPTS = (
    "The history of the city of Berlin begins with",
    "In a statement released on Monday, the company said",
)
MAX_REL_ERROR = 1e-3


@dataclass(frozen=True)
class Spec:
    """One model to export: where its GGUF file is and what the export checks."""

    name: str  # "export_<name>:" in messages
    gguf: Path
    target: Path  # the export's folder (<cache>/derived/<name>)
    prompt: str  # greedy decoding with the cache is checked on it (48 tokens)
    script: Path  # the exporting script, whose digest is in the stamp
    stamp_extra: dict[str, Any]  # more fields for export.json (caveat, GGUF types)


def io_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", *past], ["logits", *present]


class Decoder(torch.nn.Module):
    """A causal LM as a function of (ids, mask, flat past) -> (logits, flat present)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.layers = int(lm.config.num_hidden_layers)
        types = getattr(lm.config, "layer_types", None) or []
        self.window = int(lm.config.sliding_window) if "sliding_attention" in types else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache()  # full layers only: sliding windows come from the mask
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        seq = input_ids.shape[1]
        total = attention_mask.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, total - seq:]
        query = torch.arange(seq, device=input_ids.device) + (total - seq)
        key = torch.arange(total, device=input_ids.device)
        causal = key[None, :] <= query[:, None]
        padded = attention_mask[:, None, None, :].bool()
        mask: Any = _bias(causal[None, None] & padded)
        if self.window is not None:  # Gemma 3: a mask per layer type
            near = causal & (key[None, :] > query[:, None] - self.window)
            mask = {"full_attention": mask, "sliding_attention": _bias(near[None, None] & padded)}
        out = self.lm(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                      past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def head_dim(cfg: Any) -> int:
    """The attention head width (Qwen2's config leaves it to hidden / heads)."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _bias(allowed: torch.Tensor) -> torch.Tensor:
    return (1.0 - allowed.to(torch.float32)) * torch.finfo(torch.float32).min


def load(gguf: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32, attn_implementation="eager")
    return lm.eval(), tokenizer


def gguf_types(path: Path) -> dict[str, Any]:
    """How many tensors (and parameters) of the GGUF file have each quant type, overall
    and per tensor kind (attn_q, ffn_down, token_embd, ...)."""
    from gguf import GGUFReader

    tensors: Counter[str] = Counter()
    params: Counter[str] = Counter()
    kinds: dict[str, Counter[str]] = {}
    for t in GGUFReader(str(path)).tensors:
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name.split(".")[0]
        tensors[t.tensor_type.name] += 1
        params[t.tensor_type.name] += int(t.n_elements)
        kinds.setdefault(kind, Counter())[t.tensor_type.name] += 1
    return {"tensors": dict(tensors), "parameters": dict(params),
            "per_kind": {k: dict(v) for k, v in kinds.items()}}


def export(decoder: Decoder, folder: Path) -> Path:
    """Exports to ``folder`` (model.onnx + model.onnx.data); returns the model path."""
    import onnx

    cfg = decoder.lm.config
    heads, width = int(cfg.num_key_value_heads), head_dim(cfg)
    inputs, outputs = io_names(decoder.layers)
    batch, seq, past = 2, 5, 3
    generator = torch.Generator().manual_seed(0)
    args = [torch.randint(0, 1000, (batch, seq), generator=generator),
            torch.ones(batch, past + seq, dtype=torch.int64)]
    args += [torch.randn(batch, heads, past, width, generator=generator)
             for _ in range(2 * decoder.layers)]
    axes: dict[str, dict[int, str]] = {
        "input_ids": {0: "batch", 1: "sequence"},
        "attention_mask": {0: "batch", 1: "total_sequence"},
        "logits": {0: "batch", 1: "sequence"},
    }
    axes.update({name: {0: "batch", 2: "past_sequence"} for name in inputs[2:]})
    axes.update({name: {0: "batch", 2: "total_sequence"} for name in outputs[1:]})
    raw = folder / "raw.onnx"
    with torch.no_grad():
        torch.onnx.export(decoder, tuple(args), str(raw), input_names=inputs,
                          output_names=outputs, dynamic_axes=axes, opset_version=OPSET,
                          do_constant_folding=True, dynamo=False)
    model = onnx.load(str(raw))
    model.ir_version = onnx.helper.find_min_ir_version_for(list(model.opset_import))
    for path in folder.iterdir():
        path.unlink()
    target = folder / MODEL_FILE
    onnx.save(model, str(target), save_as_external_data=True, all_tensors_to_one_file=True,
              location=DATA_FILE, size_threshold=1024)
    onnx.checker.check_model(str(target))
    return target


def empty_past(layers: int, batch: int, heads: int, head_dim: int) -> dict[str, np.ndarray]:
    names = io_names(layers)[0][2:]
    return {n: np.zeros((batch, heads, 0, head_dim), np.float32) for n in names}


def ort_greedy(session: Any, layers: int, ids: np.ndarray, new_tokens: int, heads: int,
               head_dim: int) -> list[int]:
    """Greedy decoding in ORT with the KV cache, batch 1."""
    outputs = io_names(layers)[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             **empty_past(layers, 1, heads, head_dim)}
    tokens: list[int] = []
    for _ in range(new_tokens):
        got = dict(zip(outputs, session.run(outputs, feeds), strict=True))
        token = int(np.argmax(got["logits"][0, -1]))
        tokens.append(token)
        mask = np.concatenate([feeds["attention_mask"], np.ones((1, 1), np.int64)], axis=1)
        feeds = {"input_ids": np.array([[token]], np.int64), "attention_mask": mask}
        feeds.update({f"past_key_values.{n[len('present.'):]}": v
                      for n, v in got.items() if n.startswith("present.")})
    return tokens


def verify(spec: Spec, lm: Any, tokenizer: Any, target: Path) -> dict[str, Any]:
    import onnxruntime as ort

    cfg = lm.config
    layers, heads, width = cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim(cfg)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
    found: dict[str, Any] = {}
    # 1. logits of a prompt with an empty past, then one step with that past
    ids = tokenizer(VERIFY_PROMPTS[0], return_tensors="np")["input_ids"].astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             **empty_past(layers, 1, heads, width)}
    got = session.run(None, feeds)
    with torch.no_grad():
        ref = lm(input_ids=torch.from_numpy(ids), use_cache=True)
    found["prefill_rel_error"] = _rel(ref.logits.numpy(), got[0])
    step = np.array([[int(np.argmax(got[0][0, -1]))]], np.int64)
    feeds = {"input_ids": step, "attention_mask": np.ones((1, ids.shape[1] + 1), np.int64)}
    feeds.update({n: v for n, v in zip(io_names(layers)[0][2:], got[1:], strict=True)})
    with torch.no_grad():
        ref_step = lm(input_ids=torch.from_numpy(step), past_key_values=ref.past_key_values)
    found["step_rel_error"] = _rel(ref_step.logits.numpy(), session.run(["logits"], feeds)[0])
    # 2. a left-padded batch against its rows alone (last-position logits)
    found["padded_batch_rel_error"] = _padded_batch(session, tokenizer, layers, heads, width)
    # 3. greedy decoding with the cache against transformers' generate
    prompt = tokenizer(spec.prompt, return_tensors="pt")
    with torch.no_grad():
        expected = lm.generate(**prompt, max_new_tokens=48, do_sample=False)[0].tolist()
    expected = expected[prompt["input_ids"].shape[1]:]
    tokens = ort_greedy(session, layers, prompt["input_ids"].numpy(), len(expected), heads,
                        width)
    found["greedy_tokens_equal"] = tokens == expected
    found["greedy_text"] = tokenizer.decode(tokens)
    print(f"export_{spec.name}: {json.dumps(found)}", flush=True)
    errors = [found["prefill_rel_error"], found["step_rel_error"],
              found["padded_batch_rel_error"]]
    if max(errors) > MAX_REL_ERROR or not found["greedy_tokens_equal"]:
        raise SystemExit(f"export_{spec.name}: export does not match transformers: {found}")
    return found


def _rel(ref: np.ndarray, got: np.ndarray) -> float:
    return float(np.max(np.abs(ref - got)) / np.max(np.abs(ref)))


def _padded_batch(session: Any, tokenizer: Any, layers: int, heads: int, head_dim: int) -> float:
    rows = [tokenizer(p, return_tensors="np")["input_ids"][0].astype(np.int64)
            for p in VERIFY_PROMPTS]
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    batch = session.run(["logits"], {"input_ids": ids, "attention_mask": mask,
                                     **empty_past(layers, len(rows), heads, head_dim)})[0]
    worst = 0.0
    for i, r in enumerate(rows):
        feeds = {"input_ids": r[None], "attention_mask": np.ones((1, len(r)), np.int64),
                 **empty_past(layers, 1, heads, head_dim)}
        alone = session.run(["logits"], feeds)[0]
        worst = max(worst, _rel(alone[0, -1], batch[i, -1]))
    return worst


def cached(spec: Spec) -> bool:
    """Whether the export in spec.target was made from the same file, torch and scripts."""
    stamp = spec.target / "export.json"
    if not (stamp.is_file() and (spec.target / MODEL_FILE).is_file()):
        return False
    meta = json.loads(stamp.read_text())
    return (meta.get("gguf_sha256"), meta.get("torch"), meta.get("script_sha256"),
            meta.get("shared_sha256")) == (sha256_of(spec.gguf), torch.__version__,
                                           sha256_of(spec.script), sha256_of(Path(__file__)))


def run(spec: Spec, prepare: Callable[[Any], None] | None = None) -> int:
    """Loads, exports, verifies and stamps ``spec``'s model unless it is cached;
    ``prepare(lm)`` may adjust the loaded model first."""
    if cached(spec):
        print(f"export_{spec.name}: cached {spec.target / MODEL_FILE}")
        return 0
    torch.manual_seed(0)
    torch.set_num_threads(2)
    start = time.perf_counter()
    lm, tokenizer = load(spec.gguf)
    if prepare is not None:
        prepare(lm)
    part = spec.target.with_name(spec.target.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    export(Decoder(lm), part)
    tokenizer.save_pretrained(str(part))
    found = verify(spec, lm, tokenizer, part / MODEL_FILE)
    import transformers

    (part / "export.json").write_text(json.dumps({
        "gguf_sha256": sha256_of(spec.gguf), "torch": torch.__version__,
        "script_sha256": sha256_of(spec.script), "shared_sha256": sha256_of(Path(__file__)),
        "transformers": transformers.__version__, "exporter": "torch.onnx.export(dynamo=False)",
        "opset": OPSET, "verification": found, "export_s": time.perf_counter() - start,
        **spec.stamp_extra,
    }, indent=2))
    shutil.rmtree(spec.target, ignore_errors=True)
    part.replace(spec.target)
    print(f"export_{spec.name}: wrote {spec.target / MODEL_FILE} in "
          f"{time.perf_counter() - start:.1f}s")
    return 0
