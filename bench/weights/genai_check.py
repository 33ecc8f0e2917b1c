"""onnxruntime-genai on a decoder mixprec quantized: genai_config.json written by mixprec
(`mixprec.io.genai`, what `quantize --weights int4 --genai` writes), then greedy decoding of
a chat prompt in onnxruntime-genai beside the same greedy loop in ONNX Runtime
(llm_eval.Decoder, batch 1, 2 threads): the tokens of both, and decode tokens/s of both
(1 / the median step time, steps after the first).

    python -m bench.weights.genai_check MODEL.onnx TOKENIZER_DIR [CONTEXT_LENGTH]

MODEL.onnx's folder receives genai_config.json and the tokenizer files.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench.weights import llm_eval

PROMPT = ("<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n"
          "<|im_start|>assistant\n")
STEPS = 48


def genai_tokens(folder: Path, prompt: list[int]) -> tuple[list[int], float]:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + STEPS, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    tokens: list[int] = []
    times: list[float] = []
    while not generator.is_done():
        begin = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - begin)
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens, 1.0 / statistics.median(times[1:])


def ort_tokens(path: Path, prompt: list[int]) -> tuple[list[int], float]:
    decoder = llm_eval.Decoder.open(path)
    stream = decoder.start(np.asarray(prompt, np.int64))
    tokens = [stream.pick()]
    times = []
    while len(tokens) < STEPS:
        times.append(stream.feed(tokens[-1]))
        tokens.append(stream.pick())
    return tokens, 1.0 / statistics.median(times)


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer

    from mixprec.io.genai import genai_config, write_genai_files

    model, tokenizer_dir = Path(argv[0]), Path(argv[1])
    context = int(argv[2]) if len(argv) > 2 else None
    config = genai_config(model, tokenizer_dir, filename=model.name, context_length=context)
    write_genai_files(config, model, tokenizer_dir)
    prompt = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(PROMPT).ids
    got, genai_speed = genai_tokens(model.parent, prompt)
    want, ort_speed = ort_tokens(model, prompt)
    same = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))
    text = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).decode(got)
    print(f"genai_check: {len(got)} tokens from onnxruntime-genai, the first {same} as ONNX "
          f"Runtime's greedy loop ({len(want)}); decode {genai_speed:.1f} tok/s in genai, "
          f"{ort_speed:.1f} tok/s in ORT")
    print(f"genai_check: text {text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
